"""Secrets out of every text the sidecar serves or logs: the one rule for what is secret.

What is secret: a URL's user and password (scheme://user:password@host), an Authorization
header's value or a bearer token, the values the user set as tokens (SIDECAR_ENGINE_API_KEY,
SIDECAR_CONTROL_TOKEN), and any field of a JSON object whose name says key, token, secret,
password or credential (DYN_HEALTH_CHECK_PAYLOAD's). An engine or gateway may echo what it was
sent in its error text, and reasons reach /health, the status page, /debug/history, the metrics'
labels and the log: each output passes its text through :func:`redact` (and a configured value
through :func:`scrubbed`) at one place.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

HIDDEN = "<hidden>"
# URL userinfo (scheme://user:password@host), an Authorization header value, a bearer token.
_USERINFO = re.compile(r"(//)[^/@\s]*@")
_AUTHORIZATION = re.compile(r"(authorization\s*[:=]\s*)\S+(?:\s+\S+)?", re.IGNORECASE)
_BEARER = re.compile(r"(bearer\s+)(?!tokens?\b)\S+", re.IGNORECASE)  # not the word "token"
# A field in JSON text (a payload, an echoed body): "name": "value", or "name": a number or word.
_JSON_FIELD = re.compile(r'("([A-Za-z0-9_.-]+)"\s*:\s*)("(?:[^"\\]|\\.)*"|[^\s,}\]]+)')
# A field named like a secret: its last word is one of these (api_key, apiKey, access_token,
# client_secret, password, credentials, authorization), so max_tokens or stop_token_ids are not.
_SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "bearer",
        "cookie",
    }
)
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the given secrets, URL credentials, Authorization and bearer values, or
    the values of JSON fields named like secrets."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, HIDDEN)
    text = _USERINFO.sub(rf"\1{HIDDEN}@", text)
    text = _AUTHORIZATION.sub(rf"\1{HIDDEN}", text)
    text = _JSON_FIELD.sub(_hide_field, text)
    return _BEARER.sub(rf"\1{HIDDEN}", text)


def _hide_field(match: re.Match[str]) -> str:
    if not secret_name(match.group(2)):
        return match.group(0)
    value = match.group(3)
    return match.group(1) + (f'"{HIDDEN}"' if value.startswith('"') else HIDDEN)


def secret_name(name: str) -> bool:
    """A field or variable whose name says it holds a secret."""
    words = _WORD.findall(name)
    return bool(words) and words[-1].lower() in _SECRET_WORDS


def scrubbed(value: Any) -> Any:
    """``value`` with its secrets hidden: in a string, URL credentials and bearer values; in a
    JSON object, every field named like a secret, at any depth."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: HIDDEN if secret_name(str(k)) else scrubbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrubbed(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """The log's one place for the rule: every record a handler writes, at every level, its
    message and its traceback, has its secrets hidden (the configured tokens, URL credentials,
    Authorization and bearer values)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage(), self.secrets), None
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_info, record.exc_text = None, redact(text, self.secrets)
        elif record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        return True
