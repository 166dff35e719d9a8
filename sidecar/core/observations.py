"""What the monitor saw, as values: the inputs of the pure step (:func:`sidecar.core.step.step`).

Each observation names the unit it is about (an endpoint, or one data-parallel rank of it); those
without a unit are about the worker as a whole. The monitor makes them from what the engine
answered; the control route makes the maintenance ones; SIGTERM makes the drain.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.core.evidence.faults import EngineReport
from sidecar.core.evidence.load import LoadSample
from sidecar.core.evidence.progress import CanaryCost, ProgressSample, ProgressSpec
from sidecar.core.evidence.result import Result
from sidecar.core.evidence.transfers import TransferSample


@dataclass(frozen=True)
class Registered:
    """The engine's own health route answered (or not): the registration check."""

    unit: str
    result: Result


@dataclass(frozen=True)
class ModelServed:
    """The served model's name, learned from the engine (None: it could not be learned, ``why``).
    Observed before the registration check it came with: a registered engine whose model is not
    known cannot be canaried, and the step counts it as not registered."""

    unit: str
    model: str | None
    why: str = ""


@dataclass(frozen=True)
class RanksCounted:
    """The data-parallel ranks the engine's metrics name (by ``label``), counted for the engine's
    ``incarnation`` (SIDECAR_DP_RANKS=auto)."""

    ranks: tuple[int, ...]
    label: str
    incarnation: int


@dataclass(frozen=True)
class CanaryDone:
    """A probe's whole answer (the canary, or the transfer probe). ``baseline`` and ``end`` are
    the unit's metrics read as it left and after it timed out; ``cost`` is what it moves on the
    engine's counters; ``suspected``: it left to confirm a stall suspicion."""

    unit: str
    result: Result
    incarnation: int
    baseline: ProgressSample | None = None
    end: ProgressSample | None = None
    cost: CanaryCost | None = None
    suspected: bool = False


@dataclass(frozen=True)
class ProgressRead:
    """One read of the engine's metrics, as this unit's progress (None: unreadable, ``why``)."""

    unit: str
    sample: ProgressSample | None
    why: str
    spec: ProgressSpec
    own: CanaryCost | None = None


@dataclass(frozen=True)
class SleepSaid:
    """What the engine's sleep route (``gauge`` False) or its sleep-state gauge said."""

    unit: str
    sleeping: bool | None
    why: str
    gauge: bool
    missing: bool = False  # the sleep route does not exist


@dataclass(frozen=True)
class FaultsSaid:
    """What the engine's fault-tolerance status (vLLM) says of this unit's rank: ``rank`` is the
    engine the report is about; ``report`` None: not reported; ``missing``: no such route."""

    unit: str
    rank: int | None
    report: EngineReport | None
    missing: bool = False


@dataclass(frozen=True)
class TransfersRead:
    """The failed-KV-transfer counters in one metrics read (None: not readable)."""

    unit: str
    sample: TransferSample | None


@dataclass(frozen=True)
class LoadRead:
    """The engine's own load report in one read (None: not readable, and why)."""

    unit: str
    sample: LoadSample | None
    why: str


@dataclass(frozen=True)
class DiscoverySaid:
    """Whether discovery lists the worker's instance (None: not asked)."""

    unit: str
    listed: bool | None
    instance: str | None
    where: str


@dataclass(frozen=True)
class EngineHealthSaid:
    """What the engine said of itself, where it is not the registration check (a Dynamo
    worker's /health, OpenEngine's inference probe); ``ready`` None: no answer."""

    unit: str
    ready: bool | None
    status: str | None
    detail: str
    status_code: int | None = None  # where it answered over HTTP


@dataclass(frozen=True)
class MaintenanceDeclared:
    """A maintenance window declared (or replaced) on every endpoint."""

    reason: str
    seconds: float
    wall: float  # the wall-clock time it was declared


@dataclass(frozen=True)
class MaintenanceOver:
    """The declared maintenance window ends (its time is up, or the control route ended it)."""

    why: str


@dataclass(frozen=True)
class DrainAsked:
    """SIGTERM: the worker drains (notready from now on)."""


@dataclass(frozen=True)
class Heartbeat:
    """The monitor ran: liveness, which time alone changes, is looked at again."""


Observation = (
    Registered
    | ModelServed
    | RanksCounted
    | CanaryDone
    | ProgressRead
    | SleepSaid
    | FaultsSaid
    | TransfersRead
    | LoadRead
    | DiscoverySaid
    | EngineHealthSaid
    | MaintenanceDeclared
    | MaintenanceOver
    | DrainAsked
    | Heartbeat
)
