"""Every variable the sidecar reads, as one field of :class:`Settings`: its name (the alias), its
default, its ``description`` and ``expected`` note (the configuration reference,
docs/reference/configuration.md, is generated from them by scripts/gen_docs.py; ``expected`` is
also what a user sees when the value is malformed), and the kind of value it takes
(``values.py``). A setting holds what the user said; what the sidecar does with it is resolved
by the composition root (``sidecar/wiring/resolve.py``), once."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from sidecar.config.values import (
    MAX_SECONDS,
    AbsolutePath,
    Choice,
    DynamoEndpoint,
    EndpointList,
    EngineUrl,
    GrpcTargetUrl,
    Host,
    HttpUrl,
    Level,
    ModeAlias,
    Name,
    Payload,
    Ranks,
    Token,
    UrlPath,
)
from sidecar.core.vocabulary import (
    MAX_DP_RANKS,
    MONITORED_ENDPOINTS,
    OPTIONAL_ENDPOINTS,
    POD_RESTART_CODES,
    Cause,
    EmbeddingTransfer,
    Mode,
    ModelType,
    StartingStatus,
)


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class DiscoveryBackend(StrEnum):
    """Dynamo's discovery backends a separate process can share with the worker."""

    ETCD = "etcd"
    FILE = "file"
    KUBERNETES = "kubernetes"


