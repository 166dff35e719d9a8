"""The scheduler: one loop that asks :func:`sidecar.core.schedule.next_due` what is due, starts
it, and waits for the earliest of the rest or for an observation. Each piece of work is one task
owned by the loop; it does the I/O and hands what it saw, as observations
(:mod:`sidecar.core.observations`), to :meth:`Health.observe`, the pure step. What to ask and
how to weigh it is decided in the core and in ``sidecar/probes/``; this module only asks.

- Registration: the transport's registration check every SIDECAR_REGISTRATION_INTERVAL (one
  signature for every transport: :class:`~sidecar.probes.exchange.Registration`; with it, where
  the transport asks them, the engine's own opinion and whether discovery lists it); then learn
  the served model for the units that want it (:meth:`Snapshot.wants_model`) and ask the routes
  :func:`sidecar.probes.units.asks` names (sleep, fault tolerance).
- Metrics: GET and parse the engine's metrics once every SIDECAR_METRICS_INTERVAL, for all its
  units: each rank's progress, the failed-transfer counters, the sleep-state gauge. Never two
  reads of one route at a time (:class:`Reads`).
- Ranks: with SIDECAR_DP_RANKS=auto, count them in the metrics until they answer, once per
  incarnation; the step splits the units (:class:`~sidecar.core.observations.RanksCounted`).
- Maintenance: end a declared window when its time is up.
- Probes, per unit: the canary (or the transfer probe, SIDECAR_KV_PEER_URL) when due; its whole
  answer is waited for and observed before the next is due: never more than one in flight per
  unit. With progress on, a canary that times out is weighed against the metrics read just
  after it (one read serves every unit that timed out together) and the engine-level read before
  it left, less what the canary itself moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from sidecar.core.endpoint import maintenance_due, suspected
from sidecar.core.evidence.faults import read_status, report_for
from sidecar.core.evidence.lifecycle import sleeping_in
from sidecar.core.evidence.load import read_load
from sidecar.core.evidence.progress import (
    Exposition,
    MetricsUnreadable,
    ProgressSample,
    ProgressSpec,
    Series,
    names_of,
    ranks_in,
    read_progress,
)
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import read_transfers
from sidecar.core.observations import (
    CanaryDone,
    DiscoverySaid,
    EngineHealthSaid,
    FaultsSaid,
    Heartbeat,
    LoadRead,
    MaintenanceOver,
    ModelServed,
    Observation,
    ProgressRead,
    RanksCounted,
    Registered,
    SleepSaid,
    TransfersRead,
)
from sidecar.core.schedule import Job, Timing, Work, next_due
from sidecar.probes.base import TRANSFER, CanaryPlan
from sidecar.probes.exchange import MetricsSource, NoAnswer, Registration
from sidecar.probes.kinds import Probe
from sidecar.probes.units import asks, plans_of
from sidecar.runtime.engine import EngineClient
from sidecar.runtime.health import Health

log = logging.getLogger("sidecar.monitor")


@dataclass(frozen=True)
class EngineParts:
    """What the monitor reaches the engine with: the engine's HTTP routes (None: it serves none
    the sidecar reads), one probe per kind (:mod:`sidecar.probes.kinds`), the transport's
    registration check, and where its metrics are read (None: not read)."""

    client: EngineClient | None
    probes: Mapping[str, Probe]
    registration: Registration
    metrics: MetricsSource | None = None


@dataclass(frozen=True)
class Read:
    """One read of the engine's metrics: its text (None, and why not), when it started and ended,
    and the canaries sent before it ended and done before it began, per unit."""

    text: str | None
    why: str
    started: float
    at: float
    wall: float
    sent: Mapping[str, int] = field(default_factory=dict)
    done: Mapping[str, int] = field(default_factory=dict)


class Reads:
    """The engine's metrics, read one route at a time: a caller that needs a read started since
    some moment gets the last one, the one in flight, or a new one. So the periodic read and
    every timed-out canary's read after it share, and the engine sees one read per interval
    plus at most one for the canaries that timed out together."""

    def __init__(
        self,
        client: MetricsSource | None,
        clock: Callable[[], float],
        sent: Mapping[str, int],
        done: Mapping[str, int],
    ) -> None:
        self.client = client
        self.clock = clock
        self._sent, self._done = sent, done
        self._last: dict[str, Read] = {}
        self._flight: dict[str, tuple[float, asyncio.Task[Read]]] = {}

    async def since(self, path: str, since: float) -> Read:
        """A read of ``path`` that started at or after ``since``."""
        last = self._last.get(path)
        if last is not None and last.started >= since:
            return last
        flight = self._flight.get(path)
        if flight is not None:
            started, task = flight
            read = await asyncio.shield(task)
            if started >= since:
                return read
            return await self.since(path, since)  # it began too early: read again
        task = asyncio.create_task(self._read(path), name=f"read:{path}")
        self._flight[path] = (self.clock(), task)
        return await asyncio.shield(task)

    async def _read(self, path: str) -> Read:
        started = self.clock()
        done = dict(self._done)  # finished before the read began
        try:
            if self.client is None:
                text, why = None, f"GET {path}: the engine's metrics are not read here"
            else:
                text, why = await self.client.metrics_text(path)
        finally:
            del self._flight[path]
        sent = dict(self._sent)  # started before the read ended
        read = Read(text, why, started, self.clock(), time.time(), sent, done)
        self._last[path] = read
        return read

    async def aclose(self) -> None:
        tasks = [task for _, task in self._flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _read_by(plan: CanaryPlan, spec: ProgressSpec) -> tuple[Series, ...]:
    """Every series one unit reads in the engine's metrics."""
    transfers = plan.transfers.every() if plan.transfers is not None else ()
    load = plan.reads.load.every() if plan.reads.load is not None else ()
    return (*spec.every(), *transfers, *plan.awake, *load)


