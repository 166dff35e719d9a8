"""What the engine says of its own faults: vLLM's fault tolerance.

A vLLM started with ``--enable-fault-tolerance`` (external-LB data parallel) serves
``GET /fault_tolerance/status``: ``{"engines": [{"id": <rank>, "status": "healthy", ...}]}``,
one entry per engine (data-parallel rank) the server manages. When an engine's busy loop raises,
vLLM aborts its requests, marks it ``unhealthy`` (``dead`` when its executor failed) and waits
for ``POST /fault_tolerance/apply {"instruction": "retry"}`` or its recovery timeout; its
``/health`` answers 200 all the while. This source keeps what that route says of one unit's rank:

- ``unhealthy`` or ``dead``: the unit is notready with the engine's own words, and a liveness
  clock runs from the first read that said so (a restart is the cure vLLM's own timeout applies);
- ``paused`` or ``recovering``: notready and live, as a pause is; no canary is sent to it;
- back to ``healthy``: a fresh canary proves the engine before it is ready again.

A server that does not serve the route (404: no fault tolerance) is not asked again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.core.jsontext import loads as loads_json

FAILED = frozenset({"unhealthy", "dead"})
PAUSED = frozenset({"paused", "recovering"})
HEALTHY = "healthy"


@dataclass(frozen=True)
class EngineReport:
    """One engine's entry in the status: its state (lower case) and what it adds."""

    state: str
    detail: str = ""  # fault_info, ft_error


@dataclass(frozen=True)
class FaultState:
    report: EngineReport | None = None  # None: not asked yet, or not reported for this rank
    since: float | None = None  # monotonic: the first read of the current unhealthy state
    missing: bool = False  # the server has no fault tolerance (404): not asked again
    rank: int | None = None  # the engine the report is about
    changed_at: float = float("-inf")  # monotonic: it last turned healthy, failed or paused

    @property
    def kind(self) -> str:
        """What the report amounts to: healthy, failed or paused."""
        return "failed" if self.failed else "paused" if self.paused else "healthy"

    @property
    def failed(self) -> bool:
        return self.report is not None and self.report.state in FAILED

    @property
    def paused(self) -> bool:
        return self.report is not None and self.report.state in PAUSED

    @property
    def healthy(self) -> bool:
        return not (self.failed or self.paused)

    def reason(self) -> str:
        """Why the engine is not healthy, in its own words ("" when it is)."""
        if self.report is None or self.healthy:
            return ""
        engine = f"engine {self.rank}" if self.rank is not None else "the engine"
        detail = f" ({self.report.detail})" if self.report.detail else ""
        return f"vLLM fault tolerance: {engine} reports {self.report.state}{detail}"


def reports_in(body: Any) -> dict[int, EngineReport]:
    """Each engine's report in a ``/fault_tolerance/status`` body, by its id (rank); entries
    that are not well formed are left out (ValueError when the body is not the status at all)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("engines"), list):
        raise ValueError("not a fault-tolerance status: no 'engines' list")
    reports: dict[int, EngineReport] = {}
    for entry in body["engines"]:
        if not isinstance(entry, Mapping):
            continue
        rank, state = entry.get("id"), entry.get("status")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(state, str):
            continue
        detail = "; ".join(
            str(entry[k]) for k in ("fault_info", "ft_error") if entry.get(k) not in (None, "")
        )
        reports[rank] = EngineReport(state.lower(), detail)
    return reports


def report_for(
    reports: Mapping[int, EngineReport], rank: int | None
) -> tuple[int | None, EngineReport | None]:
    """The report about one unit: its rank's, or for a unit checked as one, the first engine
    that is not healthy (else any)."""
    if rank is not None:
        return rank, reports.get(rank)
    for engine, report in sorted(reports.items()):
        if report.state != HEALTHY:
            return engine, report
    first = min(reports, default=None)
    return first, reports.get(first) if first is not None else None


def on_fault_report(
    state: FaultState,
    rank: int | None,
    report: EngineReport | None,
    at: float,
    *,
    missing: bool = False,
) -> FaultState:
    """One read of the status for this unit (``missing``: the route is not served)."""
    if missing:
        return FaultState(missing=True, changed_at=state.changed_at)
    failed = report is not None and report.state in FAILED
    since = (state.since if state.failed else at) if failed else None
    after = FaultState(report=report, since=since, rank=rank, changed_at=state.changed_at)
    if after.kind != state.kind:
        after = FaultState(report=report, since=since, rank=rank, changed_at=at)
    return after


def read_status(status: int, body: str) -> tuple[dict[int, EngineReport] | None, bool]:
    """(reports, missing) from one answer of the status route: reports is None when the answer
    says nothing usable; ``missing`` when the server has no fault tolerance (404)."""
    if status == 404:
        return None, True
    if status != 200:
        return None, False
    try:
        return reports_in(loads_json(body)), False
    except ValueError:
        return None, False
