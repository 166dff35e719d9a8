"""The OpenEngine transport (SIDECAR_TRANSPORT=openengine, SIDECAR_ENGINE_URL=grpc://HOST:PORT):
canaries over the vendor-neutral OpenEngine contract (``openengine.v1``) that TensorRT-LLM's
OpenEngine server serves and Dynamo's OpenEngine sidecars speak, with the sidecar's own
declarations of the messages it uses (``messages.py``: no Python bindings are published).

- The canary (``prober.py``): ``Inference/Generate``, one prober for every engine (the contract
  is vendor-neutral), the role's need from the engine's rule in the contract's fields; judged on
  the whole stream; stopped by its deadline and ``Control/Abort``.
- Beside it (``control.py``): registration by ``Control/Health`` (READY or DEGRADED registered,
  STARTING loading, NOT_READY not serving), the engine's own inference probe at most once per
  liveness window (shown, never the verdict), the served model from ``GetModelInfo``, and
  ``GetLoad`` read as the engine's load report: its running and queued requests shown, its
  stale answer under load a stall hint that one canary confirms. No counter moves at every
  step: the stall rule stays off.

Where is TensorRT-LLM's decode canary built over OpenEngine? ``prober.py``, method ``body``.
"""

from __future__ import annotations

import json

from sidecar.config import Rule, Settings
from sidecar.core.evidence.load import LoadSpec
from sidecar.core.evidence.progress import ProgressSpec, series
from sidecar.core.vocabulary import Cause, Role
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryPlan, Reads
from sidecar.probes.canary import Canary as CanaryProbe
from sidecar.runtime.grpctarget import grpc_target
from sidecar.transports.openengine.prober import CONTROL, OpenEngineProber
from sidecar.transports.seam import Checking, Opened, Opening, Route, Said, Transport, shown_body

_T = "SIDECAR_TRANSPORT=openengine"
GET_LOAD = f"/{CONTROL}/GetLoad"


class OpenEngine(Transport):
    name = "openengine"
    summary = (
        "the OpenEngine contract (openengine.v1 Inference and Control, v0.1.0) at "
        "SIDECAR_ENGINE_URL, as TensorRT-LLM's OpenEngine server serves it"
    )
    engine_url = "grpc://HOST:PORT (the engine's OpenEngine server)"
    grpc_url = True
    backends = ("trtllm", "vllm", "sglang")
    backends_why = "the engines whose role rules the contract can carry"

    def rules(self) -> tuple[Rule, ...]:
        return tuple(
            Rule(field, lambda s, f=field: getattr(s, f) is not None, lambda s, w=why: w)
            for field, why in (
                ("canary_path", f"unset with {_T} (the canary is Inference/Generate)"),
                ("registration_path", f"unset with {_T} (the registration check is Health)"),
                ("registration", f"unset with {_T} (the registration check is Control/Health)"),
                ("engine_api_key", f"unset with {_T} (the gRPC channel sends no bearer token)"),
            )
        )

    def route(self, s: Settings, engine: Engine, role: Role, rule: Canary | NoCanary) -> Route:
        from sidecar.transports.openengine.control import QUEUED, RUNNING, STALE

        address = grpc_target(s.engine_url).address
        reads = Reads(
            ProgressSpec(path=GET_LOAD, running=(), waiting=(), counters={}),
            needs_model=True,
            load=LoadSpec(series(RUNNING), series(QUEUED), series(STALE)),
        )
        checking = Checking(
            f"OpenEngine {CONTROL}/Health at {address}",
            "READY or DEGRADED",
            clocks=(Cause.NOT_SERVING,),
            otherwise="otherwise (or NOT_READY before it was ready)",
            http=False,
        )
        return Route(
            OpenEngineProber(engine, role, rule),
            reads,
            checking,
            http_url=None,
            unpinned="canaries over OpenEngine are not pinned to a rank",
            routes_off="an OpenEngine server serves no HTTP",
        )

    def said(self, s: Settings, plan: CanaryPlan, route: Route) -> Said:
        address = grpc_target(s.engine_url).address
        abort = plan.prober.abort(plan.request(None, "canary-<uuid>"))
        stop = "the deadline ends the call on the server"
        if abort is not None:
            stop += f", then {abort.path} {json.dumps(abort.body)} (ABORTED or ALREADY_FINISHED)"
        whole = f"the whole stream ends within {s.request_timeout:g} s"
        passes = (
            f"{whole} with status OK, no error event, and a finished event"
            if plan.override is not None
            else f"{whole}, {plan.prober.good_answer()}"
        )
        return Said(
            engine=(
                f"  own probe    {CONTROL}/Health with include_inference_probe at most every "
                f"{s.liveness_window:g} s (SIDECAR_LIVENESS_WINDOW): the engine's own one-token "
                "probe, shown beside the verdict, never a gate",
            ),
            request=(
                f"  request      gRPC {plan.path} at {address}",
                f"  message      {json.dumps(shown_body(plan, s))}",
                "  metadata     x-request-id: canary-<uuid>",
                f"  timed out    {stop}",
            ),
            passes=passes,
            metrics=f"gRPC {GET_LOAD} (running and queued requests; UNAVAILABLE when stale)",
            model=f"from {CONTROL}/GetModelInfo once registered (every Generate names one)",
            reaches=f", over OpenEngine at {s.engine_url}",
        )

    async def open(self, o: Opening) -> Opened:
        from sidecar.runtime.grpcchannel import GrpcEngine
        from sidecar.transports.openengine import messages
        from sidecar.transports.openengine.control import OpenEngineHealth, OpenEngineLoad

        messages.DECLARED.register()
        s = o.settings
        engine = GrpcEngine(
            grpc_target(s.engine_url), interval=s.registration_interval, clock=o.clock
        )
        o.stack.push_async_callback(engine.aclose)
        if o.plan.override is not None:
            engine.check_payload(o.plan.request(None, "canary-check"))
        probe = CanaryProbe(
            engine, timeout=s.request_timeout, clock=o.clock, sweeper=o.sweeper, holds_on="call"
        )
        health = OpenEngineHealth(
            engine,
            role=s.disaggregation_mode,
            timeout=s.request_timeout,
            probe_every=s.liveness_window,
            clock=o.clock,
        )
        return Opened(probe, health, OpenEngineLoad(engine, timeout=s.request_timeout))


TRANSPORT = OpenEngine()
