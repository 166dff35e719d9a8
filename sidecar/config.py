"""Configuration: read once from the environment, validated loudly.

Every variable is a field of :class:`Settings`; its ``description`` is the README's text and its
``expected`` note is what a user sees when the value is malformed. :func:`load_settings` is the
only entry point: it returns valid settings or raises :class:`ConfigError`, whose lines each
name one variable, the value it had and what was expected. Nothing falls back silently.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from dotenv import dotenv_values
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# The endpoints the sidecar monitors. Dynamo names the generation endpoint "generate"; it is the
# only one a canary can prove, so it is the only one a user may list.
GENERATE = "generate"
MONITORED_ENDPOINTS: tuple[str, ...] = (GENERATE,)
# Endpoints that exist only when configured (kv_transfer: SIDECAR_KV_PEER_URL). They inform,
# and gate readiness only when DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS lists them.
KV_TRANSFER = "kv_transfer"
OPTIONAL_ENDPOINTS: tuple[str, ...] = (KV_TRANSFER,)

MAX_SECONDS = 86_400.0
MAX_VALUE_SHOWN = 80
# Routes the sidecar serves itself; the probe paths may not take them.
RESERVED_ROUTES = {
    "/metrics": "the metrics route",
    "/openapi.json": "the OpenAPI schema route",
    "/sidecar/live": "the sidecar's own liveness route",
    "/": "the status page",
    "/debug/history": "the status page's history route",
}
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header value can carry
_CREDENTIALS = re.compile(r"(//)[^/@]*@")
_DYNAMO_NAME = re.compile(r"[A-Za-z0-9_-]{1,253}")


def _host_problem(host: str) -> str | None:
    """None for an IP address or an RFC 1123 host name, else what is wrong."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return "not an IP address or host name"
    return None


def _path_problem(path: str) -> str | None:
    if not path.startswith("/") or "//" in path:
        return "not a URL path"
    if any(not (0x21 <= ord(c) <= 0x7E) or c in "?#" for c in path):
        return "not a URL path (spaces, control characters, non-ASCII, ? and # are not allowed)"
    return None


def _json_loads(text: str) -> Any:
    """Strict JSON (RFC 8259): no NaN or Infinity; raises ValueError on anything else."""

    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(text, parse_constant=reject)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class Transport(StrEnum):
    HTTP = "http"  # the engine's own HTTP API at SIDECAR_ENGINE_URL
    DYNAMO = "dynamo"  # Dynamo's request plane, straight to the worker's instance


class DiscoveryBackend(StrEnum):
    """Dynamo's discovery backends a separate process can share with the worker."""

    ETCD = "etcd"
    FILE = "file"
    KUBERNETES = "kubernetes"


class RequestPlane(StrEnum):
    TCP = "tcp"
    NATS = "nats"
    HTTP = "http"


