"""The Dynamo transport (SIDECAR_TRANSPORT=dynamo): canaries over Dynamo's request plane,
straight to this pod's worker instance (a Dynamo worker serves no HTTP generation API), with
Dynamo's own runtime client (the dynamo extra: ai-dynamo-runtime). One prober per backend
(``vllm.py``, ``sglang.py``, ``trtllm.py``, on ``base.py``), as Dynamo's own workers build their
health-check payloads; the worker found on its system server at SIDECAR_ENGINE_URL
(``worker.py``, ``identity.py``) and reached through the runtime (``client.py``), in an
environment of its own (``environment.py``, ``runtimelog.py``).

Where is TensorRT-LLM's decode canary built over the request plane? ``trtllm.py``, ``body``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import ClassVar

from sidecar.config import DiscoveryBackend, LogLevel, Rule, Settings, env_name
from sidecar.core.vocabulary import GENERATE, Cause, Role
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryPlan, Reads
from sidecar.probes.canary import Canary as CanaryProbe
from sidecar.transports.dynamo import environment
from sidecar.transports.dynamo.base import DynamoProber, dynamo_progress
from sidecar.transports.dynamo.settings import PlaneConfig
from sidecar.transports.dynamo.sglang import DynamoSglangProber
from sidecar.transports.dynamo.trtllm import DynamoTrtllmProber
from sidecar.transports.dynamo.vllm import DynamoVllmEncoderProber, DynamoVllmProber
from sidecar.transports.seam import Checking, Opened, Opening, Route, Said, Transport, shown_body

PROBERS: dict[str, type[DynamoProber]] = {
    "vllm": DynamoVllmProber,
    "sglang": DynamoSglangProber,
    "trtllm": DynamoTrtllmProber,
}
HEALTH_PATH = "/health"  # the worker's own /health on its system server
DYNAMO_SYSTEM_PORT = 9090  # the port Dynamo's operator gives a worker's system server
_T = "SIDECAR_TRANSPORT=dynamo"


def plane_config(s: Settings) -> PlaneConfig:
    return PlaneConfig(
        discovery=s.discovery_backend,
        plane=s.request_plane,
        file_kv=s.file_kv,
        endpoint=s.dynamo_endpoint,
        debug=s.log_level is LogLevel.DEBUG,
    )


class Dynamo(Transport):
    name = "dynamo"
    summary = (
        "Dynamo's request plane, straight to the instance of the worker whose system server is "
        "SIDECAR_ENGINE_URL (a Dynamo worker serves no HTTP generation API)"
    )
    engine_url = "an http(s) URL: the worker's system server (http://127.0.0.1:9090 in a pod)"
    extra = "dynamo"
    module = "dynamo.runtime"
    passes = (*environment.PASSED, *environment.PASSED_NAMES)
    owns: ClassVar[dict[str, str]] = {"dynamo_endpoint": "the Dynamo worker endpoint to canary"}
    backends = tuple(PROBERS)
    backends_why = "the Dynamo worker's backend decides its canary payload"

    def rules(self) -> tuple[Rule, ...]:
        return (
            Rule(
                "canary_path",
                lambda s: s.canary_path is not None,
                lambda s: (
                    f"unset with {_T} (the canary goes over the request plane; "
                    f"{env_name('dynamo_endpoint')} names the endpoint)"
                ),
            ),
            Rule(
                "file_kv",
                lambda s: s.discovery_backend is DiscoveryBackend.FILE and s.file_kv is None,
                lambda s: (
                    f"the worker's file-discovery directory with "
                    f"{env_name('discovery_backend')}=file and {_T} (it is not set)"
                ),
                lambda s: None,
            ),
            Rule(
                "registration",
                lambda s: s.registration is not None,
                lambda s: (
                    f"unset ({_T} reads the worker's registration from its system server and "
                    "from discovery)"
                ),
            ),
        )

    def route(self, s: Settings, engine: Engine, role: Role, rule: Canary | NoCanary) -> Route:
        endpoint = s.dynamo_endpoint or GENERATE
        prober: DynamoProber
        if engine.name == "vllm" and role.encoder:
            prober = DynamoVllmEncoderProber(
                engine, role, rule, endpoint, s.embedding_transfer_mode
            )
        else:
            prober = PROBERS[engine.name](engine, role, rule, endpoint)
        progress = dynamo_progress(endpoint)
        if s.metrics_path is not None:
            progress = replace(progress, path=s.metrics_path)
        kubernetes = s.discovery_backend is DiscoveryBackend.KUBERNETES
        identify = "/metadata" if kubernetes else progress.path
        checking = Checking(
            f"GET {identify} on the worker's system server",
            "naming the instance of endpoint " + endpoint,
            clocks=() if kubernetes else (Cause.UNDISCOVERABLE,),
        )
        return Route(
            prober,
            Reads(progress),
            checking,
            http_url=s.engine_url,
            unpinned="a Dynamo worker's ranks are not pinned over its request plane",
            routes_off="a Dynamo worker's engine serves no HTTP API of its own",
        )

    def said(self, s: Settings, plan: CanaryPlan, route: Route) -> Said:
        want = s.dynamo_endpoint or GENERATE
        health = s.registration_path or HEALTH_PATH
        if s.discovery_backend is DiscoveryBackend.KUBERNETES:
            found = (
                f"GET /metadata every {s.registration_interval:g} s: the instance of endpoint "
                f"{want} and the record the worker advertises for it, kept in the sidecar's own "
                "file discovery (in TMPDIR)"
            )
            discovery = (
                "not asked: the cluster lists only Ready pods, so the canary reaches the worker "
                "by its own record; no cluster rights needed"
            )
        else:
            found = (
                f"GET {route.reads.progress.path} every {s.registration_interval:g} s: the "
                f"instance of endpoint {want} (dynamo_component_* labels)"
            )
            where = (
                f"file ({s.file_kv})" if s.discovery_backend is DiscoveryBackend.FILE else "etcd"
            )
            discovery = (
                f"{where}, as the worker's: missing there while the system server answers is "
                "notready 'not discoverable', and, listed before, a liveness clock"
            )
        prober = plan.prober
        if prober.keeps_abandoned and plan.override is None:
            stop = (
                f"kept open when it times out ({prober.kept_because}): no other is sent until it "
                "ends"
            )
        else:
            stop = "stopped on the worker when it times out"
        whole = f"the whole stream ends within {s.request_timeout:g} s"
        passes = (
            f"{whole}, without an error, with a finish reason on its last chunk"
            if plan.override is not None
            else f"{whole}, {prober.good_answer()}"
        )
        warnings = ()
        if s.system_port == DYNAMO_SYSTEM_PORT:
            warnings = (
                f"WARNING: DYN_SYSTEM_PORT={s.system_port} is the Dynamo worker's own system "
                "port under the operator: give the sidecar another (9091).",
            )
        return Said(
            engine=(
                f"worker         Dynamo system server {s.engine_url}; request plane "
                f"{s.request_plane}",
                f"  instance     {found}",
                f"  own health   GET {health}: shown beside the verdict, never a gate",
                f"  discovery    {discovery}",
            ),
            request=(
                f"  request      over the request plane, direct to the instance of {plan.path}"
                " (never a frontend or router)",
                f"  payload      {json.dumps(shown_body(plan, s))}",
                f"  context      id canary-<uuid>; {stop}",
            ),
            passes=passes,
            reaches=", over Dynamo's request plane to the worker instance of this pod",
            warnings=warnings,
            readiness=(
                "Under Dynamo's Kubernetes discovery a pod that is not Ready leaves the "
                "Frontend's routing; under etcd, readiness gates rollouts and Services only."
            ),
        )

    def prepare(self, s: Settings) -> str | None:
        """Dynamo's runtime reads its variables from the process environment, so it gets its own
        before any thread starts (``environment.py``), and its log goes to the sidecar's."""
        from sidecar.transports.dynamo import runtimelog

        private = environment.prepare(plane_config(s))
        runtimelog.capture()
        return private

    async def open(self, o: Opening) -> Opened:
        """Dynamo's runtime client, started (a refusal is a one-line StartupError), and this
        pod's worker found through it."""
        from sidecar.runtime.server import StartupError
        from sidecar.transports.dynamo.client import RequestPlane
        from sidecar.transports.dynamo.worker import DynamoWorker

        s = o.settings
        plane = RequestPlane(
            plane_config(s), timeout=s.request_timeout, clock=o.clock, private_dir=o.private_dir
        )
        try:
            plane.start()
        except Exception as exc:  # the runtime refuses its variables with plain Exceptions
            raise StartupError(f"{_T}: Dynamo's runtime client did not start: {exc}") from None
        o.stack.push_async_callback(plane.aclose)
        assert o.routes is not None
        worker = DynamoWorker(
            s.dynamo_endpoint,
            o.routes,
            plane,
            health_path=s.registration_path or HEALTH_PATH,
            metrics_path=o.route.reads.progress.path,
            clock=o.clock,
        )
        probe = CanaryProbe(
            worker, timeout=s.request_timeout, clock=o.clock, sweeper=o.sweeper, holds_on="stream"
        )
        return Opened(probe, worker)


TRANSPORT = Dynamo()
