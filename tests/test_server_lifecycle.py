"""The process's lifecycle (``sidecar/runtime/server.py``: startup, drain on SIGTERM, Ctrl-C, a
monitor that crashes or goes silent, a server that cannot bind) through its seams, in-process on
a virtual clock, as uvicorn tests its supervisors.

The lifecycle is the real ``Sidecar`` over the real monitor, probes, engine client and HTTP app
(built as ``sidecar.wiring`` builds them) against the fake engine's ASGI app
(``tests/support/inprocess.py``). What stands in for a part that needs the operating system:

- a server is a :class:`FakeServer`: ``serve()`` until ``should_exit`` (looked at every 0.1 s,
  as uvicorn's main loop does), or, its port taken, back at once with ``started`` False (as
  uvicorn does once it has logged why); a client reaches the app through it while it serves,
  and is refused once it has stopped;
- the monitor's runner is a :class:`TaskRunner`: the monitor as a task on this loop (the real
  ``LoopThread`` runs it on a loop and a thread of its own);
- a signal is raised in this process (``signal.raise_signal``): the event loop's handler, which
  the lifecycle installs, hands it to ``handle_term`` or ``handle_int``.

What only a real process shows (the kernel delivering SIGTERM to ``python -m sidecar``, its exit
status, uvicorn really closing its port) stays in ``tests/test_e2e_fake.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from sidecar.core.observations import Observation
from sidecar.core.verdict import HEARTBEAT_STALE
from sidecar.runtime.health import Health
from sidecar.runtime.server import DRAIN_POLL, Servers, Sidecar, StartupError
from sidecar.wiring import health_for, monitor_main, policy_of, resolve, sidecar_for, surface_for
from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, settings_of, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}
TICK = 0.1  # uvicorn's main loop looks at should_exit this often
REGISTRATION = 1.0  # SIDECAR_REGISTRATION_INTERVAL's default
STEP = 0.01  # how often a timing test polls: its bounds allow one step
EXIT = DRAIN_POLL + TICK + STEP  # from the moment a drain may end to the servers being gone

Main = Callable[[], Coroutine[Any, Any, None]]


class FakeServer(httpx.AsyncBaseTransport):
    """A server as the lifecycle sees one (uvicorn's ``Server``), and the port it serves as a
    client sees it (an httpx transport to its app)."""

    def __init__(
        self, app: Any = None, *, binds: bool = True, stops_after: float | None = None
    ) -> None:
        self.started = False
        self.should_exit = False
        self.binds = binds
        self.stops_after = stops_after  # it stops by itself this long after it started
        self.serving = False
        self.exited_at: float | None = None
        self._asgi = httpx.ASGITransport(app=app) if app is not None else None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.binds:
            return  # uvicorn: "error while attempting to bind", and back with started False
        self.started = self.serving = True
        began = loop.time()
        try:
            while not self.should_exit:
                if self.stops_after is not None and loop.time() - began >= self.stops_after:
                    break
                await asyncio.sleep(TICK)
        finally:
            self.serving = False
            self.exited_at = loop.time()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.serving or self._asgi is None:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return await self._asgi.handle_async_request(request)


class TaskRunner:
    """The ``Runner`` seam: the monitor as a task on this loop; what is handed to it reaches
    ``observe`` on the loop's next turn (``LoopThread.hand``: call_soon_threadsafe)."""

    def __init__(self, main: Main, observe: Callable[[Observation], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.main, self.observe = main, observe
        self.task: asyncio.Task[None] | None = None
        self.handed: list[Observation] = []
        self.stopped = False

    def start(self) -> asyncio.Future[None]:
        self.task = self.loop.create_task(self.main(), name="monitor")
        return self.task

    def hand(self, obs: Observation) -> None:
        self.handed.append(obs)
        self.loop.call_soon(self.observe, obs)

    async def stop(self) -> None:
        self.stopped = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class Running:
    sidecar: Sidecar
    health: Health
    http: FakeServer
    runner: TaskRunner
    engine: EngineLink
    client: httpx.AsyncClient  # a client of the HTTP server's port
    serving: asyncio.Task[int]  # sidecar.serve(): the process's exit code

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def status(self, path: str = "/health") -> int:
        return (await self.client.get(path)).status_code

    async def exit_code(self, within: float) -> int:
        """The exit code, once serve() returns within ``within`` virtual seconds."""
        await until(self.serving.done, within, STEP, "the sidecar to exit")
        return self.serving.result()


@contextlib.asynccontextmanager
async def lifecycle(
    env: dict[str, str] | None = None,
    *,
    main: Callable[[Health], Main] | None = None,
    control: FakeServer | None = None,
    grpc: FakeServer | None = None,
    http_binds: bool = True,
) -> AsyncIterator[Running]:
    """The sidecar's lifecycle serving, as ``sidecar.wiring.build`` assembles it, with the fake
    servers and the monitor on this loop (``main``: another monitor, given the state's writer)."""
    blueprint = resolve(settings_of(CANARY_ON | (env or {})))
    loop = asyncio.get_running_loop()
    health = health_for(blueprint, clock=loop.time)
    surface = surface_for(blueprint, health)
    engine = EngineLink("vllm", served=True)

    async def monitor() -> None:
        await monitor_main(blueprint, health, connect=lambda url: engine)

    runner = TaskRunner(monitor if main is None else main(health), health.observe)
    http = FakeServer(surface.app, binds=http_binds)
    sidecar = sidecar_for(blueprint, health, Servers(http, control, grpc), runner)
    serving = asyncio.create_task(sidecar.serve(), name="serve")
    client = httpx.AsyncClient(transport=http, base_url="http://side")
    try:
        yield Running(sidecar, health, http, runner, engine, client, serving)
    finally:
        if not serving.done():
            sidecar.handle_int()
        await asyncio.gather(serving, return_exceptions=True)
        await client.aclose()
        engine.thaw()
        await engine.aclose()


def deliver(sig: signal.Signals) -> None:
    """``sig`` delivered to this process, as ``kill`` delivers it; only once the sidecar has
    taken it (else SIGTERM would end the test run)."""
    taken = signal.getsignal(sig)
    assert taken not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None), (
        f"{sig.name} is not handled: the sidecar did not take it"
    )
    signal.raise_signal(sig)


def criticals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.CRITICAL]


def said(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# --- SIGTERM: drain ------------------------------------------------------------------------------


def test_sigterm_drains_until_the_engine_is_gone_then_exits_zero(caplog):
    """Readiness 503 "draining" at once, liveness 200, still serving while the engine drains;
    the engine gone (its next registration check is refused), the sidecar exits 0."""
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "30"}) as side:
            await until(lambda: side.http.started, 1, STEP, "the HTTP server to serve")
            await until(_status(side, 200), 5, STEP, "ready")
            deliver(signal.SIGTERM)
            termed = side.now()
            await until(_status(side, 503), STEP, STEP, "notready at once")
            body = (await side.client.get("/health")).json()
            assert body["rule"] == "draining"
            assert body["reason"] == "draining: SIGTERM received"
            assert await side.status("/live") == 200
            metrics = (await side.client.get("/metrics")).text
            assert metric(metrics, "health_sidecar_draining") == 1
            # Still serving while the engine drains, however long that takes (up to 30 s).
            await asyncio.sleep(10)
            assert not side.serving.done()
            assert side.http.serving
            assert await side.status() == 503

            side.engine.kill()
            killed = side.now()
            assert await side.exit_code(REGISTRATION + EXIT) == 0
            assert side.http.exited_at is not None
            assert side.http.exited_at - killed <= REGISTRATION + EXIT
            assert side.now() - termed > 10
            with pytest.raises(httpx.ConnectError):  # its port is closed
                await side.client.get("/health")
            assert side.runner.stopped

    run_virtually(main)
    assert "received SIGTERM: draining (readiness 503, liveness 200)" in said(caplog)
    assert "drain: the engine is gone; exiting" in said(caplog)
    assert not criticals(caplog)


