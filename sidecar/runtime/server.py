"""The process's lifecycle, as uvicorn's reads: startup, run, shutdown, with drain on the way out.

The parts come built (:mod:`sidecar.wiring`, the composition root): the servers (HTTP, and the
control and gRPC health servers when their ports are set), each ``serve()`` until told
``should_exit``, and the monitor on an event loop of its own in a thread of its own
(:class:`LoopThread`, so that no load on the probes delays a canary). SIGTERM drains (readiness
503 until the engine is gone or the drain timeout), SIGINT stops at once; then the monitor is
cancelled and closes what it opened. A monitor that dies of an unexpected error stops the
process with exit code 1 rather than serving a frozen verdict; one that could not start for a
reason the configuration names, with 2. With ``SIDECAR_POD_RESTART_EXIT_CODE``, the worker's
liveness running out stops it with that code, for the kubelet to restart the whole pod.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn

from sidecar.core.observations import DrainAsked, Observation
from sidecar.runtime.exits import EXIT_CONFIG, EXIT_FAILURE

log = logging.getLogger("sidecar")

DRAIN_POLL = 0.05


class StartupError(Exception):
    """A part could not start for a reason the configuration names: exit 2, one line."""


class Server(Protocol):
    """A server the lifecycle runs: ``serve`` until ``should_exit``; ``started`` once it
    listens (uvicorn's ``Server`` is one)."""

    started: bool
    should_exit: bool

    async def serve(self) -> None: ...


class Runner(Protocol):
    """Where the monitor runs, and how observations from outside reach it."""

    loop: asyncio.AbstractEventLoop

    def start(self) -> asyncio.Future[None]: ...

    def hand(self, obs: Observation) -> None: ...

    async def stop(self) -> None: ...


class LoopThread:
    """Run one coroutine on an event loop of its own, in a thread of its own: however many probes
    the HTTP server answers, canaries leave on time. ``observe`` is called on that loop with what
    is handed in from other threads (SIGTERM's drain, the control routes' windows)."""

    def __init__(
        self,
        main: Callable[[], Coroutine[Any, Any, None]],
        observe: Callable[[Observation], None],
        name: str = "monitor",
    ) -> None:
        self.main = main
        self.observe = observe
        # The standard event loop, not uvloop: a few requests a second need no speed, and against
        # an engine that floods an oversized answer uvloop's eager reads held far more memory.
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve_loop, name=name, daemon=True)
        self.finished = threading.Event()
        self._future: concurrent.futures.Future[None] | None = None

    def _serve_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _run(self) -> None:
        try:
            await self.main()
        finally:
            self.finished.set()

    def start(self) -> asyncio.Future[None]:
        """Start the thread and the coroutine; the future ends when the coroutine does."""
        self.thread.start()
        self._future = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        return asyncio.wrap_future(self._future)

    async def submit(self, obs: Observation) -> None:
        """Hand ``obs`` to the loop's thread (the state's only writer) and wait for its step."""
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._observed(obs), self.loop))

    def hand(self, obs: Observation) -> None:
        """Hand ``obs`` to the loop's thread; do not wait."""
        self.loop.call_soon_threadsafe(self.observe, obs)

    async def _observed(self, obs: Observation) -> None:
        self.observe(obs)

    async def stop(self) -> None:
        """Cancel the coroutine, let it close what it opened, end the thread."""
        if self._future is not None and self._future.cancel():
            await asyncio.to_thread(self.finished.wait, 2.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join, 2.0)
        if not self.thread.is_alive():
            self.loop.close()


