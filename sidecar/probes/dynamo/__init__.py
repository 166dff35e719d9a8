"""Canaries over Dynamo's request plane: one prober per backend, as Dynamo's own workers build
their health-check payloads (``_HEALTH_CHECK`` marker), sent straight to the worker's instance.

Where is the Dynamo decode canary of TensorRT-LLM built? ``trtllm.py``, method ``body``. The
encode worker's canary (a new image each time) is ``vllm.py``'s ``DynamoVllmEncoderProber``.
"""

from __future__ import annotations

from sidecar.probes.dynamo.base import HEALTH_CHECK_KEY, DynamoProber
from sidecar.probes.dynamo.sglang import DynamoSglangProber
from sidecar.probes.dynamo.trtllm import DynamoTrtllmProber
from sidecar.probes.dynamo.vllm import DynamoVllmEncoderProber, DynamoVllmProber

__all__ = [
    "HEALTH_CHECK_KEY",
    "DynamoProber",
    "DynamoSglangProber",
    "DynamoTrtllmProber",
    "DynamoVllmEncoderProber",
    "DynamoVllmProber",
]
