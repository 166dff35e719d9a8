"""The composition root: every part of the sidecar built from the settings, in one place, and
each given only the values it needs (never the settings whole).

- :func:`plans_for`: each endpoint's canary plan (``sidecar/probes``);
- :func:`health_for`: the state's single writer, with its first snapshot (``sidecar/core``);
- :func:`build`: the surface (HTTP app, metrics, history, and the control routes and gRPC health
  service when their ports are set), subscribed to Health's events, and the lifecycle that runs
  them beside the monitor (``sidecar/runtime/server.py``);
- :func:`monitor_main`: on the monitor's own event loop, the I/O parts (the engine client, the
  probes, Dynamo's runtime client, the gRPC registration check), each closed by one
  ``AsyncExitStack`` when the monitor stops, in the reverse order of their making;
- :func:`run`: the process: Dynamo's environment first where it is used, then serve.

Only what the configuration uses is imported: grpcio with ``SIDECAR_GRPC_PORT`` or a ``grpc://``
registration, Dynamo's runtime with ``SIDECAR_TRANSPORT=dynamo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from sidecar.config import Settings
from sidecar.core.observations import Observation
from sidecar.core.snapshot import first_snapshot
from sidecar.probes import CanaryPlan, Transport, plan_canary, plan_transfer_probe
from sidecar.probes.dynamo.canary import DynamoCanary
from sidecar.probes.grpc.canary import GrpcCanary
from sidecar.probes.http import HttpCanary
from sidecar.probes.kinds import Probe, ProbeKind
from sidecar.probes.transfer import TransferProbe
from sidecar.probes.units import unit_specs
from sidecar.runtime.engine import CHECK_CONNECTIONS, EngineClient
from sidecar.runtime.health import Health
from sidecar.runtime.leftovers import Leftovers, Offload, in_thread
from sidecar.runtime.monitor import EngineParts, Monitor, Routes
from sidecar.runtime.server import HttpServer, LoopThread, Servers, Sidecar, StartupError
from sidecar.surface.app import create_app
from sidecar.surface.control import CONTROL_HOST, create_control_app
from sidecar.surface.history import History
from sidecar.surface.metrics import Metrics

if TYPE_CHECKING:
    import httpx

    from sidecar.runtime.grpcengine import GrpcEngine
    from sidecar.runtime.grpcregistration import GrpcRegistration
    from sidecar.runtime.requestplane.worker import DynamoWorker

log = logging.getLogger("sidecar")


def plans_for(settings: Settings) -> dict[str, CanaryPlan]:
    """Each endpoint's plan: generate's canary, and kv_transfer's probe with a prefill peer."""
    config = settings.canary_config()
    plan = plan_canary(config)
    plans = {plan.endpoint: plan}
    if settings.kv_peer_url is not None:
        transfer = plan_transfer_probe(config, settings.kv_peer_url, settings.kv_probe_interval)
        plans[transfer.endpoint] = transfer
    return plans


def health_for(
    settings: Settings,
    plans: Mapping[str, CanaryPlan],
    clock: Callable[[], float] = time.monotonic,
) -> Health:
    """The single writer, starting from every unit unchecked: a fixed rank count
    (SIDECAR_DP_RANKS=N) splits the endpoint from the start; auto, once the metrics tell."""
    ranks = settings.ranks if isinstance(settings.ranks, int) else 1
    specs = unit_specs(plans.values(), ranks=ranks, model=settings.model)
    snapshot = first_snapshot(
        specs,
        settings.policy(),
        clock(),
        model=settings.model,
        listed=settings.use_endpoint_health_status,
        starting=settings.starting_health_status,
        min_ready=settings.dp_min_ready_ranks,
    )
    return Health(snapshot, clock)