def test_sigterm_exits_zero_when_the_drain_timeout_ends_with_the_engine_up(caplog):
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "1"}) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            deliver(signal.SIGTERM)
            termed = side.now()
            await until(lambda: side.http.should_exit, 2, STEP, "the drain to end")
            ended = side.now() - termed
            assert 1.0 <= ended <= 1.0 + DRAIN_POLL + STEP, ended  # the timeout, not before
            assert await side.exit_code(EXIT) == 0
            assert side.engine.down is False  # the engine was up all along

    run_virtually(main)
    assert "drain: 1 s passed with the engine still up; exiting" in said(caplog)
    assert not criticals(caplog)


def test_the_drain_is_handed_to_the_monitor_the_only_writer():
    """The lifecycle does not write the state: it hands DrainAsked to the monitor's runner."""

    async def main() -> None:
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "30"}) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            side.sidecar.handle_term()
            await until(lambda: side.health.snapshot.draining, STEP, STEP, "draining")
            assert [type(o).__name__ for o in side.runner.handed] == ["DrainAsked"]

    run_virtually(main)


def test_a_second_sigterm_exits_now(caplog):
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "30"}) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            deliver(signal.SIGTERM)
            await until(_status(side, 503), STEP, STEP, "draining")
            await asyncio.sleep(2)
            deliver(signal.SIGTERM)
            again = side.now()
            assert await side.exit_code(TICK + STEP) == 0
            assert side.http.exited_at - again <= TICK + STEP
            assert side.engine.down is False

    run_virtually(main)  # and no task outlives it: the drain still waiting was cancelled
    assert "received SIGTERM again: exiting now" in said(caplog)
    assert "drain:" not in said(caplog)  # the drain never ended by itself


