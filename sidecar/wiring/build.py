"""Every part of the sidecar built from its blueprint, in one place, and each given only the
values it needs (never the settings whole):

- :func:`health_for`: the state's single writer, with its first snapshot (``sidecar/core``);
- :func:`build`: the surface (HTTP app, metrics, history, and the control routes and gRPC health
  service when their ports are set), subscribed to Health's events, and the lifecycle that runs
  them beside the monitor (``sidecar/runtime/server.py``);
- :func:`monitor_main`: on the monitor's own event loop, the I/O parts (the engine's HTTP routes
  client, the transport's probe and registration check, the transfer probe), each closed by one
  ``AsyncExitStack`` when the monitor stops, in the reverse order of their making;
- :func:`run`: the process: what the transport must do before any thread starts, then serve.

Only what the configuration uses is imported: grpcio with ``SIDECAR_GRPC_PORT`` or a gRPC
transport or registration, Dynamo's runtime with ``SIDECAR_TRANSPORT=dynamo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from sidecar.core.events import Event, Kind
from sidecar.core.observations import Observation
from sidecar.core.snapshot import first_snapshot
from sidecar.probes.base import TRANSFER
from sidecar.probes.kinds import Probe
from sidecar.probes.transfer import TransferProbe
from sidecar.probes.units import unit_specs
from sidecar.runtime.engine import CHECK_CONNECTIONS, EngineClient
from sidecar.runtime.health import Health
from sidecar.runtime.leftovers import Leftovers, Offload, in_thread
from sidecar.runtime.monitor import EngineParts, Monitor
from sidecar.runtime.server import HttpServer, LoopThread, Runner, Servers, Sidecar
from sidecar.surface.app import create_app
from sidecar.surface.control import CONTROL_HOST, create_control_app
from sidecar.surface.history import History
from sidecar.surface.metrics import Metrics
from sidecar.transports.seam import Opening
from sidecar.wiring.resolve import Blueprint

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("sidecar")


def health_for(blueprint: Blueprint, clock: Callable[[], float] = time.monotonic) -> Health:
    """The single writer, starting from every unit unchecked: a fixed rank count
    (SIDECAR_DP_RANKS=N) splits the endpoint from the start; auto, once the metrics tell."""
    s = blueprint.settings
    ranks = blueprint.ranks if isinstance(blueprint.ranks, int) else 1
    specs = unit_specs(blueprint.plans.values(), ranks=ranks, model=s.model)
    snapshot = first_snapshot(
        specs,
        blueprint.policy,
        clock(),
        model=s.model,
        listed=s.use_endpoint_health_status,
        starting=s.starting_health_status,
        min_ready=s.dp_min_ready_ranks,
    )
    return Health(snapshot, clock)


# How the engine clients reach a URL: httpx's own transport (None), or, in tests, an in-process
# one (the fake engine's ASGI app).
Connect = Callable[[str], "httpx.AsyncBaseTransport | None"]


class _Clients:
    """Engine clients as the settings make them, each closed by the stack it is pushed on."""

    def __init__(
        self,
        blueprint: Blueprint,
        stack: contextlib.AsyncExitStack,
        clock: Callable[[], float],
        connect: Connect | None,
    ) -> None:
        self.settings, self.stack, self.clock, self.connect = (
            blueprint.settings,
            stack,
            clock,
            connect,
        )
        key = self.settings.engine_api_key
        self.key = key.get_secret_value() if key else None

    def make(
        self, url: str, timeout: float, connections: int | None = CHECK_CONNECTIONS
    ) -> EngineClient:
        client = EngineClient(
            url,
            timeout=timeout,
            max_bytes=self.settings.max_response_bytes,
            api_key=self.key,
            clock=self.clock,
            transport=self.connect(url) if self.connect is not None else None,
            connections=connections,
        )
        self.stack.push_async_callback(client.aclose)
        return client

    def canaries(self, url: str) -> EngineClient:
        """The canaries' own client, apart from the one that reads the engine's routes: hung
        canaries (one per unit, however many ranks) never make a registration check or a read
        wait."""
        return self.make(url, self.settings.request_timeout, connections=None)


async def monitor_main(
    blueprint: Blueprint,
    health: Health,
    private_dir: str | None = None,
    connect: Connect | None = None,
    started: Callable[[Monitor], None] | None = None,
    offload: Offload = in_thread,
) -> None:
    """Build the monitor's I/O parts on its own loop, run it until cancelled, then close them
    (each pushed on the stack as it is made: closed in the reverse order, the probes before the
    clients they send through). ``started`` is told the monitor before it runs; ``offload`` runs
    the file system's blocking calls (a thread; in tests, inline)."""
    s, route, plan = blueprint.settings, blueprint.route, blueprint.plan
    async with contextlib.AsyncExitStack() as stack:
        clients = _Clients(blueprint, stack, health.clock, connect)
        routes = None
        if route.http_url is not None:
            routes = clients.make(route.http_url, s.request_timeout)
        sweeper = None
        if s.ec_storage_path is not None:
            sweeper = Leftovers(Path(s.ec_storage_path), clock=health.clock, offload=offload)
            stack.push_async_callback(sweeper.aclose)  # after the probes: their last leftovers too
        opened = await blueprint.transport.open(
            Opening(
                s, plan, route, stack, health.clock, routes, clients.canaries, sweeper, private_dir
            )
        )
        probes: dict[str, Probe] = {blueprint.transport.name: opened.probe}
        if s.kv_peer_url is not None:
            kv_timeout = s.kv_probe_timeout
            probes[TRANSFER] = TransferProbe(
                clients.make(s.kv_peer_url, kv_timeout),
                clients.make(s.engine_url, kv_timeout),
                timeout=kv_timeout,
                prompt_tokens=s.kv_probe_prompt_tokens,
                clock=health.clock,
            )
        for probe in probes.values():
            stack.push_async_callback(probe.aclose)
        stack.push_async_callback(opened.registration.aclose)
        monitor = Monitor(
            health,
            EngineParts(routes, probes, opened.registration, opened.metrics or routes),
            blueprint.plans,
            blueprint.timing,
        )
        if started is not None:
            started(monitor)
        await monitor.run()


