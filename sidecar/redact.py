"""Credentials out of every text the sidecar serves or logs: one place for the rule.

An engine or gateway may echo what it was sent (the bearer token, a URL with user:password) in
its error text, and reasons reach /health, the status page, /debug/history and the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

HIDDEN = "<hidden>"
# URL userinfo (scheme://user:password@host), an Authorization header value, a bearer token.
_USERINFO = re.compile(r"(//)[^/@\s]*@")
_AUTHORIZATION = re.compile(r"(authorization\s*[:=]\s*)\S+(?:\s+\S+)?", re.IGNORECASE)
_BEARER = re.compile(r"(bearer\s+)\S+", re.IGNORECASE)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the given secrets, URL credentials or Authorization/bearer values."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, HIDDEN)
    text = _USERINFO.sub(rf"\1{HIDDEN}@", text)
    text = _AUTHORIZATION.sub(rf"\1{HIDDEN}", text)
    return _BEARER.sub(rf"\1{HIDDEN}", text)
