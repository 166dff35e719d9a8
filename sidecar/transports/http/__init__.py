"""The HTTP transport (SIDECAR_TRANSPORT=http, the default): canaries over the engine's own HTTP
API at SIDECAR_ENGINE_URL, one prober per backend (``vllm.py``, ``sglang.py``, ``trtllm.py``,
``openai.py``, on ``base.py``), sent and stopped by the common probe through the engine client.
The registration check is the
engine's cheapest "up and model loaded" route, or its gRPC health service
(SIDECAR_REGISTRATION=grpc://HOST:PORT/SERVICE).

Where is TensorRT-LLM's decode canary built over HTTP? ``trtllm.py``, method ``body``.
"""

from __future__ import annotations

import json
from dataclasses import replace

from sidecar.config import Settings
from sidecar.core.vocabulary import Cause, Mode, Role
from sidecar.engines import ENGINES
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryPlan, Reads
from sidecar.probes.canary import Canary as CanaryProbe
from sidecar.runtime.engine import RouteRegistration
from sidecar.runtime.grpctarget import grpc_target
from sidecar.transports.http.base import HttpProber
from sidecar.transports.http.openai import OpenAIProber
from sidecar.transports.http.sglang import SglangEncoderProber, SglangProber
from sidecar.transports.http.trtllm import TrtllmProber
from sidecar.transports.http.vllm import VllmEncoderProber, VllmProber
from sidecar.transports.seam import Checking, Opened, Opening, Route, Said, Transport, shown_body

#: Each backend's prober where its HTTP API has a dialect of its own, and its encoder's where it
#: has one; any other engine is sent the plain OpenAI-compatible completion.
PROBERS: dict[str, type[HttpProber]] = {
    "vllm": VllmProber,
    "sglang": SglangProber,
    "trtllm": TrtllmProber,
    "openai": OpenAIProber,
}
ENCODERS: dict[str, type[HttpProber]] = {"vllm": VllmEncoderProber, "sglang": SglangEncoderProber}


def prober_class(engine: Engine, role: Role) -> type[HttpProber]:
    """The prober of this engine's role: an encoder's where the role is one (SGLang's encode
    worker of any model type answers on its encoder's routes)."""
    encoder = ENCODERS.get(engine.name)
    if (
        encoder is not None
        and role.mode is Mode.ENCODE
        and (role.encoder or engine.name == "sglang")
    ):
        return encoder
    return PROBERS.get(engine.name, OpenAIProber)


def registration_route(s: Settings, engine: Engine, role: Role) -> tuple[str, bool]:
    """The registration route, and whether any answer below 500 will do."""
    api = engine.api(role)
    if s.registration_path is not None:
        return s.registration_path, False
    return api.registration_path, api.registered_by_any_answer


class Http(Transport):
    name = "http"
    summary = "the engine's own HTTP API at SIDECAR_ENGINE_URL (the default)"
    engine_url = "an http(s) URL with a host and no query"
    backends = tuple(ENGINES)  # each by its dialect, or as an OpenAI-compatible server
    transfer_probe = True

    def route(self, s: Settings, engine: Engine, role: Role, rule: Canary | NoCanary) -> Route:
        prober = prober_class(engine, role)(engine, role, rule, s.canary_path)
        api = engine.api(role)
        progress = api.progress
        if s.metrics_path is not None:
            progress = replace(progress, path=s.metrics_path)
        reads = Reads(
            progress,
            sleep_path=api.sleep_path,
            awake=api.awake,
            fault_path=api.fault_path,
            pin=api.pin,
            transfers=api.transfers,
            needs_model=api.needs_model,
        )
        if s.registration is not None:
            target = grpc_target(s.registration)
            checking = Checking(
                f"grpc.health.v1 Check({target.service!r}) at {target.address}",
                "SERVING",
                clocks=(Cause.NOT_SERVING,),
                otherwise="otherwise (or NOT_SERVING before it served)",
                http=False,
            )
        else:
            path, any_status = registration_route(s, engine, role)
            answers = "at all (any status below 500: it is up)" if any_status else "200"
            checking = Checking(f"GET {path}", answers)
        return Route(prober, reads, checking, http_url=s.engine_url)

    def said(self, s: Settings, plan: CanaryPlan, route: Route) -> Said:
        timeout = s.request_timeout
        prober = plan.prober
        example = plan.request(None, "canary-<uuid>")
        whole = f"the whole answer arrives within {timeout:g} s with"
        if not prober.reads_body and plan.override is None:
            passes = f"{whole} {prober.good_answer()}"
        elif plan.override is not None:
            passes = (
                f"{whole} HTTP 200 and JSON, without an error, with a finish reason where "
                "the answer has one"
            )
        else:
            passes = f"{whole} HTTP 200 and JSON, {prober.good_answer()}"
        return Said(
            engine=(),
            request=(
                f"  request      {example.method} {plan.path}",
                f"  body         {json.dumps(shown_body(plan, s)) if example.body else 'none'}",
                "  headers      X-Request-Id: canary-<uuid>",
            ),
            passes=passes,
        )

    async def open(self, o: Opening) -> Opened:
        s = o.settings
        path, any_status = registration_route(s, o.plan.prober.engine, o.plan.role)
        client = o.client(s.engine_url)
        # The engine's HTTP side alive: its registration route answers (any status).
        canary = CanaryProbe(
            client,
            timeout=s.request_timeout,
            clock=o.clock,
            sweeper=o.sweeper,
            answers=lambda deadline: client.answers(path, deadline),
        )
        if s.registration is not None:
            from sidecar.runtime.grpcregistration import GrpcRegistration  # grpcio: only then

            check = GrpcRegistration(
                grpc_target(s.registration),
                timeout=s.request_timeout,
                interval=s.registration_interval,
                clock=o.clock,
            )
            o.stack.push_async_callback(check.aclose)
            return Opened(canary, check)
        assert o.routes is not None
        return Opened(canary, RouteRegistration(o.routes, path, any_status=any_status))


TRANSPORT = Http()