# --- SIGINT: now ---------------------------------------------------------------------------------


@pytest.mark.parametrize("draining", [False, True], ids=["serving", "draining"])
def test_sigint_exits_now_draining_or_not(caplog, draining):
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "30"}) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            if draining:
                deliver(signal.SIGTERM)
                await until(_status(side, 503), STEP, STEP, "draining")
            deliver(signal.SIGINT)
            asked = side.now()
            assert await side.exit_code(TICK + STEP) == 0
            assert side.http.exited_at - asked <= TICK + STEP
            assert side.health.snapshot.draining is draining  # SIGINT itself drains nothing

    run_virtually(main)
    assert "received SIGINT: exiting now" in said(caplog)
    assert not criticals(caplog)


def test_signals_are_taken_at_startup_and_given_back_at_shutdown():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert before == {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    during: dict[signal.Signals, Any] = {}

    async def main() -> None:
        async with lifecycle() as side:
            await until(lambda: side.http.started, 1, STEP, "the HTTP server to serve")
            during.update({sig: signal.getsignal(sig) for sig in before})
            side.sidecar.handle_int()
            assert await side.exit_code(TICK + STEP) == 0

    run_virtually(main)
    assert all(handler not in before.values() for handler in during.values()), during
    assert {sig: signal.getsignal(sig) for sig in before} == before


# --- failures: the exit code and one critical line -----------------------------------------------


@pytest.mark.parametrize("how", ["raises", "returns"])
def test_a_monitor_that_stops_exits_one_with_one_critical_line(caplog, how):
    """Rather than serve a frozen verdict: the servers stop, exit 1, the reason said once."""

    def crashing(health: Health) -> Main:
        async def main() -> None:
            await asyncio.sleep(3)
            if how == "raises":
                raise RuntimeError("a bug in the monitor")

        return main

    async def main() -> None:
        async with lifecycle(main=crashing) as side:
            assert await side.exit_code(3 + TICK + STEP) == 1
            assert side.http.should_exit
            assert not side.http.serving

    run_virtually(main)
    (line,) = criticals(caplog)
    assert line.getMessage() == "the monitor stopped unexpectedly"
    if how == "raises":
        assert line.exc_info is not None
        assert str(line.exc_info[1]) == "a bug in the monitor"


def test_a_startup_error_exits_two_with_one_line(caplog):
    """A part that could not start for a reason the configuration names: exit 2, as a
    configuration error, and that reason as one line."""
    reason = "SIDECAR_TRANSPORT=dynamo: Dynamo's runtime client did not start: no etcd"

    def refusing(health: Health) -> Main:
        async def main() -> None:
            raise StartupError(reason)

        return main

    async def main() -> None:
        async with lifecycle(main=refusing) as side:
            assert await side.exit_code(TICK + STEP) == 2

    run_virtually(main)
    (line,) = criticals(caplog)
    assert line.getMessage() == reason
    assert line.exc_info is None  # one line, no traceback


@pytest.mark.parametrize("which", ["http", "control", "grpc"])
def test_a_server_that_cannot_bind_its_port_exits_one(caplog, which):
    """uvicorn (and the gRPC server) say why and return without serving: the sidecar does not
    run on without it."""

    async def main() -> None:
        refused = FakeServer(binds=False)
        servers = {which: refused} if which != "http" else {"http_binds": False}
        async with lifecycle(**servers) as side:  # type: ignore[arg-type]
            assert await side.exit_code(TICK + STEP) == 1
            assert side.runner.task is not None
            assert side.runner.task.cancelled()

    run_virtually(main)
    lines = [r.getMessage() for r in criticals(caplog)]
    if which == "control":  # the one the lifecycle names itself
        assert lines == ["the control server stopped (could it bind SIDECAR_CONTROL_PORT?)"]
    else:
        assert lines == []  # uvicorn and the gRPC server log it themselves


def test_a_control_server_that_stops_by_itself_exits_one(caplog):
    async def main() -> None:
        control = FakeServer(stops_after=5)
        async with lifecycle(control=control) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            assert await side.exit_code(10) == 1
            assert control.exited_at is not None
            assert side.http.exited_at is not None
            assert side.http.exited_at - control.exited_at <= TICK + STEP

    run_virtually(main)
    lines = [r.getMessage() for r in criticals(caplog)]
    assert lines == ["the control server stopped (could it bind SIDECAR_CONTROL_PORT?)"]


def test_the_control_server_stopping_with_the_rest_is_no_failure(caplog):
    async def main() -> None:
        control = FakeServer()
        async with lifecycle({"SIDECAR_DRAIN_TIMEOUT": "1"}, control=control) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            deliver(signal.SIGTERM)
            assert await side.exit_code(1 + EXIT) == 0
            assert control.should_exit
            assert not control.serving

    run_virtually(main)
    assert not criticals(caplog)


# --- a pod restart where an engine restart is not enough -----------------------------------------

POD_RESTART = {"SIDECAR_POD_RESTART_EXIT_CODE": "88", "SIDECAR_LIVENESS_WINDOW": "3"}


def test_not_live_exits_with_the_pod_restart_code_and_says_why(caplog):
    """SIDECAR_POD_RESTART_EXIT_CODE: the engine hangs, the liveness clock runs out, and the
    sidecar stops its servers and exits with the code, within the documented bound of /live
    failing; one critical line says the code and why."""
    bound = policy_of(settings_of(CANARY_ON | POD_RESTART)).to_notlive().seconds

    async def main() -> None:
        async with lifecycle(POD_RESTART) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            await side.engine.fault(hang_generation=True)
            hung = side.now()
            assert await side.exit_code(bound + EXIT) == 88
            assert side.http.exited_at is not None
            assert side.http.exited_at - hung <= bound + EXIT
            assert side.runner.stopped

    run_virtually(main)
    (line,) = criticals(caplog)
    text = line.getMessage()
    assert text.startswith("exiting with 88 (SIDECAR_POD_RESTART_EXIT_CODE) for the kubelet to "
                           "restart the pod: "), text  # fmt: skip
    assert "canary failing hard" in text, text


def test_not_live_while_draining_exits_as_the_drain_does(caplog):
    """A pod being deleted is not restarted: not live during a drain, the drain ends as it
    would (exit 0)."""

    async def main() -> None:
        env = POD_RESTART | {"SIDECAR_DRAIN_TIMEOUT": "10"}
        async with lifecycle(env) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            await side.engine.fault(hang_generation=True)
            deliver(signal.SIGTERM)
            await until(_status(side, 503, "/live"), 8, STEP, "not live")
            assert not side.serving.done()
            assert await side.exit_code(10 + EXIT) == 0

    run_virtually(main)
    assert not criticals(caplog)


def test_without_the_code_not_live_keeps_serving_503():
    async def main() -> None:
        async with lifecycle({"SIDECAR_LIVENESS_WINDOW": "3"}) as side:
            await until(_status(side, 200), 5, STEP, "ready")
            await side.engine.fault(hang_generation=True)
            await until(_status(side, 503, "/live"), 8, STEP, "not live")
            await asyncio.sleep(5)
            assert not side.serving.done()
            assert await side.status("/live") == 503

    run_virtually(main)


# --- a silent monitor ----------------------------------------------------------------------------


def test_a_silent_monitor_is_stale_and_the_sidecars_own_probe_fails(caplog):
    """A monitor stuck (no heartbeat) does not end the process: its verdict turns stale once
    HEARTBEAT_STALE passes, /sidecar/live fails (the kubelet restarts the sidecar), and /live
    stays 200 (the engine may be fine)."""

    def stuck(health: Health) -> Main:
        async def main() -> None:
            await asyncio.Event().wait()

        return main

    async def main() -> None:
        async with lifecycle(main=stuck) as side:
            await until(lambda: side.http.started, 1, STEP, "the HTTP server to serve")
            assert await side.status("/sidecar/live") == 200
            await until(_status(side, 503, "/sidecar/live"), 60, STEP, "stale")
            silent = side.now() - side.health.snapshot.heartbeat  # since it started
            assert HEARTBEAT_STALE <= silent <= HEARTBEAT_STALE + STEP, silent
            body = (await side.client.get("/health")).json()
            assert (await side.status(), body["rule"]) == (503, "stale")
            assert "the monitor has not run for" in body["reason"]
            live = await side.client.get("/live")
            assert live.status_code == 200
            assert live.json()["reason"].startswith("unknown: the monitor has not run")
            assert not side.serving.done()  # still serving: its own probe is the way out

    run_virtually(main)
    assert not criticals(caplog)


def _status(side: Running, code: int, path: str = "/health") -> Callable[[], Any]:
    async def answers() -> bool:
        try:
            return await side.status(path) == code
        except httpx.ConnectError:  # not listening yet
            return False

    return answers
