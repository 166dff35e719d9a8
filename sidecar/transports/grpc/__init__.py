"""The gRPC transport (SIDECAR_TRANSPORT=grpc, SIDECAR_ENGINE_URL=grpc://HOST:PORT): canaries over
the engines' gRPC generation services, the ones SGLang Model Gateway routes to, on the engines'
own stubs (the grpc extra: smg-grpc-proto). One prober per service (``vllm.py``, ``sglang.py``,
``trtllm.py``, on ``base.py``), called through ``sidecar/runtime/grpcchannel.py``, whose deadline
ends the call on
the server; on a timeout the probe also sends the engine's ``Abort`` with the canary's request id,
as SGLang Model Gateway does when its client drops a stream. Registration is the server's own
grpc.health.v1 where it serves one, else its ``GetModelInfo``.

Where is TensorRT-LLM's decode canary built over gRPC? ``trtllm.py``, method ``body``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import ClassVar

from sidecar.config import Rule, Settings, env_name
from sidecar.core.vocabulary import Cause, Role
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryPlan, Reads
from sidecar.probes.canary import Canary as CanaryProbe
from sidecar.runtime.grpctarget import GrpcTarget, grpc_target
from sidecar.transports.grpc.base import GrpcProber
from sidecar.transports.grpc.sglang import GrpcSglangNativeProber, GrpcSglangProber, colon_escaped
from sidecar.transports.grpc.trtllm import GrpcTrtllmProber
from sidecar.transports.grpc.vllm import GrpcVllmProber
from sidecar.transports.seam import Checking, Opened, Opening, Route, Said, Transport, shown_body

#: Each backend's gRPC generation services, the default first (SIDECAR_GRPC_SERVICE).
SERVICES: dict[str, tuple[type[GrpcProber], ...]] = {
    "vllm": (GrpcVllmProber,),
    "sglang": (GrpcSglangProber, GrpcSglangNativeProber),
    "trtllm": (GrpcTrtllmProber,),
}
_T = "SIDECAR_TRANSPORT=grpc"


def service_names(backend: str) -> tuple[str, ...]:
    return tuple(p.service for p in SERVICES.get(backend, ()))


def prober_class(s: Settings) -> type[GrpcProber]:
    """The prober of SIDECAR_GRPC_SERVICE (unset: the backend's first service)."""
    probers = SERVICES[s.backend]
    return next((p for p in probers if p.service == s.grpc_service), probers[0])


def health_target(s: Settings, prober: type[GrpcProber]) -> GrpcTarget | None:
    """The grpc.health.v1 service the registration check asks: SIDECAR_REGISTRATION's, else the
    engine server's own where it serves one; None: the service's GetModelInfo."""
    if s.registration is not None:
        return grpc_target(s.registration)
    if prober.health_service is None:
        return None
    return replace(grpc_target(s.engine_url), service=prober.health_service)


class Grpc(Transport):
    name = "grpc"
    summary = (
        "the engine's gRPC generation service at SIDECAR_ENGINE_URL (vLLM's gRPC server, "
        "SGLang's --smg-grpc-mode or --grpc-port, TensorRT-LLM's; the services SGLang Model "
        "Gateway routes to), on the engines' own stubs"
    )
    engine_url = "grpc://HOST:PORT (the engine's gRPC server)"
    grpc_url = True
    extra = "grpc"
    module = "smg_grpc_proto"
    owns: ClassVar[dict[str, str]] = {
        "grpc_service": "the gRPC generation service to call",
        "metrics_url": "where the metrics are read beside a gRPC server",
    }
    backends = tuple(SERVICES)
    backends_why = "the engines whose gRPC services SGLang Model Gateway speaks"

    def choices(self) -> dict[str, tuple[str, ...]]:
        return {"grpc_service": tuple(p.service for ps in SERVICES.values() for p in ps)}

    def rules(self) -> tuple[Rule, ...]:
        return (
            Rule(
                "grpc_service",
                lambda s: (
                    s.grpc_service is not None and s.grpc_service not in service_names(s.backend)
                ),
                lambda s: (
                    f"one of {', '.join(service_names(s.backend))} (SIDECAR_BACKEND={s.backend})"
                ),
            ),
            Rule(
                "canary_path",
                lambda s: s.canary_path is not None,
                lambda s: f"unset with {_T} (the canary is the service's Generate call)",
            ),
            Rule(
                "registration_path",
                lambda s: s.registration_path is not None,
                lambda s: (
                    f"unset with {_T} (the registration check is a gRPC call; "
                    f"{env_name('registration')} names another grpc.health.v1 service)"
                ),
            ),
            Rule(
                "engine_api_key",
                lambda s: s.engine_api_key is not None,
                lambda s: f"unset with {_T} (the gRPC channel sends no bearer token)",
            ),
        )

    def route(self, s: Settings, engine: Engine, role: Role, rule: Canary | NoCanary) -> Route:
        cls = prober_class(s)
        prober = cls(engine, role, rule)
        progress = engine.api(role).progress
        if cls.metrics_escaped:
            progress = colon_escaped(progress)
        if s.metrics_path is not None:
            progress = replace(progress, path=s.metrics_path)
        target = health_target(s, cls)
        if target is not None:
            checking = Checking(
                f"grpc.health.v1 Check({target.service!r}) at {target.address}",
                "SERVING",
                clocks=(Cause.NOT_SERVING,),
                otherwise="otherwise (or NOT_SERVING before it served)",
                http=False,
            )
        else:
            checking = Checking(f"gRPC {prober.registration}", "status OK", http=False)
        return Route(
            prober,
            # The engine's HTTP routes are not asked: a gRPC server may serve no HTTP at all.
            Reads(progress),
            checking,
            http_url=s.metrics_url,
            metrics_off=None
            if s.metrics_url is not None
            else ("SIDECAR_METRICS_URL unset: the gRPC server serves none, as vLLM's does"),
            unpinned="canaries over gRPC are not pinned to a rank",
            routes_off="over gRPC the engine may serve no HTTP at all",
        )

    def said(self, s: Settings, plan: CanaryPlan, route: Route) -> Said:
        timeout = s.request_timeout
        abort = plan.prober.abort(plan.request(None, "canary-<uuid>"))
        stop = "the deadline ends the call on the server"
        if abort is not None:
            stop += f", then {abort.path} {json.dumps(abort.body)}"
        whole = f"the whole call ends within {timeout:g} s"
        passes = (
            f"{whole} with status OK and a complete with finish reason length or stop"
            if plan.override is not None
            else f"{whole}, {plan.prober.good_answer()}"
        )
        return Said(
            engine=(),
            request=(
                f"  request      gRPC {plan.path} at {grpc_target(s.engine_url).address}",
                f"  message      {json.dumps(shown_body(plan, s))}",
                "  metadata     x-request-id: canary-<uuid>",
                f"  timed out    {stop}",
            ),
            passes=passes,
            reaches=f", over the engine's gRPC generation service at {s.engine_url}",
        )

    async def open(self, o: Opening) -> Opened:
        from sidecar.runtime.grpcchannel import GrpcEngine, RpcRegistration
        from sidecar.runtime.grpcregistration import GrpcRegistration

        s, prober = o.settings, o.plan.prober
        assert isinstance(prober, GrpcProber)
        prober.messages()  # the stubs: imported only with this transport
        engine = GrpcEngine(
            grpc_target(s.engine_url), interval=s.registration_interval, clock=o.clock
        )
        o.stack.push_async_callback(engine.aclose)
        if o.plan.override is not None:  # the user's payload must be a request of the method
            engine.check_payload(o.plan.request(None, "canary-check"))
        probe = CanaryProbe(
            engine, timeout=s.request_timeout, clock=o.clock, sweeper=o.sweeper, holds_on="call"
        )
        target = health_target(s, type(prober))
        if target is None:
            return Opened(
                probe, RpcRegistration(engine, prober.registration, timeout=s.request_timeout)
            )
        check = GrpcRegistration(
            target, timeout=s.request_timeout, interval=s.registration_interval, clock=o.clock
        )
        o.stack.push_async_callback(check.aclose)
        return Opened(probe, check)


TRANSPORT = Grpc()
