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
