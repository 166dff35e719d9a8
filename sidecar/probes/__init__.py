"""Role-aware canaries: one prober per backend and transport, and the pure rule that plans an
endpoint's canary.

Where is a decode canary built? In the backend's module, method ``body``: over the engine's HTTP
API ``vllm.py``, ``sglang.py``, ``trtllm.py`` or ``openai.py``; over Dynamo's request plane
(SIDECAR_TRANSPORT=dynamo) ``dynamo/vllm.py``, ``dynamo/sglang.py`` or ``dynamo/trtllm.py``;
over the engine's gRPC service (SIDECAR_TRANSPORT=grpc) ``grpc/vllm.py``, ``grpc/sglang.py`` or
``grpc/trtllm.py``.
An image encoder's canary is its backend's encoder prober, beside it (``vllm.py``:
``VllmEncoderProber``), with its image made in ``image.py``.
How is its answer judged? ``judge.py``. How is it sent and stopped? ``canary.py``, through one
probe per kind (``kinds.py``: ``http.py``, ``dynamo/canary.py``, ``grpc/canary.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.core.endpoint import GENERATE, KV_TRANSFER
from sidecar.probes.base import CanaryPlan, CanaryRequest, Prober
from sidecar.probes.dynamo import (
    DynamoSglangProber,
    DynamoTrtllmProber,
    DynamoVllmEncoderProber,
    DynamoVllmProber,
)
from sidecar.probes.grpc import (
    GRPC_SERVICES,
    NATIVE_SERVICE,
    GrpcSglangNativeProber,
    GrpcSglangProber,
    GrpcTrtllmProber,
    GrpcVllmProber,
)
from sidecar.probes.kinds import Probe, ProbeKind
from sidecar.probes.openai import OpenAIProber
from sidecar.probes.role import Backend, EmbeddingTransfer, Mode, ModelType, Role, Transport
from sidecar.probes.sglang import SglangEncoderProber, SglangProber
from sidecar.probes.transfer import PATH
from sidecar.probes.trtllm import TrtllmProber
from sidecar.probes.vllm import VllmEncoderProber, VllmProber

__all__ = [
    "GRPC_SERVICES",
    "Backend",
    "CanaryConfig",
    "CanaryPlan",
    "CanaryRequest",
    "EmbeddingTransfer",
    "Mode",
    "ModelType",
    "Probe",
    "ProbeKind",
    "Prober",
    "Role",
    "Transport",
    "plan_canary",
    "plan_transfer_probe",
    "prober_for",
]


@dataclass(frozen=True)
class CanaryConfig:
    """What decides an endpoint's canary, as configured: the engine's API, how it is reached, the
    worker's role, and what the user chose."""

    backend: Backend
    role: Role
    transport: Transport = Transport.HTTP
    enabled: bool = False  # DYN_HEALTH_CHECK_ENABLED
    payload: Mapping[str, Any] | None = None  # DYN_HEALTH_CHECK_PAYLOAD
    path: str | None = None  # SIDECAR_CANARY_PATH
    dynamo_endpoint: str | None = None  # SIDECAR_DYNAMO_ENDPOINT
    bootstrap_port: int = 8998  # SIDECAR_SGLANG_BOOTSTRAP_PORT
    embedding_transfer: EmbeddingTransfer = EmbeddingTransfer.NIXL_WRITE  # DYN_VLLM_EMBEDDING_...
    grpc_service: str | None = None  # SIDECAR_GRPC_SERVICE (None: the backend's first)


#: The role whose canary goes to an image encoder (SIDECAR_DISAGGREGATION_MODE=encode with
#: SIDECAR_MODEL_TYPE=multimodal).
ENCODER = Role(Mode.ENCODE, ModelType.MULTIMODAL)


def prober_for(config: CanaryConfig) -> Prober:
    if config.transport is Transport.DYNAMO:
        endpoint = config.dynamo_endpoint or GENERATE
        match config.backend:
            case Backend.VLLM if config.role == ENCODER:
                return DynamoVllmEncoderProber(endpoint, config.embedding_transfer)
            case Backend.VLLM:
                return DynamoVllmProber(endpoint)
            case Backend.SGLANG:
                return DynamoSglangProber(endpoint, config.bootstrap_port)
            case Backend.TRTLLM:
                return DynamoTrtllmProber(endpoint)
            case Backend.OPENAI:  # refused by the configuration's checks
                raise ValueError("no Dynamo worker speaks the openai backend")
    if config.transport is Transport.GRPC:
        match config.backend:
            case Backend.VLLM:
                return GrpcVllmProber()
            case Backend.SGLANG if config.grpc_service == NATIVE_SERVICE:
                return GrpcSglangNativeProber(config.bootstrap_port)
            case Backend.SGLANG:
                return GrpcSglangProber(config.bootstrap_port)
            case Backend.TRTLLM:
                return GrpcTrtllmProber()
            case Backend.OPENAI:  # refused by the configuration's checks
                raise ValueError("no openai engine serves a gRPC generation service")
    match config.backend:
        case Backend.VLLM if config.role == ENCODER:
            return VllmEncoderProber()
        case Backend.VLLM:
            return VllmProber()
        case Backend.SGLANG if config.role.mode is Mode.ENCODE:  # any model type: its routes
            return SglangEncoderProber(config.bootstrap_port)
        case Backend.SGLANG:
            return SglangProber(config.bootstrap_port)
        case Backend.TRTLLM:
            return TrtllmProber()
        case Backend.OPENAI:
            return OpenAIProber()


def plan_transfer_probe(config: CanaryConfig, peer_url: str, interval: float) -> CanaryPlan:
    """The kv_transfer endpoint's plan: a prefill peer at ``peer_url`` (SIDECAR_KV_PEER_URL),
    probed every ``interval`` (SIDECAR_KV_PROBE_INTERVAL)."""
    why = (
        f"a real KV transfer from the prefill peer {peer_url}, decoded here and checked against "
        f"a local prefill, every {interval:g} s and when transfers fail"
    )
    prober = prober_for(config)
    return CanaryPlan(KV_TRANSFER, True, why, prober, config.role, PATH, probe=ProbeKind.TRANSFER)


def plan_canary(config: CanaryConfig, endpoint: str = GENERATE) -> CanaryPlan:
    """Decide whether the endpoint gets a canary, why, and with which request."""
    prober = prober_for(config)
    path = config.path or prober.generation_path
    override = dict(config.payload) if config.payload is not None else None
    kind = {Transport.DYNAMO: ProbeKind.DYNAMO, Transport.GRPC: ProbeKind.GRPC}.get(
        config.transport, ProbeKind.HTTP
    )

    def plan(enabled: bool, why: str) -> CanaryPlan:
        return CanaryPlan(endpoint, enabled, why, prober, config.role, path, override, probe=kind)

    if not config.enabled:
        return plan(
            False,
            "canaries are off (DYN_HEALTH_CHECK_ENABLED=false); readiness follows registration",
        )
    if override is not None:
        return plan(True, "DYN_HEALTH_CHECK_PAYLOAD replaces the built-in body")
    skip = prober.skip_reason(config.role)
    if skip is not None:
        return plan(False, skip)
    return plan(True, prober.why(config.role))
