"""Canaries over the engines' gRPC generation services (SIDECAR_TRANSPORT=grpc), the services
SGLang Model Gateway routes to: one prober per backend, on the engines' own stubs.

Where is the gRPC decode canary of TensorRT-LLM built? ``trtllm.py``, method ``body``.
"""

from __future__ import annotations

from sidecar.probes.grpc.base import GrpcProber
from sidecar.probes.grpc.sglang import GrpcSglangProber
from sidecar.probes.grpc.trtllm import GrpcTrtllmProber
from sidecar.probes.grpc.vllm import GrpcVllmProber

__all__ = ["GrpcProber", "GrpcSglangProber", "GrpcTrtllmProber", "GrpcVllmProber"]
