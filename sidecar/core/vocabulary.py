"""The words the configuration, the core, the engines and the transports share: a worker's role,
the endpoints the sidecar monitors, what an endpoint reports before its first verdict, and the
liveness clocks. Values only; importing this loads nothing else of the sidecar."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# The endpoints the sidecar monitors. Dynamo names the generation endpoint "generate"; it is the
# only one a canary can prove, so it is the only one a user may list.
GENERATE = "generate"
#: The most data-parallel ranks one engine may have: SIDECAR_DP_RANKS and a counted rank alike.
MAX_DP_RANKS = 1024
#: The exit codes SIDECAR_POD_RESTART_EXIT_CODE may take: none the sidecar, Python, a shell or a
#: signal already exits with (1-3: sidecar/runtime/exits.py; 126 and 127 a shell's; 128 + N a
#: signal's).
POD_RESTART_CODES = range(4, 126)
MONITORED_ENDPOINTS: tuple[str, ...] = (GENERATE,)
# Endpoints that exist only when configured (kv_transfer: SIDECAR_KV_PEER_URL). They inform,
# and gate readiness only when DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS lists them.
KV_TRANSFER = "kv_transfer"
OPTIONAL_ENDPOINTS: tuple[str, ...] = (KV_TRANSFER,)


class Mode(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class ModelType(StrEnum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


@dataclass(frozen=True)
class Role:
    """What the worker does in a disaggregated deployment (SIDECAR_DISAGGREGATION_MODE) and for
    which kind of model (SIDECAR_MODEL_TYPE)."""

    mode: Mode
    model_type: ModelType = ModelType.TEXT

    @property
    def disaggregated(self) -> bool:
        """A prefill or decode worker: one half of a request that a peer completes."""
        return self.mode in (Mode.PREFILL, Mode.DECODE)

    @property
    def encoder(self) -> bool:
        """An image encoder: the encode worker of a multimodal model."""
        return self.mode is Mode.ENCODE and self.model_type is ModelType.MULTIMODAL


class EmbeddingTransfer(StrEnum):
    """How Dynamo's vLLM encode worker hands its embeddings on (DYN_VLLM_EMBEDDING_TRANSFER_MODE,
    its ``--embedding-transfer-mode``; nixl-write when unset, as its code has it)."""

    LOCAL = "local"  # a file in the worker's TMPDIR, named in the answer
    NIXL_WRITE = "nixl-write"
    NIXL_READ = "nixl-read"


class StartingStatus(StrEnum):
    """DYN_SYSTEM_STARTING_HEALTH_STATUS: what an endpoint with no verdict yet counts as."""

    READY = "ready"
    NOTREADY = "notready"


class Cause(StrEnum):
    """A liveness clock: its name (the value), what it is in a few words (:attr:`brief`), and what
    starts and ends it (:attr:`description`)."""

    REGISTRATION = "registration timing out"
    CANARY = "canary failing hard"
    STALL = "stalled"
    UNDISCOVERABLE = "not discoverable"
    FAULT = "engine reports a fault"
    NOT_SERVING = "engine says it is not serving"

    @property
    def brief(self) -> str:
        return _CAUSES[self][0]

    @property
    def description(self) -> str:
        return _CAUSES[self][1]


_CAUSES: dict[Cause, tuple[str, str]] = {
    Cause.REGISTRATION: (
        "a role without a canary whose health route hangs",
        "for a role without a canary: the health route accepts connections and does not answer "
        "(started by an unexcused timeout; ended by any answer, or by a timeout while the "
        "counters advance). With a canary, such a timeout sends one, whose clock decides",
    ),
    Cause.CANARY: (
        "timeouts, 5xx",
        "timeouts, 5xx, a rejection of a canary that passed before (ended by a pass, a failure "
        "that is not hard, or a timeout excused by other work's progress)",
    ),
    Cause.STALL: (
        "work in flight with quiet counters, confirmed by a canary",
        "a stall a canary confirmed (ended as the canary clock)",
    ),
    Cause.UNDISCOVERABLE: (
        "an instance gone from discovery while it answers",
        "a Dynamo worker's instance, listed before in this incarnation, gone from discovery "
        "while its system server answers (ended when it is listed again, or the worker stops "
        "answering: only a restart registers an orphaned worker again)",
    ),
    Cause.FAULT: (
        "vLLM's fault tolerance says unhealthy or dead",
        "vLLM's fault-tolerance status says the rank is unhealthy or dead (started by the first "
        "read that says so; ended when it reports healthy, or recovering)",
    ),
    Cause.NOT_SERVING: (
        "its health service says not serving after it served",
        "the engine's own health service (grpc.health.v1: NOT_SERVING; OpenEngine's Health: "
        "NOT_READY) says it cannot serve after it said it could, from a server that stays up "
        "(vLLM's gRPC server with its engine dead does so for good); started by the first such "
        "answer, ended by a serving one or a refusal",
    ),
}