class HttpServer(uvicorn.Server):
    """uvicorn as the sidecar runs it: its logging, no access log, no lifespan, no banner, and no
    signal handling of its own (``Sidecar`` owns SIGTERM and SIGINT)."""

    def __init__(self, app: Any, host: str, port: int, *, grace: float) -> None:
        super().__init__(
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

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve(self, sockets: Any = None) -> None:
        with contextlib.suppress(SystemExit):  # uvicorn exits this way when it cannot bind
            await super().serve(sockets)


@dataclass(frozen=True)
class Servers:
    """The servers the lifecycle runs: the HTTP server always; the control server and the gRPC
    health server when their ports are set."""

    http: Server
    control: Server | None = None
    grpc: Server | None = None

    def all(self) -> list[Server]:
        return [s for s in (self.http, self.control, self.grpc) if s is not None]


class Sidecar:
    """The process's lifecycle: startup, run until a signal or a failure, shutdown.

    Signals arrive on this event loop, one method each (``handle_term``, ``handle_int``); they
    only ask the servers to exit or start the drain. The state is written only on the monitor's
    loop; this side reads ``gone`` (the engine is gone, from the newest snapshot)."""

    def __init__(
        self,
        servers: Servers,
        monitor: Runner,
        *,
        drain_timeout: float,
        gone: Callable[[], bool],
        pod_restart_code: int | None = None,
    ) -> None:
        self.servers = servers
        self.monitor = monitor
        self.drain_timeout = drain_timeout
        self.gone = gone
        self.pod_restart_code = pod_restart_code
        self.drain_task: asyncio.Task[None] | None = None  # set by the first SIGTERM only
        self._tasks: dict[str, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pod_restart: str | None = None  # why the pod is to restart, once asked

    async def serve(self) -> int:
        """Startup, run, shutdown; the process's exit code."""
        self.startup()
        try:
            code = await self.run()
        finally:
            await self.shutdown()
        if code == 0 and not all(each.started for each in self.servers.all()):
            return 1  # a server never started: it could not bind its port
        return code

    def startup(self) -> None:
        """Take the signals, start the monitor's loop and the servers."""
        loop = self._loop = asyncio.get_running_loop()
        for sig, handler in self._signal_handlers().items():
            loop.add_signal_handler(sig, handler)
        self._tasks["monitor"] = self.monitor.start()
        for name in ("http", "control", "grpc"):
            server = getattr(self.servers, name)
            if server is not None:
                self._tasks[name] = asyncio.create_task(server.serve(), name=name)

    async def run(self) -> int:
        """Wait for the first of the monitor and the servers to end (a signal ends the servers),
        then stop the servers and wait for them; the exit code that ending calls for."""
        done, _ = await asyncio.wait(self._tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        code = self._exit_code(done)
        self.stop_servers()
        await asyncio.gather(*(t for n, t in self._tasks.items() if n != "monitor"))
        return code

    def _exit_code(self, done: set[asyncio.Future[None]]) -> int:
        """A monitor that ended: 2 for a configuration error, else 1; a control server that ended
        on its own: 1; anything else: 0. The reason is logged once, as critical."""
        monitor = self._tasks["monitor"]
        if monitor in done:
            failure = monitor.exception()
            if isinstance(failure, StartupError):
                log.critical("%s", failure)
                return EXIT_CONFIG
            log.critical("the monitor stopped unexpectedly", exc_info=failure)
            return EXIT_FAILURE
        if self._tasks.get("control") in done and not self.servers.http.should_exit:
            log.critical("the control server stopped (could it bind SIDECAR_CONTROL_PORT?)")
            return EXIT_FAILURE
        if self._pod_restart is not None and self.pod_restart_code is not None:
            log.critical(
                "exiting with %d (SIDECAR_POD_RESTART_EXIT_CODE) for the kubelet to restart the "
                "pod: %s",
                self.pod_restart_code,
                self._pod_restart,
            )
            return self.pod_restart_code
        return 0

    def restart_pod(self, reason: str) -> None:
        """The worker is no longer live: with SIDECAR_POD_RESTART_EXIT_CODE, stop the servers and
        exit with it (not while draining: the pod is going away). Called from the monitor's
        thread; the servers are told on this loop."""
        loop = self._loop
        if self.pod_restart_code is None or loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._restart_pod, reason)

    def _restart_pod(self, reason: str) -> None:
        if self._pod_restart is not None or self.drain_task is not None:
            return
        self._pod_restart = reason
        self.stop_servers()

    async def drain(self) -> None:
        """Readiness 503 at once; keep serving until the engine is gone or the drain timeout
        passes, then stop the servers."""
        # The monitor's thread is the only writer: hand it the request.
        self.monitor.hand(DrainAsked())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while not self.gone():  # the monitor's thread keeps the snapshot current
            if loop.time() >= deadline:
                log.info("drain: %g s passed with the engine still up; exiting", self.drain_timeout)
                break
            await asyncio.sleep(DRAIN_POLL)
        else:
            log.info("drain: the engine is gone; exiting")
        self.stop_servers()

    async def shutdown(self) -> None:
        """Cancel a drain still waiting, stop the monitor (it closes what it opened), give the
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
        for each in self.servers.all():
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
            self.drain_timeout,
        )
        self.drain_task = asyncio.get_running_loop().create_task(self.drain(), name="drain")

    def handle_int(self) -> None:
        """SIGINT (a person at a terminal): exit now, draining or not."""
        log.info("received SIGINT: exiting now")
        self.stop_servers()
