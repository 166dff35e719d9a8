"""The monitor in-process, on a virtual clock (aiotools' VirtualClock), against a scripted engine
client: its timing rules, tested without wall-clock windows.

Every ``asyncio.sleep`` and timeout of the monitor completes at once while the loop's clock
advances by its length; the Health reads the same clock. So "notready within the bound" is an
exact statement about the schedule, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiotools import VirtualClock

from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.observations import MaintenanceDeclared
from sidecar.core.verdict import Cause
from sidecar.probes.base import CanaryRequest
from sidecar.probes.canary import Canary
from sidecar.probes.exchange import Answer, NoAnswer, Received
from sidecar.runtime.engine import RouteRegistration
from sidecar.runtime.health import Health, liveness_of, readiness_of
from sidecar.runtime.monitor import EngineParts, Monitor
from sidecar.surface.metrics import Metrics
from sidecar.tools.probes import size
from sidecar.wiring import Blueprint, health_for, resolve
from tests.support.configured import answered_by, blueprint_from
from tests.support.exposition import metric

pytestmark = pytest.mark.unit

VLLM_METRICS = """\
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 10.0
"""  # one engine: SIDECAR_DP_RANKS=auto (the default) counts one rank


class ScriptedEngine:
    """The EngineClient's interface, answered from memory after the virtual time a real engine
    would take. ``hung`` makes every canary wait for its whole deadline; the calls are counted."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.hung = False
        self.calls: dict[str, int] = {}
        self.down = False  # refuses every connection (stopped, restarting)
        # vLLM's fault-tolerance status, per engine (rank): None serves no such route (404).
        self.faults: dict[int, str] | None = None
        self.metrics = VLLM_METRICS
        self.in_flight = 0
        self.most_in_flight = 0
        self.canary_starts: list[float] = []

    def _count(self, what: str) -> float:
        self.calls[what] = self.calls.get(what, 0) + 1
        return asyncio.get_running_loop().time()

    def _result(self, outcome: Outcome, reason: str, started: float) -> Result:
        return Result(outcome, reason, started, asyncio.get_running_loop().time(), 1e9, "r", 200)

    async def registration(self, path: str, *, any_status: bool = False) -> Result:
        started = self._count("registration")
        await asyncio.sleep(0.001)
        if self.down:
            return self._result(Outcome.ERROR, f"GET {path}: connection refused", started)
        return self._result(Outcome.SUCCESS, f"GET {path} -> 200", started)

    async def get(self, path: str) -> Answer:
        self._count(path)
        if path != "/fault_tolerance/status" or self.faults is None:
            return Answer(404, "application/json", b'{"detail":"Not Found"}', None)
        engines = [{"id": rank, "status": state} for rank, state in self.faults.items()]
        body = {"schema_version": 1, "total_engines": len(engines), "engines": engines}
        return Answer(200, "application/json", json.dumps(body).encode(), None)

    async def served_model(self) -> tuple[str | None, str]:
        self._count("served_model")
        return "tiny", "GET /v1/models -> 200"

    async def sleep_state(self, path: str) -> tuple[bool | None, str, bool]:
        self._count("sleep_state")
        return None, f"GET {path} -> 404", True

    async def metrics_text(self, path: str) -> tuple[str | None, str]:
        self._count("metrics")
        await asyncio.sleep(0.001)
        if self.down:
            return None, f"GET {path}: connection refused"
        return self.metrics, f"GET {path} -> 200"

    def redact(self, text: str) -> str:
        return text

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        """The canary's channel: a good completion after 10 ms, or nothing within the deadline."""
        started = self._count("canary")
        self.canary_starts.append(started)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hung:
                await asyncio.sleep(deadline)
                answer: Answer | NoAnswer = NoAnswer(Outcome.TIMEOUT, "canary timeout")
            else:
                await asyncio.sleep(0.01)
                answer = Answer(200, "application/json", COMPLETION)
        finally:
            self.in_flight -= 1
        return Received(answer, started, asyncio.get_running_loop().time(), 1e9)


COMPLETION = json.dumps(
    {
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1},
    }
).encode()