@dataclass(frozen=True)
class Surface:
    """What the HTTP server serves: the app, and the metrics and history behind it."""

    app: FastAPI
    metrics: Metrics
    history: History


def surface_for(blueprint: Blueprint, health: Health) -> Surface:
    """The HTTP surface, its metrics and history subscribed to Health's events."""
    about = blueprint.about
    metrics = Metrics(health, about)
    key = blueprint.settings.engine_api_key
    history = History(secrets=[key.get_secret_value()] if key else [])
    health.subscribe(metrics.on_event)
    health.subscribe(history.on_event)
    return Surface(create_app(about, health, metrics, history), metrics, history)


def build(
    blueprint: Blueprint, private_dir: str | None = None, connect: Connect | None = None
) -> Sidecar:
    """Every part, wired: the surface subscribed to Health, the lifecycle that runs it all.
    ``connect``: how the engine clients reach a URL (None: over the network)."""
    s = blueprint.settings
    health = health_for(blueprint)
    surface = surface_for(blueprint, health)

    running: list[Monitor] = []

    async def main() -> None:
        await monitor_main(blueprint, health, private_dir, connect, running.append)

    def observe(obs: Observation) -> None:
        """What is handed in from outside (SIGTERM's drain, a declared window) goes to the monitor,
        which wakes: what is due may have changed. Before it runs, straight to the step."""
        (running[0].observe if running else health.observe)(obs)

    runner = LoopThread(main, observe)
    surface.metrics.loops.append(runner.loop)
    host, port = s.system_host, s.system_port
    http = HttpServer(surface.app, host, port, grace=5)
    control = None
    if s.control_port is not None:
        app = create_control_app(blueprint.control, health, runner.submit)
        control = HttpServer(app, CONTROL_HOST, s.control_port, grace=1)
    grpc = None
    if s.grpc_port is not None:
        from sidecar.surface.grpchealth import GrpcHealth

        grpc = GrpcHealth(health, host, s.grpc_port)
        health.subscribe(grpc.on_event)
    return sidecar_for(blueprint, health, Servers(http, control, grpc), runner)


def sidecar_for(blueprint: Blueprint, health: Health, servers: Servers, runner: Runner) -> Sidecar:
    """The lifecycle over built servers and the monitor's runner; with
    SIDECAR_POD_RESTART_EXIT_CODE, told when the worker stops being live."""
    s = blueprint.settings
    sidecar = Sidecar(
        servers,
        runner,
        drain_timeout=s.drain_timeout,
        gone=lambda: health.snapshot.engine_gone,
        pod_restart_code=s.pod_restart_exit_code,
    )
    if s.pod_restart_exit_code is not None:

        def not_live(event: Event) -> None:
            if event.kind is Kind.LIVENESS and event.liveness and not event.liveness.live:
                sidecar.restart_pod(event.liveness.reason)

        health.subscribe(not_live)
    return sidecar


def log_serving(blueprint: Blueprint) -> None:
    s, plan = blueprint.settings, blueprint.plan
    log.info(
        "health-sidecar serving http://%s:%d (%s, %s): engine %s, canary %s",
        s.system_host,
        s.system_port,
        s.health_path,
        s.live_path,
        blueprint.about.engine_url,
        "on: " + plan.why if plan.enabled else "off: " + plan.why,
    )
    log.info(
        "registration: %s, registered while it answers %s",
        blueprint.route.checking.asked,
        blueprint.route.checking.answers,
    )
    if s.control_port is not None:
        log.info(
            "control routes on http://%s:%d/maintenance (loopback only, %s)",
            CONTROL_HOST,
            s.control_port,
            "bearer token required" if s.control_token else "no token",
        )


async def serve(blueprint: Blueprint, private_dir: str | None = None) -> int:
    """Serve until a signal or a failure stops the sidecar; the process's exit code."""
    sidecar = build(blueprint, private_dir)
    log_serving(blueprint)
    return await sidecar.serve()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(blueprint: Blueprint) -> int:
    """The process: what the transport must do in the main thread before any other starts
    (Dynamo's runtime reads its variables from the process environment), then serve. What the
    configuration needs is installed: the command line checked (``Blueprint.missing``)."""
    private = blueprint.transport.prepare(blueprint.settings)
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(serve(blueprint, private))
