"""The fixed policy, progress spec and canary cost the decision-table tests are written against."""

from __future__ import annotations

from sidecar.core.evidence.policy import Policy
from sidecar.core.vocabulary import Mode, Role
from sidecar.engines import vllm
from sidecar.transports.http.vllm import VllmProber

POLICY = Policy(
    failure_threshold=2, success_threshold=1, wait=1.0, retry=1.0, timeout=0.5,
    liveness_window=10.0, stall_window=2.5, metrics_interval=1.0,
)  # fmt: skip
SPEC = vllm.PROGRESS
COST = VllmProber(
    vllm.ENGINE, Role(Mode.AGGREGATED), vllm.ENGINE.canary(Role(Mode.AGGREGATED))
).cost(1)