def configured(monkeypatch: pytest.MonkeyPatch, **env: str) -> Blueprint:
    base = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_MODEL": "tiny"}
    return blueprint_from(monkeypatch, **(base | env))


def run_virtually(
    b: Blueprint,
    script: Callable[[Health, ScriptedEngine, Monitor], Awaitable[Any]],
    *,
    check: bool = False,
) -> tuple[Health, ScriptedEngine]:
    """Run a Monitor on a virtual clock while ``script`` drives the engine and looks on."""

    async def main() -> tuple[Health, ScriptedEngine]:
        loop = asyncio.get_running_loop()
        with VirtualClock().patch_loop():
            s = b.settings
            health = health_for(b, clock=loop.time)
            engine = ScriptedEngine(s.request_timeout)
            api = b.engine.api(b.plan.role)
            path = s.registration_path or api.registration_path
            canary = Canary(
                engine,
                timeout=s.request_timeout,
                answers=answered_by(engine, path),
                clock=loop.time,
            )
            registration = RouteRegistration(
                engine,  # type: ignore[arg-type]
                path,
                any_status=s.registration_path is None and api.registered_by_any_answer,
            )
            monitor = Monitor(
                health,
                EngineParts(engine, {"http": canary}, registration, engine),  # type: ignore[arg-type]
                b.plans,
                b.timing,  # as the server starts it
            )
            task = asyncio.create_task(monitor.run())
            try:
                await script(health, engine, monitor)
            finally:
                task.cancel()
                (ended,) = await asyncio.gather(task, return_exceptions=True)
            if check and isinstance(ended, Exception):
                raise ended  # the monitor's own error, not the cancellation
            # The monitor owns every task it started: none outlives it.
            assert asyncio.all_tasks() == {asyncio.current_task()}
            return health, engine

    return asyncio.run(main())


