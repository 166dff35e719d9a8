"""The scheduler: one loop that asks :func:`sidecar.core.schedule.next_due` what is due, starts
it, and waits for the earliest of the rest or for an observation. Each piece of work is one task
owned by the loop; it does the I/O and hands what it saw, as observations
(:mod:`sidecar.core.observations`), to :meth:`Health.observe`, the pure step.

- Registration: GET the engine's own health route every SIDECAR_REGISTRATION_INTERVAL (and learn
  the served model when the canary needs it; ask a backend that can sleep whether it sleeps). A
  Dynamo worker (SIDECAR_TRANSPORT=dynamo) is checked by
  :class:`sidecar.runtime.requestplane.worker.DynamoWorker` instead: its instance, its own
  /health and whether discovery lists it; its canaries go over the request plane.
- Metrics: GET and parse the engine's metrics once every SIDECAR_METRICS_INTERVAL, for all its
  units: each rank's progress, the failed-transfer counters, the sleep-state gauge.
- Ranks: with SIDECAR_DP_RANKS=auto, count them in the metrics until they answer; with more than
  one, each rank is a unit of its own from then on.
- Maintenance: end a declared window when its time is up.
- Probes, per unit: the canary (or the transfer probe, SIDECAR_KV_PEER_URL) when due; its whole
  answer is waited for and observed before the next is due: never more than one in flight per
  unit. With progress on, the metrics are also read as a canary leaves and again if it times
  out: a timeout is weighed against the progress between those two reads, less what the canary
  itself moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

from sidecar.core.endpoint import maintenance_due, suspected
from sidecar.core.evidence.faults import read_status, report_for
from sidecar.core.evidence.lifecycle import sleeping_in
from sidecar.core.evidence.progress import (
    CanaryCost,
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
    MaintenanceOver,
    ModelServed,
    Observation,
    ProgressRead,
    Registered,
    SleepSaid,
    TransfersRead,
)
from sidecar.core.schedule import Job, Timing, Work, next_due
from sidecar.probes import CanaryPlan, Probe, ProbeKind
from sidecar.probes.http import HttpCanary
from sidecar.runtime.engine import EngineClient, NoAnswer
from sidecar.runtime.grpcregistration import GrpcRegistration, asks_engine_http
from sidecar.runtime.health import Health
from sidecar.runtime.requestplane.worker import DynamoWorker

log = logging.getLogger("sidecar.monitor")


def _read_by(plan: CanaryPlan, spec: ProgressSpec) -> tuple[Series, ...]:
    """Every series one unit reads in the engine's metrics."""
    transfers = plan.transfers.every() if plan.transfers is not None else ()
    return (*spec.every(), *transfers, *plan.awake)