def registration_path(settings: Settings, plan: CanaryPlan) -> str:
    return settings.registration_path or plan.prober.registration_path


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` where this sidecar runs: the pip of its own Python, from
    the source checkout it was installed from (an editable install) or as a package."""
    root = Path(__file__).resolve().parents[1]
    pip = f"{sys.executable} -m pip install"
    if (root / "pyproject.toml").is_file() and (root / "sidecar").is_dir():
        return f"{pip} -e '{root}[{extra}]'"
    return f"{pip} 'health-sidecar[{extra}]'"


def runtime_missing() -> str | None:
    """Why Dynamo's runtime client is not installed here, or None. Only looked up, not imported:
    importing loads the runtime (and it reads Dynamo's variables); a runtime that is installed
    but cannot load fails, with one line, when the sidecar starts it."""
    try:
        spec = importlib.util.find_spec("dynamo.runtime")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if spec is not None else "No module named 'dynamo.runtime'"


def missing_for(settings: Settings) -> str | None:
    """What the configuration needs that this machine lacks (a package, a mounted directory), as
    one line; None if nothing."""
    storage = settings.ec_storage_path
    if storage is not None and not Path(storage).is_dir():
        return f"SIDECAR_EC_STORAGE_PATH={storage}: expected a directory here (it is not one)"
    if settings.transport is Transport.GRPC:
        return _stubs_missing()
    if settings.transport is not Transport.DYNAMO:
        return None
    why = runtime_missing()
    if why is None:
        return None
    return (
        f"SIDECAR_TRANSPORT=dynamo: expected Dynamo's runtime client installed "
        f"({install_hint('dynamo')}): {why}"
    )


def _stubs_missing() -> str | None:
    """Why the engines' gRPC stubs (smg-grpc-proto) are not installed here, or None."""
    try:
        spec = importlib.util.find_spec("smg_grpc_proto")
    except ImportError as exc:
        spec, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "No module named 'smg_grpc_proto'"
    if spec is not None:
        return None
    return (
        f"SIDECAR_TRANSPORT=grpc: expected the engines' gRPC stubs installed "
        f"({install_hint('grpc')}): {why}"
    )


# How the engine clients reach a URL: httpx's own transport (None), or, in tests, an in-process
# one (the fake engine's ASGI app).
Connect = Callable[[str], "httpx.AsyncBaseTransport | None"]


async def monitor_main(
    settings: Settings,
    health: Health,
    plans: Mapping[str, CanaryPlan],
    private_dir: str | None = None,
    connect: Connect | None = None,
    started: Callable[[Monitor], None] | None = None,
    offload: Offload = in_thread,
) -> None:
    """Build the monitor's I/O parts on its own loop, run it until cancelled, then close them
    (each pushed on the stack as it is made: closed in the reverse order, the probes before the
    clients they send through). ``started`` is told the monitor before it runs; ``offload`` runs
    the file system's blocking calls (a thread; in tests, inline)."""
    plan = plans[next(iter(plans))]
    clients = _Clients(settings, health.clock, connect)
    async with contextlib.AsyncExitStack() as stack:
        engine = clients.make(stack, _http_url(settings), settings.request_timeout)
        worker = None
        if settings.transport is Transport.DYNAMO:
            worker = await _dynamo_worker(settings, engine, plan, stack, health.clock, private_dir)
        grpc_engine = _grpc_engine(settings, plan, stack, health.clock)
        probes = _probes(settings, clients, stack, worker, health.clock, offload, grpc_engine)
        registration = _grpc_registration(settings, stack, health.clock)
        if registration is None and grpc_engine is not None:
            from sidecar.runtime.grpcengine import RpcRegistration

            registration = RpcRegistration(
                grpc_engine, plan.prober.registration_path, timeout=settings.request_timeout
            )
        metrics = bool(plan.prober.progress.every())
        monitor = Monitor(
            health,
            EngineParts(engine, probes, worker, registration),
            plans,
            settings.timing(plan.enabled, metrics=metrics),
            Routes(
                registration_path(settings, plan),
                settings.metrics_path,
                any_status=plan.prober.registered_by_any_answer
                and settings.registration_path is None,
            ),
        )
        if started is not None:
            started(monitor)
        await monitor.run()


class _Clients:
    """Engine clients as the settings make them, each closed by the stack it is pushed on."""

    def __init__(
        self, settings: Settings, clock: Callable[[], float], connect: Connect | None
    ) -> None:
        self.settings, self.clock, self.connect = settings, clock, connect
        key = settings.engine_api_key
        self.key = key.get_secret_value() if key else None

    def make(
        self,
        stack: contextlib.AsyncExitStack,
        url: str,
        timeout: float,
        connections: int | None = CHECK_CONNECTIONS,
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
        stack.push_async_callback(client.aclose)
        return client


def _http_url(settings: Settings) -> str:
    """Where the engine client reads the engine's HTTP routes: SIDECAR_ENGINE_URL, or over gRPC
    SIDECAR_METRICS_URL (unset: no route is read, and the client is never used)."""
    if settings.transport is not Transport.GRPC:
        return settings.engine_url
    target = settings.grpc_engine
    assert target is not None
    return settings.metrics_url or f"http://{target.address}"


def _grpc_engine(
    settings: Settings,
    plan: CanaryPlan,
    stack: contextlib.AsyncExitStack,
    clock: Callable[[], float],
) -> GrpcEngine | None:
    """The engine's gRPC server (SIDECAR_TRANSPORT=grpc; grpcio and the stubs imported only
    then)."""
    target = settings.grpc_engine
    if target is None:
        return None
    from sidecar.runtime.grpcengine import GrpcEngine

    module = getattr(plan.prober, "grpc_module", None)
    assert isinstance(module, str), plan.prober
    engine = GrpcEngine(target, (module,), interval=settings.registration_interval, clock=clock)
    stack.push_async_callback(engine.aclose)
    if plan.override is not None:  # the user's payload must be a request of the method
        try:
            engine.message(plan.request(None, "canary-check"))
        except ValueError as exc:
            raise StartupError(
                f"DYN_HEALTH_CHECK_PAYLOAD: expected a request of {plan.path} (the proto's field "
                f"names): {' '.join(str(exc).split())}"
            ) from None
    return engine


def _probes(
    settings: Settings,
    clients: _Clients,
    stack: contextlib.AsyncExitStack,
    worker: DynamoWorker | None,
    clock: Callable[[], float],
    offload: Offload = in_thread,
    grpc_engine: GrpcEngine | None = None,
) -> dict[ProbeKind, Probe]:
    """One probe per kind the configuration uses (sidecar.probes.kinds)."""
    timeout = settings.request_timeout
    # The canaries' own client, apart from the one that reads the engine's routes: hung canaries
    # (one per unit, however many ranks) never make a registration check or a read wait.
    canaries = clients.make(stack, settings.engine_url, timeout, connections=None)
    sweeper = None
    if settings.ec_storage_path is not None:
        sweeper = Leftovers(Path(settings.ec_storage_path), clock=clock, offload=offload)
        stack.push_async_callback(sweeper.aclose)  # after the probes: their last leftovers too
    probes: dict[ProbeKind, Probe] = {
        ProbeKind.HTTP: HttpCanary(canaries, timeout=timeout, clock=clock, sweeper=sweeper)
    }
    if worker is not None:
        probes[ProbeKind.DYNAMO] = DynamoCanary(
            worker, timeout=timeout, clock=clock, sweeper=sweeper
        )
    if grpc_engine is not None:
        probes[ProbeKind.GRPC] = GrpcCanary(
            grpc_engine, timeout=timeout, clock=clock, sweeper=sweeper
        )
    if settings.kv_peer_url is not None:
        kv_timeout = settings.kv_probe_timeout
        probes[ProbeKind.TRANSFER] = TransferProbe(
            clients.make(stack, settings.kv_peer_url, kv_timeout),
            clients.make(stack, settings.engine_url, kv_timeout),
            timeout=kv_timeout,
            prompt_tokens=settings.kv_probe_prompt_tokens,
            clock=clock,
        )
    for probe in probes.values():
        stack.push_async_callback(probe.aclose)
    return probes


def _grpc_registration(
    settings: Settings, stack: contextlib.AsyncExitStack, clock: Callable[[], float]
) -> GrpcRegistration | None:
    """SIDECAR_REGISTRATION's check of the engine's gRPC health service, when set (grpcio is
    imported only then)."""
    target = settings.grpc_registration
    if target is None:
        return None
    from sidecar.runtime.grpcregistration import GrpcRegistration

    check = GrpcRegistration(
        target,
        timeout=settings.request_timeout,
        interval=settings.registration_interval,
        clock=clock,
    )
    stack.push_async_callback(check.aclose)
    return check


async def _dynamo_worker(
    settings: Settings,
    engine: EngineClient,
    plan: CanaryPlan,
    stack: contextlib.AsyncExitStack,
    clock: Callable[[], float],
    private_dir: str | None,
) -> DynamoWorker:
    """Dynamo's runtime client, started (a refusal is a one-line StartupError), and this pod's
    worker found through it."""
    from sidecar.runtime.requestplane.client import RequestPlane
    from sidecar.runtime.requestplane.worker import DynamoWorker

    plane = RequestPlane(
        settings.plane_config(),
        timeout=settings.request_timeout,
        clock=clock,
        private_dir=private_dir,
    )
    try:
        plane.start()
    except Exception as exc:  # the runtime refuses its variables with plain Exceptions
        raise StartupError(
            f"SIDECAR_TRANSPORT=dynamo: Dynamo's runtime client did not start: {exc}"
        ) from None
    stack.push_async_callback(plane.aclose)
    return DynamoWorker(
        settings.dynamo_endpoint,
        engine,
        plane,
        health_path=registration_path(settings, plan),
        metrics_path=settings.metrics_path or plan.prober.progress.path,
        clock=clock,
    )


@dataclass(frozen=True)
class Surface:
    """What the HTTP server serves: the app, and the metrics and history behind it."""

    app: FastAPI
    metrics: Metrics
    history: History


def surface_for(settings: Settings, health: Health) -> Surface:
    """The HTTP surface, its metrics and history subscribed to Health's events."""
    about = settings.about()
    metrics = Metrics(health, about)
    key = settings.engine_api_key
    history = History(secrets=[key.get_secret_value()] if key else [])
    health.subscribe(metrics.on_event)
    health.subscribe(history.on_event)
    return Surface(create_app(about, health, metrics, history), metrics, history)


def build(
    settings: Settings, private_dir: str | None = None, connect: Connect | None = None
) -> Sidecar:
    """Every part, wired: the surface subscribed to Health, the lifecycle that runs it all.
    ``connect``: how the engine clients reach a URL (None: over the network)."""
    plans = plans_for(settings)
    health = health_for(settings, plans)
    surface = surface_for(settings, health)

    running: list[Monitor] = []

    async def main() -> None:
        await monitor_main(settings, health, plans, private_dir, connect, running.append)

    def observe(obs: Observation) -> None:
        """What is handed in from outside (SIGTERM's drain, a declared window) goes to the monitor,
        which wakes: what is due may have changed. Before it runs, straight to the step."""
        (running[0].observe if running else health.observe)(obs)

    runner = LoopThread(main, observe)
    surface.metrics.loops.append(runner.loop)
    host, port = settings.system_host, settings.system_port
    http = HttpServer(surface.app, host, port, grace=5)
    control = None
    if settings.control_port is not None:
        app = create_control_app(settings.control(), health, runner.submit)
        control = HttpServer(app, CONTROL_HOST, settings.control_port, grace=1)
    grpc = None
    if settings.grpc_port is not None:
        from sidecar.surface.grpchealth import GrpcHealth

        grpc = GrpcHealth(health, host, settings.grpc_port)
        health.subscribe(grpc.on_event)
    return Sidecar(
        Servers(http, control, grpc),
        runner,
        drain_timeout=settings.drain_timeout,
        gone=lambda: health.snapshot.engine_gone,
    )


def _log_serving(settings: Settings, plan: CanaryPlan) -> None:
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
    sidecar = build(settings, private_dir)
    _log_serving(settings, plan_canary(settings.canary_config()))
    return await sidecar.serve()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(settings: Settings) -> int:
    """The process: Dynamo's runtime reads its variables from the process environment, so it
    gets its own before any thread starts (sidecar/runtime/requestplane/environment.py); then
    serve. What the configuration needs is installed: the command line checked
    (:func:`missing_for`)."""
    private = None
    if settings.transport is Transport.DYNAMO:
        from sidecar.runtime.requestplane import environment, runtimelog

        private = environment.prepare(settings.plane_config())
        runtimelog.capture()
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(serve(settings, private))
