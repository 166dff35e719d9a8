"""Wiring and lifecycle: build the parts from settings, serve HTTP and run the monitor together.

One asyncio task serves HTTP (uvicorn); the monitor runs on its own event loop in a thread of
its own (so that no load on the probes delays a canary); both are owned here. SIGTERM drains
(readiness 503 until the engine is gone or the drain timeout), SIGINT stops at once; then the
monitor is cancelled; the engine client is closed last.
A monitor that dies of an unexpected error stops the process with exit code 1 rather than
serving a frozen verdict.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from sidecar.app import create_app
from sidecar.canary import CanaryPlan, plan_canary, plan_transfer_probe
from sidecar.config import Settings, Transport
from sidecar.control import CONTROL_HOST, create_control_app
from sidecar.engine import EngineClient
from sidecar.health import Health
from sidecar.history import History
from sidecar.metrics import Metrics
from sidecar.monitor import Monitor
from sidecar.requestplane import environment, runtimelog
from sidecar.requestplane.client import RequestPlane
from sidecar.requestplane.worker import DynamoWorker
from sidecar.transferprobe import TransferProbe

log = logging.getLogger("sidecar")


@dataclass(frozen=True)
class Parts:
    plan: CanaryPlan
    health: Health
    metrics: Metrics
    app: FastAPI
    registration_path: str


def build(settings: Settings) -> Parts:
    plan = plan_canary(settings)
    ranks = settings.dp_ranks
    # A fixed rank count: one plan per rank from the start; auto: one unpinned plan until the
    # engine's metrics tell (the monitor then splits it).
    plans = (
        [plan.for_rank(r) for r in range(ranks)] if isinstance(ranks, int) and ranks > 1 else [plan]
    )
    transfer = plan_transfer_probe(settings)
    if transfer is not None:
        plans.append(transfer)
    health = Health(settings, plans)
    metrics = Metrics(health)
    key = settings.engine_api_key
    history = History(secrets=[key.get_secret_value()] if key else [])
    history.listen(health)
    app = create_app(settings, health, metrics, history)
    registration_path = settings.registration_path or plan.prober.registration_path
    return Parts(plan, health, metrics, app, registration_path)


DRAIN_POLL = 0.05
EXIT_CONFIG = 2  # as the command line's configuration errors


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class StartupError(Exception):
    """A part could not start for a reason the configuration names: exit 2, one line."""


class MonitorThread:
    """The monitor, with the engine client, on an event loop of its own in its own thread: however
    many probes the HTTP server answers, canaries leave on time. It is the only writer of the
    state (``Health`` publishes immutable snapshots); the HTTP routes only read them."""

    def __init__(self, settings: Settings, parts: Parts, private_dir: str | None = None) -> None:
        self.settings = settings
        self.parts = parts
        self.private_dir = private_dir  # the request plane's private discovery (Kubernetes)
        # The standard event loop, not uvloop: a few requests a second need no speed, and against
        # an engine that floods an oversized answer uvloop's eager reads held far more memory.
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve_loop, name="monitor", daemon=True)
        self.finished = threading.Event()
        self._future: concurrent.futures.Future[None] | None = None

    def _serve_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _main(self) -> None:
        settings, parts = self.settings, self.parts
        key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
        client = EngineClient(
            settings.engine_url,
            timeout=settings.request_timeout,
            max_bytes=settings.max_response_bytes,
            api_key=key,
            clock=parts.health.clock,
        )
        probe = None
        if settings.kv_peer_url is not None:
            probe = TransferProbe(
                settings.kv_peer_url,
                settings.engine_url,
                timeout=settings.kv_probe_timeout,
                prompt_tokens=settings.kv_probe_prompt_tokens,
                max_bytes=settings.max_response_bytes,
                api_key=key,
                clock=parts.health.clock,
            )
        plane = worker = None
        if settings.transport is Transport.DYNAMO:
            plane = RequestPlane(
                settings,
                timeout=settings.request_timeout,
                clock=parts.health.clock,
                private_dir=self.private_dir,
            )
            try:
                plane.start()
            except Exception as exc:  # the runtime refuses its variables with plain Exceptions
                await client.aclose()
                raise StartupError(
                    f"SIDECAR_TRANSPORT=dynamo: Dynamo's runtime client did not start: {exc}"
                ) from None
            worker = DynamoWorker(
                settings,
                client,
                plane,
                health_path=parts.registration_path,
                metrics_path=settings.metrics_path or parts.plan.prober.progress.path,
                clock=parts.health.clock,
            )
        monitor = Monitor(
            parts.health,
            client,
            parts.registration_path,
            settings.registration_interval,
            watch_progress=settings.health_check_enabled and settings.progress_enabled,
            metrics_path=settings.metrics_path,
            metrics_interval=settings.metrics_interval,
            discover_ranks=settings.dp_ranks == "auto" and parts.plan.enabled,
            transfer_probe=probe,
            probe_interval=settings.kv_probe_interval,
            worker=worker,
        )
        try:
            await monitor.run()
        finally:
            await client.aclose()
            if plane is not None:
                await plane.aclose()
            if probe is not None:
                await probe.aclose()
            self.finished.set()

    def start(self) -> asyncio.Future[None]:
        """Start the thread and the monitor; the future ends if the monitor stops."""
        self.thread.start()
        self._future = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        return asyncio.wrap_future(self._future)

    async def stop(self) -> None:
        """Cancel the monitor, let it close the engine client, end the thread."""
        if self._future is not None and self._future.cancel():
            await asyncio.to_thread(self.finished.wait, 2.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join, 2.0)
        if not self.thread.is_alive():
            self.loop.close()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this module owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _server(app: FastAPI, host: str, port: int, *, grace: float) -> _Server:
    """uvicorn as the sidecar runs it: its logging, no access log, no lifespan, no banner."""
    return _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=grace,
        )
    )


async def serve(settings: Settings, private_dir: str | None = None) -> int:
    parts = build(settings)
    server = _server(parts.app, settings.system_host, settings.system_port, grace=5)
    loop = asyncio.get_running_loop()
    monitor = MonitorThread(settings, parts, private_dir)

    async def submit(change: Callable[[], None]) -> None:
        """Run ``change`` on the monitor's thread (the state's only writer) and wait for it."""

        async def on_monitor() -> None:
            change()

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_monitor(), monitor.loop))

    control: _Server | None = None
    if settings.control_port is not None:
        app = create_control_app(settings, parts.health, submit)
        control = _server(app, CONTROL_HOST, settings.control_port, grace=1)
    servers = [server] if control is None else [server, control]

    def exit_all() -> None:
        for each in servers:
            each.should_exit = True

    drain_task: asyncio.Task[None] | None = None

    async def drain() -> None:
        """Readiness 503 at once; keep serving until the engine is gone or the grace ends."""
        # The monitor's thread is the only writer: hand it the request.
        monitor.loop.call_soon_threadsafe(parts.health.start_draining)
        deadline = loop.time() + settings.drain_timeout
        while not parts.health.snapshot.engine_gone:  # the monitor's thread keeps it current
            if loop.time() >= deadline:
                log.info(
                    "drain: %g s passed with the engine still up; exiting", settings.drain_timeout
                )
                break
            await asyncio.sleep(DRAIN_POLL)
        else:
            log.info("drain: the engine is gone; exiting")
        exit_all()

    def stop(sig: signal.Signals) -> None:
        nonlocal drain_task
        if sig is signal.SIGINT:  # a person at a terminal: stop now
            log.info("received SIGINT: exiting now")
            exit_all()
        elif drain_task is None:
            log.info(
                "received %s: draining (readiness 503, liveness 200) until the engine is gone, "
                "at most %g s",
                sig.name,
                settings.drain_timeout,
            )
            drain_task = loop.create_task(drain(), name="drain")
        else:
            log.info("received SIGTERM again: exiting now")
            exit_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)

    parts.metrics.loops.append(monitor.loop)
    log.info(
        "health-sidecar serving http://%s:%d (%s, %s): engine %s, canary %s",
        settings.system_host,
        settings.system_port,
        settings.health_path,
        settings.live_path,
        settings.engine_url,
        "on: " + parts.plan.why if parts.plan.enabled else "off: " + parts.plan.why,
    )

    if control is not None:
        log.info(
            "control routes on http://%s:%d/maintenance (loopback only, %s)",
            CONTROL_HOST,
            settings.control_port,
            "bearer token required" if settings.control_token else "no token",
        )

    async def http(each: _Server) -> None:
        with contextlib.suppress(SystemExit):  # uvicorn exits this way when it cannot bind
            await each.serve()

    monitor_task = monitor.start()
    server_task = asyncio.create_task(http(server), name="http")
    control_task = (
        asyncio.create_task(http(control), name="control") if control is not None else None
    )
    code = 0
    try:
        watched = {monitor_task, server_task} | ({control_task} if control_task else set())
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if monitor_task in done:
            failure = monitor_task.exception()
            if isinstance(failure, StartupError):
                log.critical("%s", failure)
                code = EXIT_CONFIG
            else:
                log.critical("the monitor stopped unexpectedly", exc_info=failure)
                code = 1
        elif control_task in done and not server.should_exit:
            log.critical("the control server stopped (could it bind SIDECAR_CONTROL_PORT?)")
            code = 1
        exit_all()
        await server_task
        if control_task is not None:
            await control_task
    finally:
        if drain_task is not None:
            drain_task.cancel()
            await asyncio.gather(drain_task, return_exceptions=True)
        await monitor.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if code == 0 and not all(each.started for each in servers):
        return 1
    return code


def run(settings: Settings) -> int:
    # Dynamo's runtime reads its variables from the process environment: give it its own before
    # any thread starts (sidecar/requestplane/environment.py).
    private = None
    if settings.transport is Transport.DYNAMO:
        private = environment.prepare(settings)
        runtimelog.capture()
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(serve(settings, private))
