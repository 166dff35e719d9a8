"""The kinds of probe and their one protocol, as blackbox_exporter's probers share one
signature and one map (prober/handler.go).

Each kind lives in a file of its own:

- ``http``: a canary over the engine's HTTP API (:mod:`sidecar.probes.http`; its body per
  backend in ``sidecar/probes/<backend>.py``);
- ``dynamo``: a canary over Dynamo's request plane, straight to this pod's worker instance
  (:mod:`sidecar.probes.dynamo.canary`; its payload per backend in
  ``sidecar/probes/dynamo/<backend>.py``);
- ``grpc``: a canary over the engine's gRPC generation service (:mod:`sidecar.probes.grpc.canary`;
  its request per backend in ``sidecar/probes/grpc/<backend>.py``);
- ``transfer``: the KV transfer probe of a vLLM decode worker (:mod:`sidecar.probes.transfer`).

The monitor holds one map from kind to probe (built in :mod:`sidecar.wiring`) and sends
each unit's probe through it: ``await probes[plan.probe](plan, request, model)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sidecar.probes.base import CanaryPlan, CanaryRequest, ProbeKind

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result

__all__ = ["Probe", "ProbeKind"]


class Probe(Protocol):
    """One probe of one unit. It keeps its own deadline (the whole answer), never raises for
    what the engine does (every outcome is a :class:`~sidecar.core.evidence.result.Result`),
    and stops on the engine what it gave up on where the engine lets it."""

    async def __call__(
        self, plan: CanaryPlan, request: CanaryRequest, model: str | None
    ) -> Result: ...

    async def aclose(self) -> None:
        """Stop what the probe still owns (a canary kept on its connection, its own clients)."""
        ...