class PlaneKind(StrEnum):
    """DYN_REQUEST_PLANE: how requests travel to a Dynamo worker."""

    TCP = "tcp"
    NATS = "nats"
    HTTP = "http"


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
    use_endpoint_health_status: EndpointList = _env(
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS",
        (),
        'JSON list of endpoint names, e.g. ["generate"]. When non-empty, the worker is ready iff '
        "every listed endpoint is ready (kv_transfer gates readiness only when listed).",
        "a JSON list of endpoint names from "
        f"{json.dumps([*MONITORED_ENDPOINTS, *OPTIONAL_ENDPOINTS])}",
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
    health_check_payload: Payload = _env(
        "DYN_HEALTH_CHECK_PAYLOAD",
        None,
        "A JSON object, or @path of a JSON file, sent verbatim as the canary body instead of the "
        "built-in one. Gives any role a canary, encode workers included.",
        "a JSON object, or @ followed by the path of a file holding one",
    )
    system_host: Host = _env(
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
    health_path: UrlPath = _env(
        "DYN_SYSTEM_HEALTH_PATH",
        "/health",
        "Readiness route.",
        "a URL path starting with /",
    )
    live_path: UrlPath = _env(
        "DYN_SYSTEM_LIVE_PATH",
        "/live",
        "Liveness route.",
        "a URL path starting with /",
    )

    # Dynamo's runtime variables, read for the request-plane transport (SIDECAR_TRANSPORT=dynamo):
    # give the sidecar the worker's values. Its runtime client sees only these and the DYN_TCP_*,
    # DYN_HTTP_RPC_*, NATS_* and ETCD_* variables (sidecar/transports/dynamo/environment.py).
    discovery_backend: DiscoveryBackend = _env(
        "DYN_DISCOVERY_BACKEND",
        DiscoveryBackend.ETCD,
        "Dynamo's discovery backend, as the worker's (SIDECAR_TRANSPORT=dynamo): etcd or file, "
        "shared with the worker to tell whether the router can still find it; kubernetes, where "
        "the cluster lists only Ready pods, so the canary reaches the worker by what it "
        "advertises itself (its /metadata) and the sidecar needs no cluster rights.",
        "one of etcd, file, kubernetes",
    )
    request_plane: PlaneKind = _env(
        "DYN_REQUEST_PLANE",
        PlaneKind.TCP,
        "Dynamo's request plane, as the worker's (SIDECAR_TRANSPORT=dynamo).",
        "one of tcp, nats, http",
    )
    file_kv: AbsolutePath | None = _env(
        "DYN_FILE_KV",
        None,
        "The directory of Dynamo's file discovery, shared with the worker "
        "(DYN_DISCOVERY_BACKEND=file).",
        "an absolute directory path",
    )

    # --- The sidecar's own ---------------------------------------------------------------------
    engine_url: EngineUrl = _env(
        "SIDECAR_ENGINE_URL",
        "http://127.0.0.1:8000",
        "Base URL of the local engine. Every request the sidecar makes goes here. With "
        "SIDECAR_TRANSPORT=dynamo: the worker's system server (DYN_SYSTEM_PORT, "
        "http://127.0.0.1:9090 in a pod), where the sidecar finds the worker's instance. With "
        "SIDECAR_TRANSPORT=grpc: the engine's gRPC server, grpc://HOST:PORT.",
        "an http:// or https:// URL with a host and no query (grpc://HOST:PORT with "
        "SIDECAR_TRANSPORT=grpc)",
    )
    transport: Choice = _env(
        "SIDECAR_TRANSPORT",
        "http",
        "How canaries reach the engine: the name of one of the transports "
        "(docs/concepts/transports.md; each says what SIDECAR_ENGINE_URL is with it, and which "
        "extra it needs).",
        "the name of a transport",
    )
    dynamo_endpoint: DynamoEndpoint | None = _env(
        "SIDECAR_DYNAMO_ENDPOINT",
        None,
        "With SIDECAR_TRANSPORT=dynamo: the worker endpoint to canary, as a name (generate) or a "
        "path (namespace.component.generate). Unset: the one endpoint named generate that the "
        "worker's system server names.",
        "an endpoint name, or namespace.component.endpoint",
    )
    backend: Choice = _env(
        "SIDECAR_BACKEND",
        "vllm",
        "The engine, one of those sidecar/engines/ holds the rules of (the expected values); "
        "openai is any other OpenAI-compatible server, such as llama.cpp's llama-server.",
        "the name of a backend",
    )
    disaggregation_mode: Annotated[Mode, ModeAlias] = _env(
        "SIDECAR_DISAGGREGATION_MODE",
        Mode.AGGREGATED,
        "The worker's role: aggregated (aliases agg, prefill_and_decode), prefill, decode or "
        "encode.",
        "one of aggregated, agg, prefill_and_decode, prefill, decode, encode",
    )
    model_type: ModelType = _env(
        "SIDECAR_MODEL_TYPE",
        ModelType.TEXT,
        "text or multimodal. With SIDECAR_DISAGGREGATION_MODE=encode, multimodal gives the "
        "encode worker a canary that encodes an image (vllm over http or dynamo, sglang); text "
        "keeps it without one.",
        "text or multimodal",
    )
    ec_storage_path: AbsolutePath | None = _env(
        "SIDECAR_EC_STORAGE_PATH",
        None,
        "Where a vLLM encoder writes what an encode canary causes, as mounted in the sidecar: "
        "over http its ECExampleConnector's shared_storage_path (each canary's item is removed, "
        "a timed-out canary's when it appears); over dynamo the encode worker's TMPDIR (each "
        "canary's embeddings file, named in its answer, is removed). Unset: they stay there.",
        "the absolute path of a directory",
    )
    embedding_transfer_mode: EmbeddingTransfer = _env(
        "DYN_VLLM_EMBEDDING_TRANSFER_MODE",
        EmbeddingTransfer.NIXL_WRITE,
        "How Dynamo's vLLM encode worker hands on its embeddings (its own variable; nixl-write "
        "when unset, as its code has it). Over dynamo only local gives the encode worker a "
        "canary: in the NIXL modes a canary's embedding, never read, would hold every later one.",
        "one of local, nixl-write, nixl-read",
    )
    model: Name | None = _env(
        "SIDECAR_MODEL",
        None,
        "Served model name put in canaries. Unset: discovered from GET /v1/models (vllm, trtllm, "
        "openai).",
        "a model name",
    )
    engine_api_key: Annotated[SecretStr | None, Token] = _env(
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
        "Seconds a liveness clock may run before /live fails; the clocks: "
        + ", ".join(Cause)
        + " (what starts and ends each: docs/concepts/decision-model.md).",
    )
    registration_interval: float = _seconds(
        "SIDECAR_REGISTRATION_INTERVAL",
        1.0,
        "Seconds between checks of the engine's own health route.",
    )
    registration_path: UrlPath | None = _env(
        "SIDECAR_REGISTRATION_PATH",
        None,
        "The engine route that answers 200 once it is up with its model loaded. Unset: /health "
        "(vllm, trtllm, openai) or /v1/models (sglang, whose /health runs a generation).",
        "a URL path starting with /",
    )
    registration: GrpcTargetUrl | None = _env(
        "SIDECAR_REGISTRATION",
        None,
        "Ask the engine's own gRPC health service instead of an HTTP route: "
        "grpc://HOST:PORT/SERVICE makes each registration check a grpc.health.v1 Check of "
        "SERVICE (none: the server as a whole), registered while it answers SERVING (vLLM's gRPC "
        "server: grpc://127.0.0.1:50051/vllm.grpc.engine.VllmEngine). Canaries still go to "
        "SIDECAR_ENGINE_URL. Unset: GET SIDECAR_REGISTRATION_PATH.",
        "grpc://HOST:PORT or grpc://HOST:PORT/SERVICE",
    )
    progress_enabled: bool = _env(
        "SIDECAR_PROGRESS_ENABLED",
        True,
        "With canaries on, also read the engine's Prometheus metrics: advancing counters prove "
        "health (no canary is sent to a busy, progressing engine); work in flight with no "
        "progress for SIDECAR_STALL_WINDOW is a hang.",
        "true or false",
    )
    grpc_service: Choice | None = _env(
        "SIDECAR_GRPC_SERVICE",
        None,
        "With SIDECAR_TRANSPORT=grpc: the engine's gRPC generation service. sglang: "
        "sglang.grpc.scheduler.SglangScheduler (--smg-grpc-mode, the default) or "
        "sglang.runtime.v1.SglangService (--grpc-port, beside its HTTP server); vllm: "
        "vllm.grpc.engine.VllmEngine; trtllm: trtllm.TrtllmService. Unset: the backend's first.",
        "the full name of one of the backend's gRPC generation services",
    )
    metrics_url: HttpUrl | None = _env(
        "SIDECAR_METRICS_URL",
        None,
        "With SIDECAR_TRANSPORT=grpc: the base URL of the engine's Prometheus metrics, served "
        "over HTTP beside its gRPC server (SGLang --smg-grpc-mode with --enable-metrics: its "
        "side server on the gRPC port + 1). Unset: no metrics are read (vLLM's gRPC server "
        "serves none): the canary alone decides, and the stall rule is off.",
        "an http:// or https:// URL with a host and no query",
    )
    metrics_path: UrlPath | None = _env(
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
        "notready as stalled: also the longest silent engine step (an unchunked prefill) that is "
        "not taken for a stall. Unset: DYN_HEALTH_CHECK_REQUEST_TIMEOUT + half of "
        "DYN_CANARY_WAIT_TIME, that half at least 0.75 s and at most 2 s (a hang under load is "
        "then found sooner than an idle engine's next canary would find it).",
    )
    drain_timeout: float = _seconds(
        "SIDECAR_DRAIN_TIMEOUT",
        20.0,
        "After SIGTERM: readiness is 'draining' (503), /live stays 200, and the sidecar keeps "
        "serving until the engine is gone or this many seconds have passed, then exits 0.",
    )
    canary_path: UrlPath | None = _env(
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
    dp_ranks: Annotated[int | Literal["auto"] | None, Ranks] = _env(
        "SIDECAR_DP_RANKS",
        None,
        "Data-parallel ranks of the engine (vLLM --data-parallel-size, SGLang --dp-size): each "
        "gets its own canary pinned to it (vLLM's X-data-parallel-rank header, SGLang's "
        "data_parallel_rank field), its own progress (vLLM's engine label, SGLang's dp_rank) and "
        "its own line in /health. auto: counted from the ranks the engine's in-flight gauges name "
        "(the same labels), again after each restart; until then one unpinned canary. Unset: auto "
        "for vllm and sglang over HTTP, else 1. 1 turns the count off.",
        f"an integer from 1 to {MAX_DP_RANKS}, or auto",
    )
    dp_min_ready_ranks: int | None = _env(
        "SIDECAR_DP_MIN_READY_RANKS",
        None,
        "Ranks that must be ready for the endpoint to be ready. Unset: every rank. Below the "
        "rank count, a wedged rank leaves /health at 200 with the endpoint 'degraded' and the "
        "rank named; its liveness clock still runs (a restart is the only cure for a wedged "
        "rank).",
        f"an integer from 1 to {MAX_DP_RANKS}, at most SIDECAR_DP_RANKS",
        ge=1,
        le=MAX_DP_RANKS,
    )
    kv_peer_url: HttpUrl | None = _env(
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
    grpc_port: int | None = _env(
        "SIDECAR_GRPC_PORT",
        None,
        "Port of the gRPC health service (grpc.health.v1.Health, Check and Watch: the kubelet's "
        "grpc probes), bound to DYN_SYSTEM_HOST as the HTTP server is. The service names '' and "
        "readiness follow /health, liveness follows /live, an endpoint's name (generate) that "
        "endpoint. Unset: no gRPC server.",
        "an integer port from 1 to 65535",
        ge=1,
        le=65535,
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
    pod_restart_exit_code: int | None = _env(
        "SIDECAR_POD_RESTART_EXIT_CODE",
        None,
        "Opt-in pod restart (Kubernetes 1.36, KEP-5532): when the worker stops being live (its "
        "liveness clock runs out, as /live turns 503), the sidecar exits with this code, and a "
        "restartPolicyRules entry on its container (action RestartAllContainers) restarts the "
        "whole pod in place: for a device fault a new engine process in the same pod would "
        "inherit. Grace periods and preStop hooks are not honoured. Unset: never; /live alone "
        "restarts the engine container (docs/deploy/pod-restart.md).",
        "an integer from 4 to 125 (1-3 are the sidecar's own exit statuses, 126 and up a "
        "shell's and the signals')",
        ge=POD_RESTART_CODES.start,
        le=POD_RESTART_CODES.stop - 1,
    )
    control_token: Annotated[SecretStr | None, Token] = _env(
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
    log_level: Annotated[LogLevel, Level] = _env(
        "SIDECAR_LOG_LEVEL",
        LogLevel.INFO,
        "DEBUG, INFO, WARNING or ERROR, in any case (as DYN_LOG and uvicorn take them).",
        "one of DEBUG, INFO, WARNING, ERROR (any case)",
    )
