"""The vocabulary of a canary's choice: which engine API, how it is reached, and the worker's
role. The configuration reads these names from its variables; the probers decide by them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Backend(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    OPENAI = "openai"


class Transport(StrEnum):
    HTTP = "http"  # the engine's own HTTP API at SIDECAR_ENGINE_URL
    DYNAMO = "dynamo"  # Dynamo's request plane, straight to the worker's instance
    GRPC = "grpc"  # the engine's gRPC generation service (SGLang Model Gateway's protos)


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
    mode: Mode
    model_type: ModelType


class EmbeddingTransfer(StrEnum):
    """How Dynamo's vLLM encode worker hands its embeddings on (DYN_VLLM_EMBEDDING_TRANSFER_MODE,
    its ``--embedding-transfer-mode``; nixl-write when unset, as its code has it)."""

    LOCAL = "local"  # a file in the worker's TMPDIR, named in the answer
    NIXL_WRITE = "nixl-write"
    NIXL_READ = "nixl-read"