async def wait_event(event: asyncio.Event, seconds: float | None) -> None:
    """Wait until the event is set or the seconds have passed (None: no limit)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def _probe_of(plan: CanaryPlan) -> Job | None:
    if plan.probe is ProbeKind.TRANSFER:
        return Job.TRANSFER
    return Job.CANARY if plan.enabled else None


class Monitor:
    def __init__(
        self,
        health: Health,
        client: EngineClient,
        registration_path: str,
        registration_interval: float,
        *,
        watch_progress: bool = False,
        metrics_path: str | None = None,
        metrics_interval: float = 1.0,
        discover_ranks: bool = False,
        probes: Mapping[ProbeKind, Probe] | None = None,
        probe_interval: float = 60.0,
        worker: DynamoWorker | None = None,
        grpc_registration: GrpcRegistration | None = None,
    ) -> None:
        self.health = health
        self.client = client
        self.registration_path = registration_path
        self.metrics_path = metrics_path
        self.watch_progress = watch_progress
        # One probe per kind (sidecar.probes.kinds); the HTTP canary by default.
        self.probes: Mapping[ProbeKind, Probe] = probes or {ProbeKind.HTTP: HttpCanary(client)}
        self.worker = worker
        # SIDECAR_REGISTRATION: the engine's gRPC health service instead of its HTTP route.
        self.grpc_registration = grpc_registration
        self.discover_ranks = discover_ranks
        self.timing = Timing(
            registration=registration_interval,
            metrics=metrics_interval if watch_progress else None,
            transfer=probe_interval,
        )
        self._counted_for: int | None = None  # the incarnation whose ranks were counted
        # The loop's own state: set by the one who changes the state, cleared by the loop.
        self._wake = asyncio.Event()
        self._running: dict[Work, asyncio.Task[None]] = {}
        self._started: dict[Work, float] = {}
        # Canaries sent, and finished, so far, per unit: each metrics read notes both.
        self._sent: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._costs: dict[str, CanaryCost] = {}  # what one canary moves, per unit

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
                probes = {unit: _probe_of(plan) for unit, plan in self.health.plans.items()}
                timing = replace(self.timing, count_ranks=self._counting())
                due = next_due(
                    self.health.snapshot, probes, timing, self._started, self._running, now
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

    def _reap(self) -> None:
        """Forget the work that ended; an unexpected error in it stops the monitor."""
        for work, task in list(self._running.items()):
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

    # --- the work ---------------------------------------------------------------------------
    def _incarnation(self) -> int:
        """The engine's incarnation, as its canary units see it (they share registration)."""
        snap = self.health.snapshot
        return max(
            (snap.endpoints[u].incarnation for u, p in self.health.plans.items() if p.enabled),
            default=0,
        )

    def _counting(self) -> bool:
        """SIDECAR_DP_RANKS=auto and this incarnation of the engine not counted yet."""
        return self.discover_ranks and self._counted_for != self._incarnation()

    async def _count_ranks(self, _: str) -> None:
        """SIDECAR_DP_RANKS=auto: count the ranks in the engine's metrics, once per incarnation
        (a restarted engine may have others); with more than one, each rank is a unit of its
        own, with one, the engine is checked as one."""
        incarnation = self._incarnation()
        canaries = [p for p in self.health.plans.values() if p.probe.is_canary]
        label = canaries[0].prober.rank_label
        assert label is not None  # the configuration refuses auto without one
        spec = replace(canaries[0], rank=None).progress_spec(self.metrics_path)
        text, _why = await self.client.metrics_text(spec.path)
        found = ranks_in(text, (*spec.running, *spec.waiting), label) if text else ()
        if not found or incarnation != self._incarnation():
            return  # not yet: the metrics do not name them, or the engine changed meanwhile
        first = self._counted_for is None
        self._counted_for = incarnation
        per_endpoint = len(canaries) // len({p.endpoint for p in canaries})
        had = per_endpoint if any(p.rank is not None for p in canaries) else 1
        if first or len(found) != had:
            log.info(
                "the engine's metrics show %d data-parallel rank(s) (%s=%s)%s",
                len(found),
                label,
                ",".join(map(str, found)),
                "" if first else f"; it had {had} before it restarted",
            )
        if len(found) == had:
            return
        old = {p.unit for p in canaries}
        self.health.set_ranks(len(found))
        for work, task in list(self._running.items()):
            if work.unit in old and work.unit not in self.health.plans:
                task.cancel()  # nothing writes to a unit that is gone
        self._costs.clear()
        self._wake.set()

    async def _transfer(self, unit: str) -> None:
        probe = self.probes[ProbeKind.TRANSFER]
        plan = self.health.plans[unit]
        # Its registration check learns the served model, as a canary's does.
        snap = self.health.snapshot
        incarnation, model = snap.endpoints[unit].incarnation, snap.models[unit]
        result = await probe(plan, plan.request(model, f"kv-probe-{uuid.uuid4()}"), model)
        log.debug("%s: transfer probe %s: %s", unit, result.outcome, result.reason)
        self.observe(CanaryDone(unit, result, incarnation))

    async def _registration(self, _: str) -> None:
        """The engine's own health route, once per interval for all its units."""
        if self.worker is not None:
            await self._check_worker(self.worker)
        else:
            await self._check_registration()

    def _needs_discovery(self, plan: CanaryPlan) -> bool:
        return (
            plan.enabled
            and plan.override is None
            and plan.prober.needs_model
            and self.health.settings.model is None
        )

    async def _check_worker(self, worker: DynamoWorker) -> None:
        check = await worker.check()
        health = check.engine_health
        instance = str(check.instance) if check.instance is not None else None
        for unit in list(self.health.plans):
            self.observe(Registered(unit, check.registration))
            self.observe(EngineHealthSaid(unit, health.status_code, health.status, health.detail))
            self.observe(DiscoverySaid(unit, check.listed, instance, worker.plane.where))

    async def _check_registration(self) -> None:
        if self.grpc_registration is not None:
            result = await self.grpc_registration()
        else:
            result = await self.client.registration(self.registration_path)
        units = list(self.health.plans)
        if result.ok:
            snap = self.health.snapshot
            unknown = [
                unit
                for unit, plan in self.health.plans.items()
                if self._needs_discovery(plan)
                and (not snap.endpoints[unit].registration.registered or snap.models[unit] is None)
            ]
            model, why = (await self.client.served_model()) if unknown else (None, "")
            units = [u for u in units if u in self.health.plans]  # ranks may be new
            for unit in (u for u in unknown if u in self.health.plans):
                self.observe(ModelServed(unit, model))
                if model is None:  # registered, but not usable without the model's name
                    units.remove(unit)
                    unusable = Result(
                        Outcome.ERROR,
                        f"model not known: {why}",
                        result.started,
                        result.finished,
                        result.wall_time,
                    )
                    self.observe(Registered(unit, unusable))
        for unit in units:
            self.observe(Registered(unit, result))
        await self._ask_sleep()
        await self._ask_faults()

    def _over_http(self, plan: CanaryPlan) -> bool:
        return asks_engine_http(plan, over_grpc=self.grpc_registration is not None)

    async def _ask_sleep(self) -> None:
        """Ask the engine's sleep route once for every unit whose backend has one."""
        snap = self.health.snapshot
        asking: dict[str, list[str]] = {}
        for unit, plan in self.health.plans.items():
            path = plan.prober.sleep_path
            ep = snap.endpoints[unit]
            asked = ep.registration.registered and not ep.lifecycle.sleep_route_missing
            if path and self._over_http(plan) and asked:
                asking.setdefault(path, []).append(unit)
        for path, units in asking.items():
            sleeping, why, missing = await self.client.sleep_state(path)
            for unit in (u for u in units if u in self.health.plans):
                self.observe(SleepSaid(unit, sleeping, why, gauge=False, missing=missing))

    async def _ask_faults(self) -> None:
        """Read the engine's fault-tolerance status (vLLM) once for every unit of a backend that
        serves one, each told its own rank's report; a route that does not exist is not asked
        again (this incarnation)."""
        snap = self.health.snapshot
        asking: dict[str, list[str]] = {}
        for unit, plan in self.health.plans.items():
            path = plan.prober.fault_path
            ep = snap.endpoints[unit]
            if (
                path
                and plan.probe.is_canary
                and self._over_http(plan)
                and ep.registration.registered
                and not ep.faults.missing
            ):
                asking.setdefault(path, []).append(unit)
        for path, units in asking.items():
            answer = await self.client.get(path)
            if isinstance(answer, NoAnswer):
                continue  # no word: the registration check and the canary see that engine
            reports, missing = read_status(answer.status, answer.body.decode(errors="replace"))
            if reports is None and not missing:
                continue
            for unit in (u for u in units if u in self.health.plans):
                rank, report = report_for(reports or {}, self.health.plans[unit].rank)
                self.observe(FaultsSaid(unit, rank, report, missing))

    async def _read(self, unit: str, spec: ProgressSpec) -> ProgressSample | None:
        """One unit's own read of the metrics, beside its canary (the baseline of a timeout)."""
        done = self._done[unit]  # finished before the read began
        text, _why = await self.client.metrics_text(spec.path)
        if text is None:
            return None
        sent = self._sent[unit]  # started before the read ended
        try:
            return read_progress(text, spec, self.health.clock(), time.time(), (sent, done))
        except MetricsUnreadable:
            return None

    def _readers(self) -> dict[str, tuple[CanaryPlan, ProgressSpec]]:
        """The units that read the engine's metrics: those with a canary."""
        return {
            unit: (plan, plan.progress_spec(self.metrics_path))
            for unit, plan in self.health.plans.items()
            if plan.enabled and plan.probe is not ProbeKind.TRANSFER
        }

    async def _metrics(self, _: str) -> None:
        """The engine's metrics, read and parsed once per path, given to every unit: its rank's
        progress, its transfer counters, its sleep-state gauge."""
        readers = self._readers()
        for path in {spec.path for _, spec in readers.values()}:
            await self._read_for(path, {n: r for n, r in readers.items() if r[1].path == path})

    def _cost(self, unit: str, plan: CanaryPlan) -> CanaryCost:
        if unit not in self._costs:
            self._costs[unit] = plan.cost(plan.request(None, "cost"))
        return self._costs[unit]

    async def _read_for(
        self, path: str, readers: dict[str, tuple[CanaryPlan, ProgressSpec]]
    ) -> None:
        done = dict(self._done)  # finished before the read began
        text, why = await self.client.metrics_text(path)
        sent = dict(self._sent)  # started before the read ended
        at, wall = self.health.clock(), time.time()
        parsed: Exposition | None = None
        if text is not None:
            wanted = [s for plan, spec in readers.values() for s in _read_by(plan, spec)]
            try:
                parsed = Exposition.parse(text, names_of(wanted))
            except MetricsUnreadable as exc:
                why = f"GET {path}: {exc}"
        for unit, (plan, spec) in readers.items():
            if unit not in self.health.plans:  # a unit gone while the engine answered
                continue
            sample = None
            if parsed is not None:
                counted = (sent.get(unit, 0), done.get(unit, 0))
                sample = read_progress(parsed, spec, at, wall, counted)
            self.observe(ProgressRead(unit, sample, why, spec, self._cost(unit, plan)))
            if parsed is not None and plan.transfers is not None:
                self.observe(TransfersRead(unit, read_transfers(parsed, plan.transfers, at, wall)))
            if parsed is not None and plan.awake:
                sleeping, what = sleeping_in(parsed, plan.awake)
                self.observe(SleepSaid(unit, sleeping, f"{path}: {what}", gauge=True))

    async def _canary(self, unit: str) -> None:
        plan = self.health.plans[unit]
        policy = self.health.policy
        spec = plan.progress_spec(self.metrics_path) if self.watch_progress else None
        probe = self.probes[plan.probe]
        snap = self.health.snapshot
        ep, model = snap.endpoints[unit], snap.models[unit]
        confirming = suspected(ep, policy, self.health.clock())
        request = plan.request(model, f"canary-{uuid.uuid4()}")
        log.debug(
            "%s: sending canary %s%s",
            unit,
            request.request_id,
            " to confirm a stall suspicion" if confirming else "",
        )
        self._sent[unit] = self._sent.get(unit, 0) + 1
        self._done.setdefault(unit, 0)
        baseline = end = None
        if spec is None:
            result = await probe(plan, request, model)
        else:
            # The baseline read runs beside the canary, so it never delays it.
            reading = asyncio.create_task(self._read(unit, spec), name=f"baseline:{unit}")
            try:
                result = await probe(plan, request, model)
            except BaseException:
                reading.cancel()
                raise
            baseline = await reading
            # Only evidence about this canary: they count it in flight, so they do not go into
            # the progress source (whose reads of the engine's own work they would skew).
            if result.outcome is Outcome.TIMEOUT:
                end = await self._read(unit, spec)
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
