"""The scheduler: per endpoint a registration loop, a canary loop and a progress loop, plus the
heartbeat, all owned by one TaskGroup on the monitor's event loop.

- Registration: GET the engine's own health route every SIDECAR_REGISTRATION_INTERVAL (and learn
  the served model when the canary needs it). A Dynamo worker (SIDECAR_TRANSPORT=dynamo) is
  checked by :class:`sidecar.runtime.requestplane.worker.DynamoWorker` instead: its instance, its
  own
  /health and whether discovery lists it; its canaries go over the request plane.
- Progress: GET the engine's metrics every SIDECAR_METRICS_INTERVAL.
- Sleep: with the registration check, ask a backend that can sleep whether it sleeps; with the
  metrics read, read its sleep-state gauge.
- KV transfers: with the metrics read, read the failed-transfer counters; the transfer probe
  (SIDECAR_KV_PEER_URL) runs on a schedule of its own (:meth:`Monitor._transfer_due`).
- Ranks: with SIDECAR_DP_RANKS=auto, count them in the metrics once, then run every loop per
  rank.
- Maintenance: end a declared window when its time is up.
- Canary: send one when :func:`sidecar.core.endpoint.canary_due` says so, wait for its whole answer,
  record it, and only then look at the next: never more than one in flight per endpoint. With
  progress on, the metrics are also read as it leaves and again if it times out: a timeout is
  weighed against the progress between those two reads, less what the canary itself moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping

from sidecar.core.endpoint import canary_due, maintenance_due, suspected, transfer_due
from sidecar.core.evidence.lifecycle import sleeping_in
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
from sidecar.core.verdict import HEARTBEAT_INTERVAL
from sidecar.probes import CanaryPlan, Probe, ProbeKind
from sidecar.probes.http import HttpCanary
from sidecar.runtime.engine import EngineClient
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
    ) -> None:
        self.health = health
        self.client = client
        self.registration_path = registration_path
        self.registration_interval = registration_interval
        self.watch_progress = watch_progress
        self.metrics_path = metrics_path
        self.metrics_interval = metrics_interval
        self.discover_ranks = discover_ranks
        # One probe per kind (sidecar.probes.kinds); the HTTP canary by default.
        self.probes: Mapping[ProbeKind, Probe] = probes or {ProbeKind.HTTP: HttpCanary(client)}
        self.probe_interval = probe_interval
        self.worker = worker
        self._changed = asyncio.Event()
        # Canaries sent, and finished, so far, per unit: each metrics read notes both.
        self._sent: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._group: asyncio.TaskGroup | None = None
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}  # per unit

    async def run(self) -> None:
        """Run until cancelled. An unexpected error in any loop propagates (and stops the rest)."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._heartbeat(), name="heartbeat")
            group.create_task(self._maintenance_timer(), name="maintenance")
            group.create_task(self._registration_loop(), name="registration")
            if self.watch_progress:
                group.create_task(self._progress_loop(), name="progress")
            for name, plan in self.health.plans.items():
                self._start_unit(name, plan)
            if self.discover_ranks:
                template = next(p for p in self.health.plans.values() if p.probe.is_canary)
                group.create_task(self._discover_ranks(template), name="discover-ranks")

    def _start_unit(self, name: str, plan: CanaryPlan) -> None:
        """The probe loop of one unit (an endpoint, or one rank of it), owned by the TaskGroup.
        What the engine says of itself (registration, lifecycle, metrics) is read once per
        engine by the engine-level loops and given to every unit."""
        assert self._group is not None
        group = self._group
        self._sent.setdefault(name, 0)
        self._done.setdefault(name, 0)
        tasks = []
        if plan.probe is ProbeKind.TRANSFER:
            tasks.append(group.create_task(self._transfer_loop(name), name=f"probe:{name}"))
        elif plan.enabled:
            tasks.append(group.create_task(self._canary_loop(name, plan), name=f"canary:{name}"))
        self._tasks[name] = tasks

    async def _discover_ranks(self, template: CanaryPlan) -> None:
        """SIDECAR_DP_RANKS=auto: count the ranks in the engine's metrics once they answer; more
        than one, and the endpoint is checked rank by rank from then on."""
        label = template.prober.rank_label
        assert label is not None  # the configuration refuses auto without one
        spec = template.progress_spec(self.metrics_path)
        while True:
            text, _ = await self.client.metrics_text(spec.path)
            found = ranks_in(text, (*spec.running, *spec.waiting), label) if text else ()
            if found:
                break
            await asyncio.sleep(self.registration_interval)
        log.info(
            "the engine's metrics show %d data-parallel rank(s) (%s=%s)",
            len(found),
            label,
            ",".join(map(str, found)),
        )
        if len(found) < 2:
            return
        old = list(self._tasks)
        plans = self.health.set_ranks(len(found))
        for name in old:
            for task in self._tasks.pop(name):
                task.cancel()
        for name, plan in plans.items():
            self._start_unit(name, plan)
        self._changed_now()

    async def _reached(self, due: float | None, changed: asyncio.Event) -> bool:
        """True when ``due`` (monotonic; None: never) has come; else wait until it comes or the
        state changes, and return False (the caller looks again)."""
        if due is None:
            await wait_event(changed, None)
            return False
        delay = due - self.health.clock()
        if delay > 0:
            await wait_event(changed, delay)
            return False
        return True

    def _changed_now(self) -> None:
        """Wake the canary loops: the state changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _maintenance_timer(self) -> None:
        """End a declared maintenance window at its deadline."""
        while True:
            changed = self._changed
            first = maintenance_due(self.health.snapshot.endpoints.values())
            if not await self._reached(first.until if first else None, changed):
                continue
            assert first is not None
            self.health.end_maintenance(f"its {first.until - first.since:g} s are up")
            self._changed_now()

    async def _transfer_loop(self, name: str) -> None:
        probe = self.probes[ProbeKind.TRANSFER]
        plan = self.health.plans[name]
        while True:
            changed = self._changed
            snap = self.health.snapshot
            due = transfer_due(
                snap.endpoints[name],
                snap.endpoints.values(),
                self.health.policy,
                self.probe_interval,
                self.health.clock(),
            )
            if not await self._reached(due, changed):
                continue
            # Its registration loop learns the served model, as a canary's does.
            snap = self.health.snapshot
            ep = snap.endpoints[name]
            model = snap.models[name]
            result = await probe(plan, plan.request(model, f"kv-probe-{uuid.uuid4()}"), model)
            log.debug("%s: transfer probe %s: %s", name, result.outcome, result.reason)
            self.health.record_canary(name, result, ep.incarnation)
            self._changed_now()

    async def _heartbeat(self) -> None:
        while True:
            self.health.tick()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

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
        for name in list(self.health.plans):
            self.health.record_registration(name, check.registration)
            self.health.record_engine_health(name, health.status_code, health.status, health.detail)
            self.health.record_discovery(name, check.listed, instance, worker.plane.where)

    async def _registration_loop(self) -> None:
        """The engine's own health route, once per interval for all its units."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            if self.worker is not None:
                await self._check_worker(self.worker)
            else:
                await self._check_registration()
            self._changed_now()
            await asyncio.sleep(max(0.0, started + self.registration_interval - loop.time()))

    async def _check_registration(self) -> None:
        result = await self.client.registration(self.registration_path)
        plans = dict(self.health.plans)
        if result.ok:
            snap = self.health.snapshot
            unknown = [
                name
                for name, plan in plans.items()
                if self._needs_discovery(plan)
                and (not snap.endpoints[name].registration.registered or snap.models[name] is None)
            ]
            model, why = (await self.client.served_model()) if unknown else (None, "")
            plans = {n: p for n, p in plans.items() if n in self.health.plans}  # ranks may be new
            for name in (n for n in unknown if n in plans):
                self.health.set_model(name, model)
                if model is None:  # registered, but not usable without the model's name
                    plans.pop(name)
                    unusable = Result(
                        Outcome.ERROR,
                        f"model not known: {why}",
                        result.started,
                        result.finished,
                        result.wall_time,
                    )
                    self.health.record_registration(name, unusable)
        for name in plans:
            self.health.record_registration(name, result)
        await self._ask_sleep()

    async def _ask_sleep(self) -> None:
        """Ask the engine's sleep route once for every unit whose backend has one."""
        snap = self.health.snapshot
        asking: dict[str, list[str]] = {}
        for name, plan in self.health.plans.items():
            path = plan.prober.sleep_path
            ep = snap.endpoints[name]
            if path and ep.registration.registered and not ep.lifecycle.sleep_route_missing:
                asking.setdefault(path, []).append(name)
        for path, names in asking.items():
            sleeping, why, missing = await self.client.sleep_state(path)
            for name in (n for n in names if n in self.health.plans):
                self.health.record_sleep(name, sleeping, why, gauge=False, missing=missing)

    async def _read(self, name: str, spec: ProgressSpec) -> tuple[ProgressSample | None, str]:
        """One unit's own read of the metrics, beside its canary (the baseline of a timeout)."""
        done = self._done[name]  # finished before the read began
        text, why = await self.client.metrics_text(spec.path)
        if text is None:
            return None, why
        sent = self._sent[name]  # started before the read ended
        try:
            sample = read_progress(text, spec, self.health.clock(), time.time(), (sent, done))
        except MetricsUnreadable as exc:
            return None, f"GET {spec.path}: {exc}"
        return sample, why

    def _readers(self) -> dict[str, tuple[CanaryPlan, ProgressSpec]]:
        """The units that read the engine's metrics: those with a canary."""
        return {
            name: (plan, plan.progress_spec(self.metrics_path))
            for name, plan in self.health.plans.items()
            if plan.enabled and plan.probe is not ProbeKind.TRANSFER
        }

    async def _progress_loop(self) -> None:
        """The engine's metrics, read and parsed once per interval, given to every unit: its
        rank's progress, its transfer counters, its sleep-state gauge."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            readers = self._readers()
            paths = {spec.path for _, spec in readers.values()}
            for path in paths:
                await self._read_for(path, {n: r for n, r in readers.items() if r[1].path == path})
            self._changed_now()
            await asyncio.sleep(max(0.0, started + self.metrics_interval - loop.time()))

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
        for name, (plan, spec) in readers.items():
            if name not in self.health.plans:  # a unit gone while the engine answered
                continue
            sample = None
            if parsed is not None:
                counted = (sent.get(name, 0), done.get(name, 0))
                sample = read_progress(parsed, spec, at, wall, counted)
            own = plan.cost(plan.request(None, "cost"))  # what one canary moves
            self.health.record_sample(name, sample, why, spec, own)
            if parsed is not None and plan.transfers is not None:
                self.health.record_transfers(name, read_transfers(parsed, plan.transfers, at, wall))
            if parsed is not None and plan.awake:
                sleeping, what = sleeping_in(parsed, plan.awake)
                self.health.record_sleep(name, sleeping, f"{path}: {what}", gauge=True)

    async def _canary_loop(self, name: str, plan: CanaryPlan) -> None:
        policy = self.health.policy
        spec = plan.progress_spec(self.metrics_path) if self.watch_progress else None
        probe = self.probes[plan.probe]
        while True:
            changed = self._changed
            ep = self.health.snapshot.endpoints[name]
            due = canary_due(ep, policy)
            if not await self._reached(due, changed):
                continue
            confirming = suspected(ep, policy, self.health.clock())
            model = self.health.snapshot.models[name]
            request = plan.request(model, f"canary-{uuid.uuid4()}")
            log.debug(
                "%s: sending canary %s%s",
                name,
                request.request_id,
                " to confirm a stall suspicion" if confirming else "",
            )
            if spec is None:
                self._sent[name] += 1
                result = await probe(plan, request, model)
                baseline = end = None
            else:
                # The baseline read runs beside the canary, so it never delays it.
                self._sent[name] += 1
                reading = asyncio.create_task(self._read(name, spec), name=f"baseline:{name}")
                try:
                    result = await probe(plan, request, model)
                except BaseException:
                    reading.cancel()
                    raise
                baseline, _ = await reading
                # Only evidence about this canary: they count it in flight, so they do not go
                # into the progress source (whose reads of the engine's own work they would skew).
                end = None
                if result.outcome is Outcome.TIMEOUT:
                    end, _ = await self._read(name, spec)
            self._done[name] += 1
            self.health.record_canary(
                name,
                result,
                ep.incarnation,
                baseline=baseline,
                end=end,
                cost=plan.cost(request),
                suspected=confirming,
            )
            self._changed_now()
