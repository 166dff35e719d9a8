"""Wiring and lifecycle: build the parts from settings, serve HTTP and run the monitor together.

One asyncio task serves HTTP (uvicorn); the monitor runs on its own event loop in a thread of
its own (so that no load on the probes delays a canary); both are owned by ``Sidecar``, whose
lifecycle reads as uvicorn's: startup, run, shutdown, with drain on the way out. SIGTERM drains
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

from sidecar.config import Settings, Transport
from sidecar.core.observations import DrainAsked, Observation
from sidecar.probes import CanaryPlan, plan_canary, plan_transfer_probe
from sidecar.probes.dynamo.canary import DynamoCanary
from sidecar.probes.http import HttpCanary
from sidecar.probes.kinds import Probe, ProbeKind
from sidecar.probes.transfer import TransferProbe
from sidecar.runtime.engine import EngineClient
from sidecar.runtime.grpcregistration import GrpcRegistration
from sidecar.runtime.health import Health
from sidecar.runtime.monitor import Monitor
from sidecar.runtime.requestplane import environment, runtimelog
from sidecar.runtime.requestplane.client import RequestPlane
from sidecar.runtime.requestplane.worker import DynamoWorker
from sidecar.surface.app import create_app
from sidecar.surface.control import CONTROL_HOST, create_control_app
from sidecar.surface.grpchealth import GrpcHealth
from sidecar.surface.history import History
from sidecar.surface.metrics import Metrics

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
    ranks = settings.ranks
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
        self._monitor: Monitor | None = None

    def _serve_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _engine_client(self, key: str | None) -> EngineClient:
        settings = self.settings
        return EngineClient(
            settings.engine_url,
            timeout=settings.request_timeout,
            max_bytes=settings.max_response_bytes,
            api_key=key,
            clock=self.parts.health.clock,
        )

    def _transfer_probe(self, key: str | None) -> TransferProbe | None:
        """The KV-transfer probe when a peer is configured."""
        settings = self.settings
        if settings.kv_peer_url is None:
            return None
        clock, timeout = self.parts.health.clock, settings.kv_probe_timeout

        def client(url: str) -> EngineClient:
            return EngineClient(
                url,
                timeout=timeout,
                max_bytes=settings.max_response_bytes,
                api_key=key,
                clock=clock,
            )

        return TransferProbe(
            client(settings.kv_peer_url),
            client(settings.engine_url),
            timeout=timeout,
            prompt_tokens=settings.kv_probe_prompt_tokens,
            clock=clock,
        )

    async def _request_plane(self, client: EngineClient) -> RequestPlane:
        """Dynamo's runtime client, started; if it refuses, the engine client is closed and the
        refusal becomes a one-line StartupError."""
        plane = RequestPlane(
            self.settings,
            timeout=self.settings.request_timeout,
            clock=self.parts.health.clock,
            private_dir=self.private_dir,
        )
        try:
            plane.start()
        except Exception as exc:  # the runtime refuses its variables with plain Exceptions
            await client.aclose()
            raise StartupError(
                f"SIDECAR_TRANSPORT=dynamo: Dynamo's runtime client did not start: {exc}"
            ) from None
        return plane

    def _worker(self, client: EngineClient, plane: RequestPlane) -> DynamoWorker:
        settings, parts = self.settings, self.parts
        return DynamoWorker(
            settings,
            client,
            plane,
            health_path=parts.registration_path,
            metrics_path=settings.metrics_path or parts.plan.prober.progress.path,
            clock=parts.health.clock,
        )

    def _new_monitor(
        self, client: EngineClient, probe: TransferProbe | None, worker: DynamoWorker | None
    ) -> Monitor:
        settings, parts = self.settings, self.parts
        return Monitor(
            parts.health,
            client,
            parts.registration_path,
            settings.registration_interval,
            watch_progress=settings.health_check_enabled and settings.progress_enabled,
            metrics_path=settings.metrics_path,
            metrics_interval=settings.metrics_interval,
            discover_ranks=settings.ranks == "auto" and parts.plan.enabled,
            probes=self._probes(client, probe, worker),
            probe_interval=settings.kv_probe_interval,
            worker=worker,
            grpc_registration=self._grpc_registration(),
        )

    def _grpc_registration(self) -> GrpcRegistration | None:
        """SIDECAR_REGISTRATION's check of the engine's gRPC health service, when set."""
        target = self.settings.grpc_registration
        if target is None:
            return None
        return GrpcRegistration(
            target,
            timeout=self.settings.request_timeout,
            interval=self.settings.registration_interval,
            clock=self.parts.health.clock,
        )

    @staticmethod
    def _probes(
        client: EngineClient, transfer: TransferProbe | None, worker: DynamoWorker | None
    ) -> dict[ProbeKind, Probe]:
        """The one map from kind to probe (sidecar.probes.kinds) the monitor sends through."""
        probes: dict[ProbeKind, Probe] = {ProbeKind.HTTP: HttpCanary(client)}
        if worker is not None:
            probes[ProbeKind.DYNAMO] = DynamoCanary(worker)
        if transfer is not None:
            probes[ProbeKind.TRANSFER] = transfer
        return probes

    async def _main(self) -> None:
        """Build the I/O parts, run the monitor until cancelled, then close what it opened (the
        engine client first) and set ``finished``."""
        settings = self.settings
        key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
        client = self._engine_client(key)
        probe = self._transfer_probe(key)
        plane: RequestPlane | None = None
        worker: DynamoWorker | None = None
        if settings.transport is Transport.DYNAMO:
            plane = await self._request_plane(client)
            worker = self._worker(client, plane)
        monitor = self._monitor = self._new_monitor(client, probe, worker)
        try:
            await monitor.run()
        finally:
            for each in monitor.probes.values():  # before the clients they send through
                await each.aclose()
            if monitor.grpc_registration is not None:
                await monitor.grpc_registration.aclose()
            await client.aclose()
            if plane is not None:
                await plane.aclose()
            self.finished.set()

    def start(self) -> asyncio.Future[None]:
        """Start the thread and the monitor; the future ends if the monitor stops."""
        self.thread.start()
        self._future = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        return asyncio.wrap_future(self._future)

    async def submit(self, obs: Observation) -> None:
        """Hand ``obs`` to the monitor's thread (the state's only writer) and wait for its step."""
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._observed(obs), self.loop))

    def hand(self, obs: Observation) -> None:
        """Hand ``obs`` to the monitor's thread; do not wait."""
        self.loop.call_soon_threadsafe(self._observe, obs)

    async def _observed(self, obs: Observation) -> None:
        self._observe(obs)

    def _observe(self, obs: Observation) -> None:
        if self._monitor is not None:
            self._monitor.observe(obs)  # wakes its loop: what is due may have changed
        else:
            self.parts.health.observe(obs)

    async def stop(self) -> None:
        """Cancel the monitor, let it close the engine client, end the thread."""
        if self._future is not None and self._future.cancel():
            await asyncio.to_thread(self.finished.wait, 2.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join, 2.0)
        if not self.thread.is_alive():
            self.loop.close()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ``Sidecar`` owns SIGTERM and SIGINT."""

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


async def _serve_http(server: _Server) -> None:
    with contextlib.suppress(SystemExit):  # uvicorn exits this way when it cannot bind
        await server.serve()


@dataclass(frozen=True)
class _Started:
    """What ``Sidecar.startup`` started and ``Sidecar.run`` watches."""

    monitor: asyncio.Future[None]
    http: asyncio.Task[None]
    control: asyncio.Task[None] | None
    grpc: asyncio.Task[None] | None = None

    def watched(self) -> set[asyncio.Future[None]]:
        tasks: set[asyncio.Future[None]] = {self.monitor, self.http}
        tasks |= {t for t in (self.control, self.grpc) if t is not None}
        return tasks


class Sidecar:
    """The process's lifecycle: startup, run until a signal or a failure, shutdown.

    It owns the HTTP server, the control server and the gRPC health server (each when its port
    is set) and the monitor's thread.
    Signals arrive on this event loop, one method each (``handle_term``, ``handle_int``); they
    only ask the servers to exit or start the drain. The state is written only on the monitor's
    thread; this side reads its snapshots.
    """

    def __init__(self, settings: Settings, private_dir: str | None = None) -> None:
        self.settings = settings
        self.parts = build(settings)
        self.server = _server(self.parts.app, settings.system_host, settings.system_port, grace=5)
        self.monitor = MonitorThread(settings, self.parts, private_dir)
        self.control: _Server | None = None
        if settings.control_port is not None:
            app = create_control_app(settings, self.parts.health, self.monitor.submit)
            self.control = _server(app, CONTROL_HOST, settings.control_port, grace=1)
        # The gRPC health service (SIDECAR_GRPC_PORT) listens where the HTTP server does.
        self.grpc: GrpcHealth | None = None
        if settings.grpc_port is not None:
            self.grpc = GrpcHealth(self.parts.health, settings.system_host, settings.grpc_port)
        self.servers: list[_Server | GrpcHealth] = [
            s for s in (self.server, self.control, self.grpc) if s is not None
        ]
        self.drain_task: asyncio.Task[None] | None = None  # set by the first SIGTERM only

    async def serve(self) -> int:
        """Startup, run, shutdown; the process's exit code."""
        started = self.startup()
        try:
            code = await self.run(started)
        finally:
            await self.shutdown()
        if code == 0 and not all(each.started for each in self.servers):
            return 1  # a server never started: uvicorn could not bind its port
        return code

    def startup(self) -> _Started:
        """Take the signals, say what is served, start the monitor's thread and the servers."""
        loop = asyncio.get_running_loop()
        for sig, handler in self._signal_handlers().items():
            loop.add_signal_handler(sig, handler)
        self.parts.metrics.loops.append(self.monitor.loop)
        self._log_serving()
        monitor = self.monitor.start()
        http = asyncio.create_task(_serve_http(self.server), name="http")
        control = (
            asyncio.create_task(_serve_http(self.control), name="control")
            if self.control is not None
            else None
        )
        grpc = asyncio.create_task(self.grpc.serve(), name="grpc") if self.grpc else None
        return _Started(monitor, http, control, grpc)

    async def run(self, started: _Started) -> int:
        """Wait for the first of the monitor and the servers to end (a signal ends the servers),
        then stop the servers and wait for them; the exit code that ending calls for."""
        done, _ = await asyncio.wait(started.watched(), return_when=asyncio.FIRST_COMPLETED)
        code = self._exit_code(started, done)
        self.stop_servers()
        await started.http
        if started.control is not None:
            await started.control
        if started.grpc is not None:
            await started.grpc
        return code

    def _exit_code(self, started: _Started, done: set[asyncio.Future[None]]) -> int:
        """A monitor that ended: 2 for a configuration error, else 1; a control server that ended
        on its own: 1; anything else: 0. The reason is logged once, as critical."""
        if started.monitor in done:
            failure = started.monitor.exception()
            if isinstance(failure, StartupError):
                log.critical("%s", failure)
                return EXIT_CONFIG
            log.critical("the monitor stopped unexpectedly", exc_info=failure)
            return 1
        if started.control in done and not self.server.should_exit:
            log.critical("the control server stopped (could it bind SIDECAR_CONTROL_PORT?)")
            return 1
        return 0

    async def drain(self) -> None:
        """Readiness 503 at once; keep serving until the engine is gone or the drain timeout
        passes, then stop the servers."""
        # The monitor's thread is the only writer: hand it the request.
        self.monitor.hand(DrainAsked())
        loop = asyncio.get_running_loop()
        timeout = self.settings.drain_timeout
        deadline = loop.time() + timeout
        while not self.parts.health.snapshot.engine_gone:  # the monitor's thread keeps it current
            if loop.time() >= deadline:
                log.info("drain: %g s passed with the engine still up; exiting", timeout)
                break
            await asyncio.sleep(DRAIN_POLL)
        else:
            log.info("drain: the engine is gone; exiting")
        self.stop_servers()

    async def shutdown(self) -> None:
        """Cancel a drain still waiting, stop the monitor (it closes the engine client), give the
        signals back. The servers have already stopped, so the engine client closes last."""
        if self.drain_task is not None:
            self.drain_task.cancel()
            await asyncio.gather(self.drain_task, return_exceptions=True)
        await self.monitor.stop()
        loop = asyncio.get_running_loop()
        for sig in self._signal_handlers():
            loop.remove_signal_handler(sig)

    def stop_servers(self) -> None:
        """Ask every server to exit; ``run`` is waiting for them."""
        for each in self.servers:
            each.should_exit = True

    def _signal_handlers(self) -> dict[signal.Signals, Callable[[], None]]:
        return {signal.SIGTERM: self.handle_term, signal.SIGINT: self.handle_int}

    def handle_term(self) -> None:
        """SIGTERM (the orchestrator): the first drains, a second one exits now."""
        if self.drain_task is not None:
            log.info("received SIGTERM again: exiting now")
            self.stop_servers()
            return
        log.info(
            "received SIGTERM: draining (readiness 503, liveness 200) until the engine is gone, "
            "at most %g s",
            self.settings.drain_timeout,
        )
        self.drain_task = asyncio.get_running_loop().create_task(self.drain(), name="drain")

    def handle_int(self) -> None:
        """SIGINT (a person at a terminal): exit now, draining or not."""
        log.info("received SIGINT: exiting now")
        self.stop_servers()

    def _log_serving(self) -> None:
        settings, plan = self.settings, self.parts.plan
        log.info(
            "health-sidecar serving http://%s:%d (%s, %s): engine %s, canary %s",
            settings.system_host,
            settings.system_port,
            settings.health_path,
            settings.live_path,
            settings.engine_url,
            "on: " + plan.why if plan.enabled else "off: " + plan.why,
        )
        if settings.registration is not None:
            log.info("registration: grpc.health.v1 Check at %s", settings.registration)
        if settings.control_port is not None:
            log.info(
                "control routes on http://%s:%d/maintenance (loopback only, %s)",
                CONTROL_HOST,
                settings.control_port,
                "bearer token required" if settings.control_token else "no token",
            )


async def serve(settings: Settings, private_dir: str | None = None) -> int:
    """Serve until a signal or a failure stops the sidecar; the process's exit code."""
    return await Sidecar(settings, private_dir).serve()


def run(settings: Settings) -> int:
    # Dynamo's runtime reads its variables from the process environment: give it its own before
    # any thread starts (sidecar/runtime/requestplane/environment.py).
    private = None
    if settings.transport is Transport.DYNAMO:
        private = environment.prepare(settings)
        runtimelog.capture()
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(serve(settings, private))