class Backend(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    OPENAI = "openai"


class Mode(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


MODE_ALIASES = {"agg": Mode.AGGREGATED, "prefill_and_decode": Mode.AGGREGATED}


class ModelType(StrEnum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


class StartingStatus(StrEnum):
    READY = "ready"
    NOTREADY = "notready"


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def _seconds(name: str, default: float | None, description: str) -> Any:
    return Field(
        default,
        validation_alias=name,
        gt=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description=description,
        json_schema_extra={"expected": f"a number of seconds > 0 and <= {MAX_SECONDS:g}"},
    )


def _env(name: str, default: Any, description: str, expected: str, **kw: Any) -> Any:
    return Field(
        default,
        validation_alias=name,
        description=description,
        json_schema_extra={"expected": expected},
        **kw,
    )


class Settings(BaseSettings):
    """The sidecar's whole configuration. Field aliases are the environment variable names."""

    model_config = SettingsConfigDict(
        case_sensitive=True,
        env_ignore_empty=True,
        extra="ignore",
        populate_by_name=False,
        frozen=True,
    )

    # --- Dynamo-compatible names -------------------------------------------------------------
    health_check_enabled: bool = _env(
        "DYN_HEALTH_CHECK_ENABLED",
        False,
        "Send canaries. When true, the canary is the sole authority on the readiness of an "
        "endpoint that has one.",
        "true or false",
    )
    use_endpoint_health_status: Annotated[tuple[str, ...], NoDecode] = _env(
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS",
        (),
        'JSON list of endpoint names, e.g. ["generate"]. When non-empty, the worker is ready iff '
        "every listed endpoint is ready.",
        f"a JSON list of endpoint names from {json.dumps(list(MONITORED_ENDPOINTS))}",
    )
    starting_health_status: StartingStatus = _env(
        "DYN_SYSTEM_STARTING_HEALTH_STATUS",
        StartingStatus.NOTREADY,
        "What an endpoint reports before its first verdict.",
        "ready or notready",
    )
    canary_wait_time: float = _seconds(
        "DYN_CANARY_WAIT_TIME",
        10.0,
        "Seconds an endpoint may go without a proof of health before a canary is sent.",
    )
    request_timeout: float = _seconds(
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT",
        3.0,
        "Seconds a canary (the whole response) and a registration check may take.",
    )
    health_check_payload: Annotated[dict[str, Any] | None, NoDecode] = _env(
        "DYN_HEALTH_CHECK_PAYLOAD",
        None,
        "A JSON object, or @path of a JSON file, sent verbatim as the canary body instead of the "
        "built-in one. Gives any role a canary, encode workers included.",
        "a JSON object, or @ followed by the path of a file holding one",
    )
    system_host: str = _env(
        "DYN_SYSTEM_HOST",
        "0.0.0.0",
        "Address the sidecar's HTTP server binds.",
        "an IP address or host name",
        min_length=1,
    )
    system_port: int = _env(
        "DYN_SYSTEM_PORT",
        9090,
        "Port the sidecar's HTTP server binds.",
        "an integer port from 1 to 65535",
        ge=1,
        le=65535,
    )
    health_path: str = _env(
        "DYN_SYSTEM_HEALTH_PATH",
        "/health",
        "Readiness route.",
        "a URL path starting with /",
    )
    live_path: str = _env(
        "DYN_SYSTEM_LIVE_PATH",
        "/live",
        "Liveness route.",
        "a URL path starting with /",
    )

    # Dynamo's runtime variables, read for the request-plane transport (SIDECAR_TRANSPORT=dynamo):
    # give the sidecar the worker's values. Its runtime client sees only these and the DYN_TCP_*,
    # DYN_HTTP_RPC_*, NATS_* and ETCD_* variables (sidecar/requestplane/environment.py).
    discovery_backend: DiscoveryBackend = _env(
        "DYN_DISCOVERY_BACKEND",
        DiscoveryBackend.ETCD,
        "Dynamo's discovery backend, as the worker's (SIDECAR_TRANSPORT=dynamo): etcd or file, "
        "shared with the worker to tell whether the router can still find it; kubernetes, where "
        "the cluster lists only Ready pods, so the canary reaches the worker by what it "
        "advertises itself (its /metadata) and the sidecar needs no cluster rights.",
        "one of etcd, file, kubernetes",
    )
    request_plane: RequestPlane = _env(
        "DYN_REQUEST_PLANE",
        RequestPlane.TCP,
        "Dynamo's request plane, as the worker's (SIDECAR_TRANSPORT=dynamo).",
        "one of tcp, nats, http",
    )
    file_kv: str | None = _env(
        "DYN_FILE_KV",
        None,
        "The directory of Dynamo's file discovery, shared with the worker "
        "(DYN_DISCOVERY_BACKEND=file).",
        "an absolute directory path",
    )

    # --- The sidecar's own ---------------------------------------------------------------------
    engine_url: str = _env(
        "SIDECAR_ENGINE_URL",
        "http://127.0.0.1:8000",
        "Base URL of the local engine. Every request the sidecar makes goes here. With "
        "SIDECAR_TRANSPORT=dynamo: the worker's system server (DYN_SYSTEM_PORT, "
        "http://127.0.0.1:9090 in a pod), where the sidecar finds the worker's instance.",
        "an http:// or https:// URL with a host and no query",
    )
    transport: Transport = _env(
        "SIDECAR_TRANSPORT",
        Transport.HTTP,
        "How canaries reach the engine: http, its own HTTP API at SIDECAR_ENGINE_URL; dynamo, "
        "Dynamo's request plane, straight to the instance of the worker whose system server is "
        "SIDECAR_ENGINE_URL (a Dynamo worker serves no HTTP generation API); needs "
        "pip install 'health-sidecar[dynamo]'.",
        "http or dynamo",
    )
    dynamo_endpoint: str | None = _env(
        "SIDECAR_DYNAMO_ENDPOINT",
        None,
        "With SIDECAR_TRANSPORT=dynamo: the worker endpoint to canary, as a name (generate) or a "
        "path (namespace.component.generate). Unset: the one endpoint named generate that the "
        "worker's system server names.",
        "an endpoint name, or namespace.component.endpoint",
    )
    backend: Backend = _env(
        "SIDECAR_BACKEND",
        Backend.VLLM,
        "Engine API: vllm, sglang, trtllm, or openai (any other OpenAI-compatible server, such "
        "as llama.cpp's llama-server).",
        "one of vllm, sglang, trtllm, openai",
    )
    disaggregation_mode: Mode = _env(
        "SIDECAR_DISAGGREGATION_MODE",
        Mode.AGGREGATED,
        "The worker's role: aggregated (aliases agg, prefill_and_decode), prefill, decode or "
        "encode.",
        "one of aggregated, agg, prefill_and_decode, prefill, decode, encode",
    )
    model_type: ModelType = _env(
        "SIDECAR_MODEL_TYPE", ModelType.TEXT, "text or multimodal.", "text or multimodal"
    )
    model: str | None = _env(
        "SIDECAR_MODEL",
        None,
        "Served model name put in canaries. Unset: discovered from GET /v1/models (vllm, trtllm, "
        "openai).",
        "a model name",
    )
    engine_api_key: SecretStr | None = _env(
        "SIDECAR_ENGINE_API_KEY",
        None,
        "Sent to the engine as a bearer token. Never logged or served.",
        "a token",
    )
    failure_threshold: int = _env(
        "SIDECAR_FAILURE_THRESHOLD",
        2,
        "Consecutive failed canaries that turn a ready endpoint notready.",
        "an integer from 1 to 100",
        ge=1,
        le=100,
    )
    success_threshold: int = _env(
        "SIDECAR_SUCCESS_THRESHOLD",
        1,
        "Consecutive passed canaries that turn a notready endpoint ready.",
        "an integer from 1 to 100",
        ge=1,
        le=100,
    )
    retry_interval: float = _seconds(
        "SIDECAR_CANARY_RETRY_INTERVAL",
        1.0,
        "Seconds between canary starts while an endpoint is not proven healthy "
        "(never overlapping: the next starts after the previous has ended).",
    )
    liveness_window: float = _seconds(
        "SIDECAR_LIVENESS_WINDOW",
        120.0,
        "Seconds of uninterrupted hard failure (the engine accepts connections but "
        "hangs, or answers 5xx) after which /live fails.",
    )
    registration_interval: float = _seconds(
        "SIDECAR_REGISTRATION_INTERVAL",
        1.0,
        "Seconds between checks of the engine's own health route.",
    )
    registration_path: str | None = _env(
        "SIDECAR_REGISTRATION_PATH",
        None,
        "The engine route that answers 200 once it is up with its model loaded. Unset: /health "
        "(vllm, trtllm, openai) or /v1/models (sglang, whose /health runs a generation).",
        "a URL path starting with /",
    )
    progress_enabled: bool = _env(
        "SIDECAR_PROGRESS_ENABLED",
        True,
        "With canaries on, also read the engine's Prometheus metrics: advancing counters prove "
        "health (no canary is sent to a busy, progressing engine); work in flight with no "
        "progress for SIDECAR_STALL_WINDOW is a hang.",
        "true or false",
    )
    metrics_path: str | None = _env(
        "SIDECAR_METRICS_PATH",
        None,
        "Engine route of its Prometheus metrics. Unset: /metrics (trtllm: /prometheus/metrics).",
        "a URL path starting with /",
    )
    metrics_interval: float = _seconds(
        "SIDECAR_METRICS_INTERVAL", 1.0, "Seconds between reads of the engine's metrics."
    )
    stall_window: float | None = _seconds(
        "SIDECAR_STALL_WINDOW",
        None,
        "Seconds with requests in flight and no counter advancing before the endpoint is "
        "notready as stalled. Unset: DYN_HEALTH_CHECK_REQUEST_TIMEOUT + 2 s.",
    )
    drain_timeout: float = _seconds(
        "SIDECAR_DRAIN_TIMEOUT",
        20.0,
        "After SIGTERM: readiness is 'draining' (503), /live stays 200, and the sidecar keeps "
        "serving until the engine is gone or this many seconds have passed, then exits 0.",
    )
    canary_path: str | None = _env(
        "SIDECAR_CANARY_PATH",
        None,
        "Engine route the canary is POSTed to. Unset: the backend's generation route.",
        "a URL path starting with /",
    )
    sglang_bootstrap_port: int = _env(
        "SIDECAR_SGLANG_BOOTSTRAP_PORT",
        8998,
        "bootstrap_port put in SGLang prefill/decode canaries (fake transfer; never contacted).",
        "an integer port from 1 to 65535",
        ge=1,
        le=65535,
    )
    max_response_bytes: int = _env(
        "SIDECAR_MAX_RESPONSE_BYTES",
        1_048_576,
        "Largest engine response body the sidecar reads; a larger one fails the canary.",
        "an integer from 1024 to 67108864",
        ge=1024,
        le=64 * 1_048_576,
    )
    dp_ranks: int | Literal["auto"] = _env(
        "SIDECAR_DP_RANKS",
        1,
        "Data-parallel ranks of the engine (vLLM --data-parallel-size, SGLang --dp-size): each "
        "gets its own canary pinned to it (vLLM's X-data-parallel-rank header, SGLang's "
        "data_parallel_rank field), its own progress (vLLM's engine label, SGLang's dp_rank) and "
        "its own line in /health. auto: counted from the ranks the engine's in-flight gauges name "
        "(the same labels); until then one unpinned canary.",
        "an integer from 1 to 1024, or auto",
    )
    dp_min_ready_ranks: int | None = _env(
        "SIDECAR_DP_MIN_READY_RANKS",
        None,
        "Ranks that must be ready for the endpoint to be ready. Unset: every rank. Below the "
        "rank count, a wedged rank leaves /health at 200 with the endpoint 'degraded' and the "
        "rank named; its liveness clock still runs (a restart is the only cure for a wedged "
        "rank).",
        "an integer from 1 to 1024, at most SIDECAR_DP_RANKS",
        ge=1,
        le=1024,
    )
    kv_peer_url: str | None = _env(
        "SIDECAR_KV_PEER_URL",
        None,
        "A prefill peer of this vLLM decode worker. Adds the kv_transfer endpoint: a transfer "
        "probe runs one tiny prefill on the peer with remote decode, then the decode here with "
        "the KV it returned, and passes only if that completes within SIDECAR_KV_PROBE_TIMEOUT "
        "and answers what a local prefill of the same prompt answers. Informs; gates readiness "
        "only when DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS lists kv_transfer. Never fails /live.",
        "an http:// or https:// URL with a host and no query",
    )
    kv_probe_interval: float = _seconds(
        "SIDECAR_KV_PROBE_INTERVAL",
        60.0,
        "Seconds between transfer probes; one also leaves when the decode worker's metrics show "
        "failed transfers (at most every SIDECAR_CANARY_RETRY_INTERVAL while failing).",
    )
    kv_probe_timeout: float = _seconds(
        "SIDECAR_KV_PROBE_TIMEOUT",
        30.0,
        "Seconds the whole transfer probe may take: the peer's prefill, the transfer, the decode.",
    )
    kv_probe_prompt_tokens: int = _env(
        "SIDECAR_KV_PROBE_PROMPT_TOKENS",
        256,
        "Prompt length of the transfer probe, in tokens: long enough to fill whole KV blocks "
        "(vLLM's block is 16 tokens on GPUs, 128 on CPUs), or nothing is transferred.",
        "an integer from 1 to 8192",
        ge=1,
        le=8192,
    )
    check_answer: bool = _env(
        "SIDECAR_CANARY_CHECK_ANSWER",
        False,
        "Check the canary's answer for correctness: the built-in canary decodes greedily, so a "
        "healthy engine answers it the same way every time. The first answer after the engine "
        "registers (or resumes from a pause) becomes the reference; a later answer that differs "
        "fails the canary as 'wrong answer' (counted like any failure, with "
        "SIDECAR_FAILURE_THRESHOLD as hysteresis). Catches weights or KV cache gone bad behind "
        "a 200. Applies to built-in canaries only.",
        "true or false",
    )
    control_port: int | None = _env(
        "SIDECAR_CONTROL_PORT",
        None,
        "Port of the control routes (GET, PUT and DELETE /maintenance), bound to 127.0.0.1 only: "
        "reachable from the pod's own containers (a training loop updating weights), never from "
        "the pod network. Unset: no control routes.",
        "an integer port from 1 to 65535",
        ge=1,
        le=65535,
    )
    control_token: SecretStr | None = _env(
        "SIDECAR_CONTROL_TOKEN",
        None,
        "When set, the control routes also require 'Authorization: Bearer <token>' (other "
        "containers of the pod share its loopback). Never logged or served.",
        "a token",
    )
    maintenance_max: float = _seconds(
        "SIDECAR_MAINTENANCE_MAX",
        3600.0,
        "Longest maintenance window the control route accepts; every window ends by itself.",
    )
    log_level: LogLevel = _env(
        "SIDECAR_LOG_LEVEL",
        LogLevel.INFO,
        "DEBUG, INFO, WARNING or ERROR.",
        "one of DEBUG, INFO, WARNING, ERROR",
    )

    # --- field parsing -------------------------------------------------------------------------
    @field_validator("dp_ranks", mode="before")
    @classmethod
    def _ranks(cls, value: Any) -> Any:
        text = value.strip() if isinstance(value, str) else value
        if text == "auto":
            return text
        if isinstance(text, str) and text.isdigit():
            text = int(text)
        if isinstance(text, int) and not isinstance(text, bool) and 1 <= text <= 1024:
            return text
        raise ValueError("not an integer from 1 to 1024, nor auto")

    @field_validator("use_endpoint_health_status", mode="before")
    @classmethod
    def _parse_endpoint_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = _json_loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError("not a list of strings")
        unknown = [v for v in value if v not in MONITORED_ENDPOINTS and v not in OPTIONAL_ENDPOINTS]
        if unknown:
            raise ValueError(f"the sidecar does not monitor {', '.join(map(repr, unknown))}")
        return tuple(dict.fromkeys(value))

    @field_validator("health_check_payload", mode="before")
    @classmethod
    def _parse_payload(cls, value: Any) -> Any:
        if value is None or isinstance(value, dict):
            return value
        if not isinstance(value, str):
            raise ValueError("not a JSON object")
        text = value
        if value.startswith("@"):
            path = Path(value[1:])
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                why = getattr(exc, "strerror", None) or type(exc).__name__
                raise ValueError(f"cannot read {str(path)!r}: {why}") from None
        try:
            parsed = _json_loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {' '.join(str(exc).split())}") from None
        if not isinstance(parsed, dict):
            raise ValueError("JSON, but not an object")
        try:
            json.dumps(parsed, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (ValueError, UnicodeEncodeError, RecursionError):
            raise ValueError("cannot be sent as a UTF-8 JSON body") from None
        return parsed

    @field_validator("disaggregation_mode", mode="before")
    @classmethod
    def _mode_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            return MODE_ALIASES.get(value, value)
        return value

    @property
    def effective_stall_window(self) -> float:
        if self.stall_window is not None:
            return self.stall_window
        return self.request_timeout + 2.0

    @field_validator("health_path", "live_path", "registration_path", "canary_path", "metrics_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        problem = None if value is None else _path_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("system_host")
    @classmethod
    def _host(cls, value: str) -> str:
        problem = _host_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("engine_api_key", "control_token", mode="before")
    @classmethod
    def _token(cls, value: Any) -> Any:
        if isinstance(value, str) and not _TOKEN.fullmatch(value):
            raise ValueError("not a token: only visible ASCII characters, no spaces")
        return value

    @field_validator("engine_url", "kv_peer_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise ValueError("not a URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL with a host")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("has a query, fragment or credentials")
        if "\\" in value or _host_problem(parts.hostname):
            raise ValueError("the host is not an IP address or host name")
        if _path_problem(parts.path or "/"):
            raise ValueError("the path has characters a URL cannot carry")
        if port == 0:
            raise ValueError("port 0")
        return value.rstrip("/")

    @field_validator("dynamo_endpoint")
    @classmethod
    def _dynamo_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = value.removeprefix("dyn://")
        parts = path.split(".")
        if len(parts) not in (1, 3) or not all(_DYNAMO_NAME.fullmatch(p) for p in parts):
            raise ValueError("not an endpoint name nor namespace.component.endpoint")
        return path

    @field_validator("file_kv")
    @classmethod
    def _file_kv(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError("not an absolute path")
        return value

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("blank")
        return value


class ConfigError(Exception):
    """Invalid configuration. Each line names one variable, its value, and what was expected."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def env_name(field: str) -> str:
    alias = Settings.model_fields[field].validation_alias
    assert isinstance(alias, str)
    return alias


def expected(field: str) -> str:
    extra = Settings.model_fields[field].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["expected"])


def _shown(field: str, value: Any) -> str:
    if field in ("engine_api_key", "control_token"):
        return "<hidden>"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if field in ("engine_url", "kv_peer_url"):
        text = _CREDENTIALS.sub(r"\1<credentials hidden>@", text)
    if len(text) > MAX_VALUE_SHOWN:
        text = text[: MAX_VALUE_SHOWN - 3] + "..."
    return repr(text)


def _error_lines(exc: ValidationError) -> list[str]:
    by_alias = {env_name(name): name for name in Settings.model_fields}
    lines = []
    for err in exc.errors(include_url=False):
        key = str(err["loc"][0]) if err["loc"] else ""
        field = by_alias.get(key, key)
        name = env_name(field) if field in Settings.model_fields else key
        detail = err["msg"].removeprefix("Value error, ")
        want = expected(field) if field in Settings.model_fields else "a valid value"
        lines.append(f"{name}={_shown(field, err['input'])}: expected {want} ({detail})")
    return lines


def _cross_checks(s: Settings) -> list[str]:
    lines = []
    for field in ("health_path", "live_path"):
        path = getattr(s, field)
        if path in RESERVED_ROUTES:
            lines.append(
                f"{env_name(field)}={path!r}: expected a path not already used by "
                f"{RESERVED_ROUTES[path]}"
            )
    pins = s.backend in (Backend.VLLM, Backend.SGLANG)
    if s.dp_ranks != 1 and not pins:
        lines.append(
            f"{env_name('dp_ranks')}={s.dp_ranks}: expected 1 ({s.backend} cannot pin a request "
            "to a data-parallel rank, so ranks cannot be told apart)"
        )
    if s.kv_peer_url is not None and (s.backend, s.disaggregation_mode) != (
        Backend.VLLM,
        Mode.DECODE,
    ):
        lines.append(
            f"{env_name('kv_peer_url')}={_shown('kv_peer_url', s.kv_peer_url)}: expected unset "
            f"(the transfer probe speaks vLLM's NIXL connector from a decode worker; this is "
            f"{s.backend} {s.disaggregation_mode})"
        )
    if KV_TRANSFER in s.use_endpoint_health_status and s.kv_peer_url is None:
        lines.append(
            f"{env_name('use_endpoint_health_status')}="
            f"{_shown('use_endpoint_health_status', list(s.use_endpoint_health_status))}: "
            f"expected {KV_TRANSFER!r} listed only with {env_name('kv_peer_url')} set"
        )
    if (
        s.dp_min_ready_ranks is not None
        and isinstance(s.dp_ranks, int)
        and s.dp_min_ready_ranks > s.dp_ranks
    ):
        lines.append(
            f"{env_name('dp_min_ready_ranks')}={s.dp_min_ready_ranks}: expected at most "
            f"{env_name('dp_ranks')} ({s.dp_ranks})"
        )
    lines += _transport_checks(s)
    if s.control_port is not None and s.control_port == s.system_port:
        lines.append(
            f"{env_name('control_port')}={s.control_port}: expected a port other than "
            f"{env_name('system_port')}'s (the control routes are never served to the pod network)"
        )
    if s.control_token is not None and s.control_port is None:
        lines.append(
            f"{env_name('control_token')}=<set>: expected {env_name('control_port')} too (the "
            "token guards the control routes, which are off without a port)"
        )
    if s.health_path == s.live_path:
        # Blame the variable the user set (both set: the live path).
        field = "health_path" if "live_path" not in s.model_fields_set else "live_path"
        other = "live_path" if field == "health_path" else "health_path"
        lines.append(
            f"{env_name(field)}={s.health_path!r}: expected a path not already used by "
            f"{env_name(other)}"
        )
    return lines


# The backends of Dynamo's workers (each has its payload); openai names none.
DYNAMO_BACKENDS = (Backend.VLLM, Backend.SGLANG, Backend.TRTLLM)


def runtime_missing() -> str | None:
    """Why Dynamo's runtime client is not installed here, or None. Only looked up, not imported:
    importing loads the runtime (and it reads Dynamo's variables); a runtime that is installed
    but cannot load fails, with one line, when the sidecar starts it."""
    try:
        spec = importlib.util.find_spec("dynamo.runtime")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if spec is not None else "No module named 'dynamo.runtime'"


def _transport_checks(s: Settings) -> list[str]:
    if s.transport is not Transport.DYNAMO:
        if s.dynamo_endpoint is not None:
            return [
                f"{env_name('dynamo_endpoint')}={s.dynamo_endpoint!r}: expected unset "
                f"({env_name('transport')}={s.transport} sends no request over Dynamo's plane)"
            ]
        return []
    name = env_name("transport")
    lines = []
    missing = runtime_missing()
    if missing is not None:
        lines.append(
            f"{name}=dynamo: expected Dynamo's runtime client installed "
            f"(pip install 'health-sidecar[dynamo]'): {missing}"
        )
    if s.backend not in DYNAMO_BACKENDS:
        lines.append(
            f"{env_name('backend')}={s.backend.value!r}: expected one of "
            f"{', '.join(b.value for b in DYNAMO_BACKENDS)} with {name}=dynamo (the Dynamo "
            "worker's backend decides its canary payload)"
        )
    if s.dp_ranks != 1:
        lines.append(
            f"{env_name('dp_ranks')}={s.dp_ranks}: expected 1 with {name}=dynamo (a Dynamo "
            "worker's ranks are not pinned over its request plane)"
        )
    if s.kv_peer_url is not None:
        lines.append(
            f"{env_name('kv_peer_url')}={_shown('kv_peer_url', s.kv_peer_url)}: expected unset "
            f"with {name}=dynamo (the transfer probe speaks vLLM's HTTP API)"
        )
    if s.canary_path is not None:
        lines.append(
            f"{env_name('canary_path')}={s.canary_path!r}: expected unset with {name}=dynamo (the "
            f"canary goes over the request plane; {env_name('dynamo_endpoint')} names the endpoint)"
        )
    if s.discovery_backend is DiscoveryBackend.FILE and s.file_kv is None:
        lines.append(
            f"{env_name('file_kv')}: expected the worker's file-discovery directory with "
            f"{env_name('discovery_backend')}=file and {name}=dynamo (it is not set)"
        )
    return lines


def load_settings(
    env_file: str | None = None, defaults: Mapping[str, str] | None = None
) -> Settings:
    """Read and validate the configuration from the environment and an optional env file (the
    environment wins). ``defaults`` give values to variables set in neither."""
    kwargs: dict[str, Any] = {}
    present = set(os.environ)
    if env_file is not None:
        if not Path(env_file).is_file():
            raise ConfigError([f"--env-file={env_file!r}: expected an existing file"])
        kwargs["_env_file"] = env_file
        present |= {k for k, v in dotenv_values(env_file).items() if v}
    for name, value in (defaults or {}).items():
        if name not in present:
            kwargs[name] = value
    try:
        settings = Settings(**kwargs)
    except ValidationError as exc:
        raise ConfigError(_error_lines(exc)) from None
    errors = _cross_checks(settings)
    if errors:
        raise ConfigError(errors)
    return settings