async def until(what: Callable[[], bool], limit: float, step: float = 0.01) -> float:
    """Virtual seconds until ``what()`` holds (fails past ``limit``)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not what():
        assert loop.time() - start < limit, f"not within {limit} virtual s"
        await asyncio.sleep(step)
    return loop.time() - start


def ready(health: Health) -> bool:
    return readiness_of(health.snapshot, health.clock()).ready


@pytest.mark.parametrize("phase", [0.0, 2.5, 5.0, 9.9])
def test_a_hang_is_notready_within_the_bound_whenever_it_starts(monkeypatch, phase):
    b = configured(monkeypatch)
    bound = size(b, 7200).hang_to_notready  # what `health-sidecar probes` sizes the probes by
    took: list[float] = []

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        await until(lambda: ready(health), 5)
        await asyncio.sleep(phase)  # the hang starts at any point of the schedule
        engine.hung = True
        took.append(await until(lambda: not ready(health), bound + 1))

    _, engine = run_virtually(b, script)
    assert took[0] <= bound, (took, bound)
    assert engine.most_in_flight == 1  # never two canaries at once, hung or not


def test_an_idle_healthy_engine_gets_one_canary_per_wait(monkeypatch):
    b = configured(monkeypatch, DYN_CANARY_WAIT_TIME="10")

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        await until(lambda: ready(health), 5)
        first = len(engine.canary_starts)
        await asyncio.sleep(60)
        assert len(engine.canary_starts) - first in (5, 6, 7)
        gaps = [b - a for a, b in zip(engine.canary_starts, engine.canary_starts[1:], strict=False)]
        assert all(9.9 <= gap <= 11.1 for gap in gaps), gaps

    run_virtually(b, script)


def test_liveness_fails_one_window_after_the_hard_failures_start(monkeypatch):
    b = configured(monkeypatch, SIDECAR_LIVENESS_WINDOW="30")

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        await until(lambda: ready(health), 5)
        sent = engine.calls["canary"]
        engine.hung = True
        await until(lambda: engine.calls["canary"] > sent, 20)
        first_hung = engine.canary_starts[-1]
        loop = asyncio.get_running_loop()
        await until(lambda: not liveness_of(health.snapshot, loop.time()).live, 60)
        # The clock starts when the first canary that hung left (the engine was hung from then
        # on, as its timeout proves) and runs the whole window.
        assert loop.time() - first_hung == pytest.approx(30, abs=0.05)

    run_virtually(b, script)


def ranks_metrics(count: int) -> str:
    """The in-flight gauges of ``count`` vLLM engines (ranks)."""
    return "".join(
        f'vllm:num_requests_{what}{{engine="{rank}",model_name="tiny"}} 0.0\n'
        for rank in range(count)
        for what in ("running", "waiting")
    )


def test_ranks_are_counted_by_default_and_again_after_each_restart(monkeypatch):
    b = configured(monkeypatch)  # SIDECAR_DP_RANKS unset: auto for vllm
    seen: list[tuple[str, ...]] = []

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        def units() -> tuple[str, ...]:
            return tuple(health.snapshot.endpoints)

        def restart(ranks: int) -> Awaitable[float]:
            async def go() -> float:
                engine.down = True
                await until(lambda: not ready(health), 5)
                engine.metrics, engine.down = ranks_metrics(ranks), False
                return await until(lambda: ready(health) and len(units()) == max(ranks, 1), 10)

            return go()

        engine.metrics = ranks_metrics(2)
        await until(lambda: ready(health) and len(units()) == 2, 10)
        seen.append(units())
        await restart(3)
        seen.append(units())
        await restart(1)  # one rank: checked as one again
        seen.append(units())

    run_virtually(b, script)
    assert seen == [
        ("generate/rank0", "generate/rank1"),
        ("generate/rank0", "generate/rank1", "generate/rank2"),
        ("generate",),
    ]


def test_the_engine_is_read_once_per_interval_for_all_its_ranks(monkeypatch):
    b = configured(monkeypatch, SIDECAR_DP_RANKS="2")
    counted: dict[str, int] = {}

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        engine.metrics = ranks_metrics(2)
        await until(lambda: ready(health), 5)
        before = dict(engine.calls)
        await asyncio.sleep(25)
        counted.update({k: engine.calls.get(k, 0) - before.get(k, 0) for k in engine.calls})
        assert set(health.snapshot.endpoints) == {"generate/rank0", "generate/rank1"}

    run_virtually(b, script)
    # One registration check and one metrics read a second, not one per rank; and one more
    # read at most per canary (its baseline is a read that leaves with it, so that what the
    # engine computed before it left cannot excuse its timeout; a periodic read reuses it when
    # it started within half an interval).
    assert 24 <= counted["registration"] <= 26, counted
    # Each rank has its own canary, every wait (10 s): two each in 25 s.
    assert counted["canary"] == 4, counted
    assert 24 <= counted["metrics"] <= 26 + counted["canary"], counted


def test_a_window_declared_from_outside_wakes_the_loop_and_ends_on_time(monkeypatch):
    b = configured(monkeypatch, DYN_CANARY_WAIT_TIME="10")

    async def script(health: Health, engine: ScriptedEngine, monitor: Monitor) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: ready(health), 5)
        sent = len(engine.canary_starts)
        monitor.observe(MaintenanceDeclared("weights", 30.0, 1e9))
        declared = loop.time()
        assert not ready(health)
        await until(lambda: len(engine.canary_starts) > sent, 40)
        # No canary during the window; one at once when it ends (the engine proves itself).
        assert engine.canary_starts[-1] - declared == pytest.approx(30, abs=0.05)
        await until(lambda: ready(health), 1)

    run_virtually(b, script)


def test_an_unexpected_error_in_any_work_stops_the_monitor(monkeypatch):
    b = configured(monkeypatch)

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        await until(lambda: ready(health), 5)

        async def broken(path: str) -> tuple[str | None, str]:
            raise RuntimeError("a bug")

        engine.metrics_text = broken  # type: ignore[method-assign]
        await asyncio.sleep(5)

    with pytest.raises(RuntimeError, match="a bug"):
        run_virtually(b, script, check=True)


def test_a_fault_the_engine_reports_is_notready_and_restarts_only_after_the_window(monkeypatch):
    b = configured(monkeypatch, SIDECAR_LIVENESS_WINDOW="30")

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        loop = asyncio.get_running_loop()
        engine.faults = {0: "healthy"}
        await until(lambda: ready(health), 5)
        engine.faults = {0: "unhealthy"}  # its /health still answers 200
        took = await until(lambda: not ready(health), 5)
        assert took <= b.settings.registration_interval + 0.1
        verdict = health.snapshot.verdicts["generate"]
        assert verdict.reason == "vLLM fault tolerance: engine 0 reports unhealthy"
        text = Metrics(health, b.about).exposition().decode()
        assert (
            metric(text, "health_sidecar_engine_fault", endpoint="generate", state="unhealthy") == 1
        )
        assert metric(text, "health_sidecar_engine_fault", endpoint="generate", state="dead") == 0
        started = loop.time()
        await until(lambda: not liveness_of(health.snapshot, loop.time()).live, 40)
        assert loop.time() - started == pytest.approx(
            30, abs=b.settings.registration_interval + 0.1
        )
        assert liveness_of(health.snapshot, loop.time()).cause is Cause.FAULT

        engine.faults = {0: "recovering"}  # notready and live, as a pause is; no canary
        await until(lambda: liveness_of(health.snapshot, loop.time()).live, 5)
        sent = engine.calls["canary"]
        await asyncio.sleep(30)
        assert engine.calls["canary"] == sent
        assert not ready(health)

        engine.faults = {0: "healthy"}  # a fresh canary proves it at once
        await until(lambda: engine.calls["canary"] > sent, b.settings.registration_interval + 0.1)
        await until(lambda: ready(health), 1)

    run_virtually(b, script)


def test_a_server_without_fault_tolerance_is_asked_once(monkeypatch):
    b = configured(monkeypatch)

    async def script(health: Health, engine: ScriptedEngine, _: Monitor) -> None:
        await until(lambda: ready(health), 5)
        await asyncio.sleep(20)
        assert engine.calls["/fault_tolerance/status"] == 1  # 404: not asked again
        assert engine.calls["registration"] >= 20

    run_virtually(b, script)


def test_what_is_handed_in_from_outside_wakes_the_monitor_as_wired():
    """The sidecar as sidecar.wiring builds it: a window declared from outside (the control route,
    on another thread) goes to the monitor, which wakes; when it ends, the canary that proves the
    engine leaves at once, not at the next heartbeat."""
    import httpx

    from sidecar.core.observations import MaintenanceOver
    from sidecar.wiring import build
    from tests.support.inprocess import EngineLink, run_virtually, settings_of

    url = "http://engine:8000"
    blueprint = resolve(
        settings_of(
            {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": url, "SIDECAR_MODEL": "tiny"}
        )
    )

    def canaries(engine: EngineLink) -> int:
        return sum(r["path"] == "/v1/completions" for r in engine.state.requests)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        engine = EngineLink("vllm")
        side = build(blueprint, connect=lambda _: engine)
        app = side.servers.http.config.app  # type: ignore[attr-defined]
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://side")
        monitor = asyncio.create_task(side.monitor.main())  # the LoopThread's coroutine, here
        try:

            async def ready() -> bool:
                return (await http.get("/health")).status_code == 200

            await until_async(ready, 5)
            side.monitor.observe(MaintenanceDeclared("weights", 600.0, 1e9))
            await asyncio.sleep(3)
            sent = canaries(engine)
            side.monitor.observe(MaintenanceOver("done"))
            ended = loop.time()
            await until(lambda: canaries(engine) > sent, 1, step=0.001)
            return loop.time() - ended
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
            await http.aclose()
            await engine.aclose()

    assert run_virtually(main) < 0.01


async def until_async(what: Callable[[], Awaitable[bool]], limit: float) -> float:
    """Virtual seconds until ``await what()`` holds (fails past ``limit``)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await what():
        assert loop.time() - start < limit, f"not within {limit} virtual s"
        await asyncio.sleep(0.01)
    return loop.time() - start
