"""The kinds of value the variables take, each with its parser: a URL path, a URL, a host, a
token, a JSON list or object, an absolute path, a Dynamo endpoint. Each raises ValueError with
what is wrong; the loader (``load.py``) names the variable and what was expected."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, ValidationInfo
from pydantic_settings import NoDecode

from sidecar.core.vocabulary import MAX_DP_RANKS, MONITORED_ENDPOINTS, OPTIONAL_ENDPOINTS, Mode
from sidecar.runtime.grpctarget import grpc_target, host_problem

MAX_SECONDS = 86_400.0
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header value can carry
_DYNAMO_NAME = re.compile(r"[A-Za-z0-9_-]{1,253}")
MODE_ALIASES = {"agg": Mode.AGGREGATED, "prefill_and_decode": Mode.AGGREGATED}


def path_problem(path: str) -> str | None:
    if not path.startswith("/") or "//" in path:
        return "not a URL path"
    if any(not (0x21 <= ord(c) <= 0x7E) or c in "?#" for c in path):
        return "not a URL path (spaces, control characters, non-ASCII, ? and # are not allowed)"
    return None


def json_loads(text: str) -> Any:
    """Strict JSON (RFC 8259): no NaN or Infinity; raises ValueError on anything else."""

    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(text, parse_constant=reject)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _url_path(value: str) -> str:
    problem = path_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _host(value: str) -> str:
    problem = host_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _token(value: Any) -> Any:
    if isinstance(value, str) and not _TOKEN.fullmatch(value):
        raise ValueError("not a token: only visible ASCII characters, no spaces")
    return value


def http_url(value: str) -> str:
    """An http(s) URL with a host and no query, fragment or credentials."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError("not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("has a query, fragment or credentials")
    if "\\" in value or host_problem(parts.hostname):
        raise ValueError("the host is not an IP address or host name")
    if path_problem(parts.path or "/"):
        raise ValueError("the path has characters a URL cannot carry")
    if port == 0:
        raise ValueError("port 0")
    return value.rstrip("/")


def _engine_url(value: str) -> str:
    """An http(s) URL, or a gRPC server's grpc://HOST:PORT (which transport takes which is the
    transport's rule)."""
    if value.startswith("grpc:"):
        if grpc_target(value).service:  # raises ValueError naming what is wrong
            raise ValueError("a grpc:// engine URL names no service: grpc://HOST:PORT")
        return value.rstrip("/")
    return http_url(value)


def _grpc_target(value: str) -> str:
    grpc_target(value)  # raises ValueError naming what is wrong
    return value


def _dynamo_endpoint(value: str) -> str:
    path = value.removeprefix("dyn://")
    parts = path.split(".")
    if len(parts) not in (1, 3) or not all(_DYNAMO_NAME.fullmatch(p) for p in parts):
        raise ValueError("not an endpoint name nor namespace.component.endpoint")
    return path


def _absolute(value: str) -> str:
    if not Path(value).is_absolute():
        raise ValueError("not an absolute path")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("blank")
    return value


def _ranks(value: Any) -> Any:
    text = value.strip() if isinstance(value, str) else value
    if text is None or text == "auto":
        return text
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and 1 <= text <= MAX_DP_RANKS:
        return text
    raise ValueError(f"not an integer from 1 to {MAX_DP_RANKS}, nor auto")


def _endpoint_list(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = json_loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of strings")
    unknown = [v for v in value if v not in MONITORED_ENDPOINTS and v not in OPTIONAL_ENDPOINTS]
    if unknown:
        raise ValueError(f"the sidecar does not monitor {', '.join(map(repr, unknown))}")
    return tuple(dict.fromkeys(value))


#: The largest DYN_HEALTH_CHECK_PAYLOAD file read (a canary is a small request).
MAX_PAYLOAD_BYTES = 1 << 20


def _payload(value: Any) -> Any:
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError("not a JSON object")
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            if not path.is_file():  # a FIFO or a device (/dev/zero) would hang or never end
                raise ValueError(f"{str(path)!r} is not a regular file")
            with path.open("rb") as file:
                data = file.read(MAX_PAYLOAD_BYTES + 1)
            if len(data) > MAX_PAYLOAD_BYTES:
                raise ValueError(f"{str(path)!r} holds more than {MAX_PAYLOAD_BYTES} bytes")
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ValueError(f"cannot read {str(path)!r}: {why}") from None
    try:
        parsed = json_loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(parsed, dict):
        raise ValueError("JSON, but not an object")
    try:
        json.dumps(parsed, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError):
        raise ValueError("cannot be sent as a UTF-8 JSON body") from None
    return parsed


def _mode_alias(value: Any) -> Any:
    return MODE_ALIASES.get(value, value) if isinstance(value, str) else value


def _upper(value: Any) -> Any:
    """Levels in any case, as uvicorn and Dynamo's DYN_LOG take them."""
    return value.upper() if isinstance(value, str) else value


#: The values each field with a table of names may take (SIDECAR_BACKEND: the engines'), set
#: by the loader for the time it validates (the tables are the composition root's).
CHOICES: ContextVar[Mapping[str, Collection[str]] | None] = ContextVar("choices", default=None)


def choice_expected(choices: Collection[str]) -> str:
    return "one of " + ", ".join(choices)


def _one_of_the_table(value: str, info: ValidationInfo) -> str:
    names = (CHOICES.get() or {}).get(info.field_name or "")
    if names is not None and value not in names:
        raise ValueError(f"not {choice_expected(names)}")
    return value


UrlPath = Annotated[str, AfterValidator(_url_path)]
Host = Annotated[str, AfterValidator(_host)]
Token = BeforeValidator(_token)
HttpUrl = Annotated[str, AfterValidator(http_url)]
EngineUrl = Annotated[str, AfterValidator(_engine_url)]
GrpcTargetUrl = Annotated[str, AfterValidator(_grpc_target)]
DynamoEndpoint = Annotated[str, AfterValidator(_dynamo_endpoint)]
AbsolutePath = Annotated[str, AfterValidator(_absolute)]
Name = Annotated[str, AfterValidator(_not_blank)]
Ranks = BeforeValidator(_ranks)
EndpointList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_endpoint_list)]
Payload = Annotated[dict[str, Any] | None, NoDecode, BeforeValidator(_payload)]
ModeAlias = BeforeValidator(_mode_alias)
Level = BeforeValidator(_upper)
Choice = Annotated[str, AfterValidator(_not_blank), AfterValidator(_one_of_the_table)]