async def wait_event(event: asyncio.Event, seconds: float | None) -> None:
    """Wait until the event is set or the seconds have passed (None: no limit)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def _probe_of(plan: CanaryPlan) -> Job | None:
    if plan.probe == TRANSFER:
        return Job.TRANSFER
    return Job.CANARY if plan.enabled else None


class Monitor:
    def __init__(
        self,
        health: Health,
        engine: EngineParts,
        plans: Mapping[str, CanaryPlan],
        timing: Timing,
    ) -> None:
        """``plans``: each endpoint's plan (a rank's is its endpoint's, pinned)."""
        self.health = health
        self.engine = engine
        self.client = engine.client
        self.plans = plans
        self.timing = timing
        # The loop's own state: set by the one who changes the state, cleared by the loop.
        self._wake = asyncio.Event()
        self._running: dict[Work, asyncio.Task[None]] = {}
        self._started: dict[Work, float] = {}
        # Canaries sent, and finished, so far, per unit: each metrics read notes both.
        self._sent: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self.reads = Reads(engine.metrics, health.clock, self._sent, self._done)

    @property
    def probes(self) -> Mapping[str, Probe]:
        return self.engine.probes

    def unit_plans(self) -> dict[str, CanaryPlan]:
        """Each unit's plan, in the snapshot's unit layout now."""
        return plans_of(self.health.snapshot, self.plans)

    def observe(self, obs: Observation) -> None:
        """Hand an observation to the step, and wake the loop: what is due may have changed."""
        self.health.observe(obs)
        self._wake.set()

    async def run(self) -> None:
        """Run until cancelled. An unexpected error in any work propagates (and stops the rest)."""
        try:
            while True:
                self._wake.clear()
                self._reap()
                now = self.health.clock()
                plans = self.unit_plans()
                probes = {unit: _probe_of(plan) for unit, plan in plans.items()}
                due = next_due(
                    self.health.snapshot, probes, self.timing, self._started, self._running, now
                )
                waiting: list[float] = []
                for work, at in sorted(due.items()):
                    if at is None:
                        continue
                    if at > now:
                        waiting.append(at)
                    else:
                        self._start(work, now)
                if self._wake.is_set():  # the state changed while starting: look again
                    continue
                await wait_event(self._wake, min(waiting) - now if waiting else None)
        finally:
            for task in self._running.values():
                task.cancel()
            await asyncio.gather(*self._running.values(), return_exceptions=True)
            self._running.clear()
            await self.reads.aclose()

    def _reap(self) -> None:
        """Forget the work that ended, and stop the work of units that are gone (the ranks were
        counted anew): nothing writes to a unit that is gone. An unexpected error in any work
        stops the monitor."""
        units = self.health.snapshot.endpoints
        for work, task in list(self._running.items()):
            if work.unit and work.unit not in units:
                task.cancel()
            if task.done():
                del self._running[work]
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]

    def _start(self, work: Work, now: float) -> None:
        """Do what is due: at once when it needs no I/O, else as a task the loop owns."""
        self._started[work] = now
        if work.job is Job.HEARTBEAT:
            self.observe(Heartbeat())
            return
        if work.job is Job.MAINTENANCE:
            window = maintenance_due(self.health.snapshot.endpoints.values())
            assert window is not None  # next_due says it is due only while one is declared
            self.observe(MaintenanceOver(f"its {window.until - window.since:g} s are up"))
            return
        jobs: dict[Job, Callable[[str], Awaitable[None]]] = {
            Job.REGISTRATION: self._registration,
            Job.METRICS: self._metrics,
            Job.RANKS: self._count_ranks,
            Job.CANARY: self._canary,
            Job.TRANSFER: self._transfer,
        }
        self._running[work] = asyncio.create_task(self._owned(work, jobs[work.job]), name=str(work))

    async def _owned(self, work: Work, job: Callable[[str], Awaitable[None]]) -> None:
        try:
            await job(work.unit)
        finally:
            self._wake.set()  # the loop looks again: this work is no longer in flight

    # --- the engine's own routes ------------------------------------------------------------
    async def _count_ranks(self, _: str) -> None:
        """SIDECAR_DP_RANKS=auto: the ranks the engine's in-flight gauges name, for the step."""
        incarnation = self.health.snapshot.incarnation()
        canary = next(p for p in self.plans.values() if p.is_canary)
        assert canary.reads.pin is not None  # auto only where a canary can be pinned
        label = canary.reads.pin.label
        spec = canary.progress_spec()
        read = await self.reads.since(spec.path, self.health.clock() - self._slack())
        found = ranks_in(read.text, (*spec.running, *spec.waiting), label) if read.text else ()
        if found:  # not yet while the metrics do not name them
            self.observe(RanksCounted(found, label, incarnation))

    def _slack(self) -> float:
        """How long before now a read may have started and still count as now's: half the
        shortest metrics interval (a busy engine's)."""
        if self.timing.metrics is None:
            return self.timing.registration / 2
        return min(self.timing.metrics, self.health.snapshot.policy.busy_metrics_interval) / 2

    async def _registration(self, _: str) -> None:
        """The transport's registration check, once per interval for all its units, with what it
        brings: the served model, the engine's own opinion, whether discovery lists it."""
        checked = await self.engine.registration()
        result = checked.registration
        wanting = self.health.snapshot.wants_model() if result.ok else []
        if wanting and (checked.model is not None or self.client is not None):
            if checked.model is not None:
                model, why = checked.model
            else:
                assert self.client is not None
                model, why = await self.client.served_model()
            for unit in self._present(tuple(wanting)):
                self.observe(ModelServed(unit, model, why))
        health, listed = checked.engine_health, checked.listed
        for unit in list(self.health.snapshot.endpoints):
            self.observe(Registered(unit, result))
            if health is not None:
                self.observe(
                    EngineHealthSaid(unit, health.ready, health.status, health.detail, health.code)
                )
            if listed is not None:
                self.observe(DiscoverySaid(unit, listed.listed, listed.instance, listed.where))
        await self._ask_routes()

    async def _ask_routes(self) -> None:
        """The routes the registration check brings: each asked once for its units."""
        said = asks(self.health.snapshot, self.plans)
        if self.client is None:
            return
        for path, units in said.sleep.items():
            sleeping, why, missing = await self.client.sleep_state(path)
            for unit in self._present(units):
                self.observe(SleepSaid(unit, sleeping, why, gauge=False, missing=missing))
        for path, units in said.faults.items():
            answer = await self.client.get(path)
            if isinstance(answer, NoAnswer):
                continue  # no word: the registration check and the canary see that engine
            reports, missing = read_status(answer.status, answer.body.decode(errors="replace"))
            if reports is None and not missing:
                continue
            for unit in self._present(units):
                rank, report = report_for(reports or {}, self.health.snapshot.rank_of.get(unit))
                self.observe(FaultsSaid(unit, rank, report, missing))

    def _present(self, units: tuple[str, ...]) -> list[str]:
        """The units still in the layout (the ranks may have been counted anew meanwhile)."""
        return [u for u in units if u in self.health.snapshot.endpoints]

    def _readers(self) -> dict[str, tuple[CanaryPlan, ProgressSpec]]:
        """The units that read the engine's metrics: those with a canary."""
        return {
            unit: (plan, plan.progress_spec())
            for unit, plan in self.unit_plans().items()
            if plan.enabled and plan.is_canary
        }

    async def _metrics(self, _: str) -> None:
        """The engine's metrics, read and parsed once per path, given to every unit: its rank's
        progress, its transfer counters, its sleep-state gauge."""
        readers = self._readers()
        for path in {spec.path for _, spec in readers.values()}:
            read = await self.reads.since(path, self.health.clock() - self._slack())
            self._fan_out(path, read, {n: r for n, r in readers.items() if r[1].path == path})

    def _fan_out(
        self, path: str, read: Read, readers: dict[str, tuple[CanaryPlan, ProgressSpec]]
    ) -> None:
        why = read.why
        parsed: Exposition | None = None
        if read.text is not None:
            wanted = [s for plan, spec in readers.values() for s in _read_by(plan, spec)]
            try:
                parsed = Exposition.parse(read.text, names_of(wanted))
            except MetricsUnreadable as exc:
                why = f"GET {path}: {exc}"
        for unit, (plan, spec) in readers.items():
            if unit not in self.health.snapshot.endpoints:  # a unit gone while it answered
                continue
            sample = None
            if parsed is not None:
                counted = (read.sent.get(unit, 0), read.done.get(unit, 0))
                sample = read_progress(parsed, spec, read.at, read.wall, counted)
            own = plan.cost(plan.request(None, "cost"))
            self.observe(ProgressRead(unit, sample, why, spec, own))
            if parsed is not None and plan.transfers is not None:
                transfers = read_transfers(parsed, plan.transfers, read.at, read.wall)
                self.observe(TransfersRead(unit, transfers))
            if parsed is not None and plan.awake:
                sleeping, what = sleeping_in(parsed, plan.awake)
                self.observe(SleepSaid(unit, sleeping, f"{path}: {what}", gauge=True))
            if plan.reads.load is not None:
                load = None if parsed is None else read_load(parsed, plan.reads.load, read.at)
                self.observe(LoadRead(unit, load, why))

    # --- the probes -------------------------------------------------------------------------
    async def _transfer(self, unit: str) -> None:
        probe = self.probes[TRANSFER]
        plan = self.unit_plans()[unit]
        # Its registration check learns the served model, as a canary's does.
        snap = self.health.snapshot
        incarnation, model = snap.endpoints[unit].incarnation, snap.models[unit]
        result = await probe(plan, plan.request(model, f"kv-probe-{uuid.uuid4()}"), model)
        log.debug("%s: transfer probe %s: %s", unit, result.outcome, result.reason)
        self.observe(CanaryDone(unit, result, incarnation))

    async def _end_read(
        self, unit: str, spec: ProgressSpec, result: Result
    ) -> ProgressSample | None:
        """The metrics after a canary timed out: a read that started at most a quarter of the
        canary's wait (and half a metrics interval) before its timeout, so that it covers the
        wait; shared by every unit whose canary timed out then."""
        waited = result.finished - result.started
        since = result.finished - min(self._slack(), waited / 4)
        return await self._shared_read(unit, spec, since)

    async def _shared_read(
        self, unit: str, spec: ProgressSpec, since: float
    ) -> ProgressSample | None:
        """This unit's progress in a read of the engine's metrics that started at or after
        ``since``: the last one, the one in flight, or a new one (:class:`Reads`)."""
        read = await self.reads.since(spec.path, since)
        if read.text is None:
            return None
        counted = (read.sent.get(unit, 0), read.done.get(unit, 0))
        try:
            return read_progress(read.text, spec, read.at, read.wall, counted)
        except MetricsUnreadable:
            return None

    async def _canary(self, unit: str) -> None:
        plan = self.unit_plans()[unit]
        snap = self.health.snapshot
        policy = snap.policy
        watching = self.timing.metrics is not None
        probe = self.probes[plan.probe]
        ep, model = snap.endpoints[unit], snap.models[unit]
        confirming = suspected(ep, policy, self.health.clock())
        request = plan.request(model, f"canary-{uuid.uuid4()}")
        log.debug(
            "%s: sending canary %s%s",
            unit,
            request.request_id,
            " to confirm a stall suspicion" if confirming else "",
        )
        spec = plan.progress_spec()
        self._sent[unit] = self._sent.get(unit, 0) + 1
        self._done.setdefault(unit, 0)
        # Its baseline: a read that leaves with it (beside it, so that it never delays it): what
        # the engine computed before the canary left must not excuse its timeout. Should that
        # read fail, the engine-level read before it stands in, when within one interval of it.
        latest = ep.progress.latest if ep.progress.readable else None
        now = self.health.clock()
        reading = asyncio.create_task(self._shared_read(unit, spec, now)) if watching else None
        try:
            result = await probe(plan, request, model)
        except BaseException:
            if reading is not None:
                reading.cancel()
            raise
        baseline = await reading if reading is not None else None
        if baseline is None and latest is not None and latest.at >= now - policy.metrics_interval:
            baseline = latest
        end = None
        if watching and result.outcome is Outcome.TIMEOUT:
            # Only evidence about this canary: the read counts it in flight, so it does not go
            # into the progress source (whose reads of the engine's own work it would skew).
            end = await self._end_read(unit, spec, result)
        self._done[unit] += 1
        self.observe(
            CanaryDone(
                unit,
                result,
                ep.incarnation,
                baseline=baseline,
                end=end,
                cost=plan.cost(request),
                suspected=confirming,
            )
        )
