"""Canaries over the engines' gRPC generation services (SIDECAR_TRANSPORT=grpc), the services
SGLang Model Gateway routes to: one prober per backend, on the engines' own stubs.

Where is the gRPC decode canary of TensorRT-LLM built? ``trtllm.py``, method ``body``.
"""

from __future__ import annotations

from sidecar.probes.grpc.base import GrpcProber
from sidecar.probes.grpc.sglang import NATIVE_SERVICE, GrpcSglangNativeProber, GrpcSglangProber
from sidecar.probes.grpc.trtllm import GrpcTrtllmProber
from sidecar.probes.grpc.vllm import GrpcVllmProber
from sidecar.probes.role import Backend

#: Each backend's gRPC generation services, the default first (SIDECAR_GRPC_SERVICE).
GRPC_SERVICES: dict[Backend, tuple[str, ...]] = {
    Backend.VLLM: (GrpcVllmProber.service,),
    Backend.SGLANG: (GrpcSglangProber.service, NATIVE_SERVICE),
    Backend.TRTLLM: (GrpcTrtllmProber.service,),
}

__all__ = [
    "GRPC_SERVICES",
    "NATIVE_SERVICE",
    "GrpcProber",
    "GrpcSglangNativeProber",
    "GrpcSglangProber",
    "GrpcTrtllmProber",
    "GrpcVllmProber",
]
