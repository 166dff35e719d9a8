"""The one protocol every probe follows, as blackbox_exporter's probers share one signature
(prober/handler.go): each transport's canary probe (the common probe of
:mod:`sidecar.probes.canary`, through the transport's channel: ``sidecar/transports/<t>/``) and
the KV transfer probe (:mod:`sidecar.probes.transfer`).

The monitor holds one map from kind to probe (built in :mod:`sidecar.wiring`; a kind is the
transport's name, or :data:`~sidecar.probes.base.TRANSFER`) and sends each unit's probe through
it: ``await probes[plan.probe](plan, request, model)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sidecar.probes.base import CanaryPlan, CanaryRequest

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result

__all__ = ["Probe"]


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
