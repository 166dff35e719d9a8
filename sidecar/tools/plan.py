"""The effective plan that ``health-sidecar --check-config`` prints: what will be checked, how,
and which rule will decide. Built from the same objects the running sidecar uses."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sidecar.config import DiscoveryBackend, Settings, Transport
from sidecar.core.endpoint import asks_engine_http
from sidecar.core.evidence.progress import ProgressSpec
from sidecar.core.verdict import RULE_TEXT, Cause, Rule, liveness_causes
from sidecar.probes import CanaryPlan, plan_canary
from sidecar.wiring import missing_for

MODEL_PLACEHOLDER = "<served model, from GET /v1/models>"


def _example_body(plan: CanaryPlan, settings: Settings) -> dict[str, Any]:
    request = plan.request(settings.model or MODEL_PLACEHOLDER, "canary-<uuid>")
    body = dict(request.body)
    if "bootstrap_room" in body:
        body["bootstrap_room"] = "<fresh per canary>"
    return _short(body)


def _short(value: Any) -> Any:
    """``value`` with each inline image (a ``data:`` URL) named instead of shown."""
    if isinstance(value, dict):
        return {key: _short(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_short(item) for item in value]
    if isinstance(value, str) and value.startswith("data:") and "," in value:
        kind = value[len("data:") : value.index(",")]
        return f"data:{kind},<{len(value) - len(kind) - 6} characters: a new image per canary>"
    return value


def _passes_when(plan: CanaryPlan, settings: Settings) -> str:
    timeout = settings.request_timeout
    if settings.transport is Transport.DYNAMO:
        whole = f"the whole stream ends within {timeout:g} s"
        if plan.override is not None:
            return whole + ", without an error, with a finish reason on its last chunk"
        return f"{whole}, {plan.prober.good_answer(plan.role)}"
    if settings.transport is Transport.GRPC:
        whole = f"the whole call ends within {timeout:g} s"
        if plan.override is not None:
            return whole + " with status OK and a complete with finish reason length or stop"
        return f"{whole}, {plan.prober.good_answer(plan.role)}"
    if not plan.prober.reads_body and plan.override is None:
        good = plan.prober.good_answer(plan.role)
        return f"the whole answer arrives within {timeout:g} s with {good}"
    whole = f"the whole answer arrives within {timeout:g} s with HTTP 200 and JSON"
    if plan.override is not None:
        return whole + ", without an error, with a finish reason where the answer has one"
    return f"{whole}, {plan.prober.good_answer(plan.role)}"


def _progress_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    if not (plan.enabled and s.progress_enabled):
        why = (
            "SIDECAR_PROGRESS_ENABLED=false"
            if plan.enabled
            else "no canary: the metrics would have nothing to confirm"
        )
        return [f"progress       engine metrics not read ({why})"]
    spec = plan.prober.progress
    if not s.metrics_reachable:
        return [
            "progress       engine metrics not read (SIDECAR_METRICS_URL unset: the gRPC server "
            "serves none, as vLLM's does): the canary alone decides; the stall rule is off"
        ]
    if not spec.every():
        return [
            f"progress       engine metrics not read ({s.backend}'s {s.disaggregation_mode} "
            "worker publishes no series that shows its work: the canary alone decides)"
        ]
    path = s.metrics_path or spec.path
    if s.transport is Transport.GRPC and s.metrics_url is not None:
        path = f"{s.metrics_url}{path}"
    counters = ", ".join(
        f"{category} {' | '.join(map(str, names))}" for category, names in spec.counters.items()
    )
    gauges = " + ".join(map(str, spec.running + spec.waiting))
    shown = spec.in_flight_shown
    return [
        f"progress       GET {path} every {s.metrics_interval:g} s, and around each canary; a "
        "hint, never a verdict",
        f"  in flight    {gauges}"
        + (
            ""
            if shown
            else " read 0 under load (each request finishes within the step that runs it): "
            "nothing is held or suspected for load; the scheduled canaries find a hang"
        ),
        f"  counters     {counters}",
        "  needs        at least one counter; in-flight gauges alone are not readable metrics, "
        "and then the canary alone decides",
        *(
            ["  holds        routine canaries while the endpoint is ready and work is in flight"]
            if shown
            else []
        ),
        "  excuses      a canary timeout when counters moved beyond the canary's own tokens "
        "(not counted)",
        *(_stall_lines(spec, s) if shown else ["  stall rule   off: no request shows in flight"]),
    ]


def _stall_lines(spec: ProgressSpec, s: Settings) -> list[str]:
    """The stall rule: on only with a counter that moves at every engine step."""
    policy = s.policy()
    steps = ", ".join(map(str, spec.step_series()))
    blind = (
        "a canary timeout behind requests in flight is load (not counted) while any counter "
        f"moved within {s.liveness_window:g} s (SIDECAR_LIVENESS_WINDOW); after a whole window "
        "with none moving it counts"
    )
    if not steps:
        return [
            f"  stall rule   off: {s.backend} has no counter known to move at every step; {blind}"
        ]
    return [
        f"  per step     {steps}: the stall rule needs one of them; an engine that publishes "
        f"none (an older version) gets none, and the first log line says so: {blind}",
        f"  suspects     a stall after {policy.suspect_after:g} s of work in flight with quiet "
        "counters, and sends a canary to confirm it: a timeout with no progress since it left "
        'is notready "stalled"; a pass clears it',
        f"  bound        a hang under load is notready within {policy.stall_bound:g} s of the "
        f"counters stopping ({policy.to_stalled()}); SIDECAR_STALL_WINDOW "
        f"{s.effective_stall_window:g} s"
        + (
            ""
            if policy.stall_bound <= s.effective_stall_window
            else f": raise it to at least {policy.stall_bound:g} s to meet it"
        ),
    ]


def _lifecycle_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    prober = plan.prober
    if prober.sleep_path and not _over_http(plan, s):
        sleep = f"sleep          not asked ({_NO_HTTP})"
    elif prober.sleep_path:
        gauges = " or ".join(f"{s} at 0" for s in prober.awake)
        sleep = (
            f"sleep          GET {prober.sleep_path} with each registration check (a 404: the "
            "engine serves no sleep route, not asked again)"
            + (f", and {gauges} in its metrics" if gauges and plan.enabled else "")
            + ": asleep -> notready 'sleeping', live, no canary"
        )
    else:
        sleep = f"sleep          not detected ({s.backend} has no sleep-state route)"
    if s.control_port is None:
        control = "maintenance    no control routes (SIDECAR_CONTROL_PORT unset)"
    else:
        guard = "Bearer token (SIDECAR_CONTROL_TOKEN)" if s.control_token else "no token"
        control = (
            f"maintenance    PUT/DELETE/GET http://127.0.0.1:{s.control_port}/maintenance "
            f"(loopback only, {guard}): notready 'maintenance', live, no canary, for at most "
            f"{s.maintenance_max:g} s; it ends by itself"
        )
    return [sleep, _faults_line(plan, s), control]


_NO_HTTP = "registered over gRPC without a canary: the engine may serve no HTTP"


def _over_http(plan: CanaryPlan, s: Settings) -> bool:
    return asks_engine_http(plan.enabled, over_grpc=s.grpc_registration is not None)


def _faults_line(plan: CanaryPlan, s: Settings) -> str:
    path = plan.prober.fault_path
    if path is None or s.transport is Transport.DYNAMO:
        return f"faults         not read ({s.backend} over {s.transport} reports none)"
    if not _over_http(plan, s):
        return f"faults         not read ({_NO_HTTP})"
    return (
        f"faults         GET {path} with each registration check (vLLM's fault tolerance; a 404: "
        "not served, not asked again this incarnation): a rank reported unhealthy or dead -> "
        f"notready, /live fails after {s.liveness_window:g} s of it; recovering or paused -> "
        "notready, live, no canary; healthy again -> a canary proves it first"
    )


def _rank_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    source = "SIDECAR_DP_RANKS" if s.dp_ranks is not None else "the default"
    if s.ranks == 1:
        if s.dp_ranks is not None:
            why = ""
        elif s.transport is Transport.DYNAMO:
            why = ": a Dynamo worker's ranks are not pinned over its request plane"
        else:
            why = f": a canary to {s.backend}'s {s.disaggregation_mode} worker cannot be pinned"
        return [f"ranks          1 ({source}{why}): the server is checked as one"]
    prober = plan.prober
    pin = (
        f"header {prober.rank_header}: <rank>"
        if prober.rank_header
        else f"body field {prober.rank_field}: <rank>"
    )
    if s.ranks == "auto" and not plan.enabled:
        return [f"ranks          auto ({source}): not counted without a canary; checked as one"]
    count = (
        f"auto ({source}): counted from the engine's metrics once they answer and after each "
        "restart (one unpinned canary until then; one rank: checked as one); more than one:"
        if s.ranks == "auto"
        else f"{s.ranks} ({source}):"
    )
    need = "every rank" if s.dp_min_ready_ranks is None else f"{s.dp_min_ready_ranks}"
    progress = (
        f"its own progress ({prober.rank_label}=<rank>)"
        if prober.rank_label
        else "no per-rank progress (the metrics do not tell ranks apart)"
    )
    return [
        f"ranks          {count} each its own canary ({pin}), {progress}",
        f"  ready when   {need} ready (SIDECAR_DP_MIN_READY_RANKS); fewer but enough: degraded",
    ]


def _transfer_lines(s: Settings) -> list[str]:
    if s.kv_peer_url is None:
        return ["kv_transfer    no transfer probe (SIDECAR_KV_PEER_URL unset)"]
    gates = "gates readiness" if "kv_transfer" in s.use_endpoint_health_status else "informs"
    return [
        f"kv_transfer    every {s.kv_probe_interval:g} s and on a counted failed transfer: a "
        f"{s.kv_probe_prompt_tokens}-token prefill on {s.kv_peer_url} with remote decode, the "
        "decode here with its KV, and a local prefill as the reference",
        f"  passes when  all answer 200 within {s.kv_probe_timeout:g} s and the transferred KV "
        f"decodes to the local answer; {gates}; never fails liveness",
    ]


def _dynamo_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    """How a Dynamo worker is found, asked and reached (SIDECAR_TRANSPORT=dynamo)."""
    want = s.dynamo_endpoint or "generate"
    health = s.registration_path or plan.prober.registration_path
    if s.discovery_backend is DiscoveryBackend.KUBERNETES:
        found = (
            f"GET /metadata every {s.registration_interval:g} s: the instance of endpoint {want} "
            "and the record the worker advertises for it, kept in the sidecar's own file "
            "discovery (in TMPDIR)"
        )
        discovery = (
            "not asked: the cluster lists only Ready pods, so the canary reaches the worker by "
            "its own record; no cluster rights needed"
        )
    else:
        metrics = s.metrics_path or plan.prober.progress.path
        found = (
            f"GET {metrics} every {s.registration_interval:g} s: the instance of endpoint {want} "
            "(dynamo_component_* labels)"
        )
        where = f"file ({s.file_kv})" if s.discovery_backend is DiscoveryBackend.FILE else "etcd"
        discovery = (
            f"{where}, as the worker's: missing there while the system server answers is "
            "notready 'not discoverable', and, listed before, a liveness clock"
        )
    missing = missing_for(s)
    return [
        f"worker         Dynamo system server {s.engine_url}; request plane {s.request_plane}",
        *([f"  not here     {missing} (the sidecar exits 2 at start)"] if missing else []),
        f"  instance     {found}",
        f"  own health   GET {health}: shown beside the verdict, never a gate",
        f"  discovery    {discovery}",
    ]


def render(settings: Settings, ignored: Iterable[tuple[str, str]] = ()) -> str:
    """What ``--check-config`` prints: what the sidecar will do with this configuration;
    ``ignored``: the DYN_* variables set that it does not read, and why (config.check_names)."""
    plan = plan_canary(settings.canary_config())
    s = settings
    lines = [
        "health-sidecar: configuration is valid",
        "",
        *_engine_lines(plan, s),
        "",
        f"endpoint {plan.endpoint}",
        *(_canary_lines(plan, s) if plan.enabled else _no_canary_lines(plan, s)),
        "",
        *_verdict_lines(plan, s),
        *_progress_lines(plan, s),
        *_lifecycle_lines(plan, s),
        *_rank_lines(plan, s),
        *_transfer_lines(s),
        f"shutdown       on SIGTERM: readiness draining (503), /live 200, until the engine is "
        f"gone or {s.drain_timeout:g} s have passed; then exit 0",
        f"serving        http://{s.system_host}:{s.system_port}  {s.health_path} (readiness)  "
        f"{s.live_path} (liveness)  /metrics  /sidecar/live (the sidecar's own probe)",
        _grpc_line(plan, s),
        *_ignored_lines(ignored),
    ]
    return "\n".join(lines)


def _ignored_lines(ignored: Iterable[tuple[str, str]]) -> list[str]:
    said = [f"{name} ({why})" for name, why in ignored]
    if not said:
        return []
    return [f"ignored        {said[0]}", *(f"               {each}" for each in said[1:])]


def _registration_check(plan: CanaryPlan, s: Settings) -> tuple[str, str]:
    """(the check, what a registered engine answers): the HTTP route, or SIDECAR_REGISTRATION's
    grpc.health.v1 Check."""
    target = s.grpc_registration
    if target is not None:
        return f"grpc.health.v1 Check({target.service!r}) at {target.address}", "SERVING"
    if s.transport is Transport.GRPC:
        return f"gRPC {plan.prober.registration_path}", "status OK"
    if s.registration_path is None and plan.prober.registered_by_any_answer:
        return f"GET {plan.prober.registration_path}", "at all (any status below 500: it is up)"
    return f"GET {s.registration_path or plan.prober.registration_path}", "200"


def _engine_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    """The engine, how the sidecar reaches it and how it checks it is registered."""
    auth = "bearer token from SIDECAR_ENGINE_API_KEY" if s.engine_api_key else "none"
    lines = [
        f"engine         {s.engine_url}  (backend {s.backend}, mode {s.disaggregation_mode}, "
        f"model type {s.model_type})",
        f"engine auth    {auth}",
    ]
    if s.transport is Transport.DYNAMO:
        return lines + _dynamo_lines(plan, s)
    every = f"every {s.registration_interval:g} s, timeout {s.request_timeout:g} s"
    check, answer = _registration_check(plan, s)
    return [*lines, f"registration   {check} {every}: registered while it answers {answer}"]


def _leftover_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    leaves = plan.prober.leaves
    if leaves is None or plan.override is not None:
        return []
    if s.ec_storage_path is None:
        return [f"  leftovers    {leaves}: left there (SIDECAR_EC_STORAGE_PATH unset)"]
    late = "its late answer names it" if plan.prober.keeps_abandoned else "it appears"
    return [
        f"  leftovers    {leaves}: removed from {s.ec_storage_path} after each canary, and a "
        f"timed-out canary's once {late}"
    ]


def _dynamo_timeout(plan: CanaryPlan) -> str:
    if plan.prober.keeps_abandoned and plan.override is None:
        return (
            f"kept open when it times out ({plan.prober.kept_because}): no other is sent "
            "until it ends"
        )
    return "stopped on the worker when it times out"


def _canary_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    """The endpoint's canary: what is sent, when it passes, its schedule and hysteresis."""
    if s.model:
        model = f"{s.model} (SIDECAR_MODEL)"
    elif plan.override is None and plan.prober.needs_model:
        model = "discovered from GET /v1/models at each registration"
    else:
        model = "not needed"
    if s.transport is Transport.DYNAMO:
        request = [
            f"  request      over the request plane, direct to the instance of {plan.path}"
            " (never a frontend or router)",
            f"  payload      {json.dumps(_example_body(plan, s))}",
            f"  context      id canary-<uuid>; {_dynamo_timeout(plan)}",
        ]
    elif s.transport is Transport.GRPC:
        abort = plan.prober.abort(plan.request(None, "canary-<uuid>"))
        stop = "the deadline ends the call on the server"
        if abort is not None:
            stop += f", then {abort.path} {json.dumps(abort.body)}"
        request = [
            f"  request      gRPC {plan.path} at {s.grpc_engine.address if s.grpc_engine else ''}",
            f"  message      {json.dumps(_example_body(plan, s))}",
            "  metadata     x-request-id: canary-<uuid>",
            f"  timed out    {stop}",
        ]
    else:
        example = plan.request(None, "canary-<uuid>")
        request = [
            f"  request      {example.method} {plan.path}",
            f"  body         {json.dumps(_example_body(plan, s)) if example.body else 'none'}",
            "  headers      X-Request-Id: canary-<uuid>",
        ]
    if s.check_answer and plan.override is None:
        answer = (
            "checked (SIDECAR_CANARY_CHECK_ANSWER): the first answer after registering or "
            "resuming is the reference; a different one fails the canary as 'wrong answer'"
        )
    elif s.check_answer:
        answer = "not checked (SIDECAR_CANARY_CHECK_ANSWER=true, but a user payload has no "
        answer += "reference answer)"
    else:
        answer = "not checked (SIDECAR_CANARY_CHECK_ANSWER=false)"
    return [
        f"  canary       yes: {plan.why}",
        f"  model        {model}",
        *request,
        f"  passes when  {_passes_when(plan, s)}",
        *_leftover_lines(plan, s),
        f"  schedule     once registered; then after {s.canary_wait_time:g} s without a passed "
        f"canary; every {s.retry_interval:g} s while failing or unproven; one at a time",
        f"  hysteresis   notready after {s.failure_threshold} consecutive failure(s); ready "
        f"after {s.success_threshold} consecutive pass(es)",
        f"  answer       {answer}",
        "  ready when   registered and the canary's verdict is ready",
    ]


def _no_canary_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    if s.transport is Transport.DYNAMO:
        when = "registered (the system server names the instance)"
    else:
        check, answer = _registration_check(plan, s)
        when = f"registered ({check} answers {answer})"
    return [f"  canary       no: {plan.why}", f"  ready when   {when}"]


def _verdict_lines(plan: CanaryPlan, s: Settings) -> list[str]:
    """The worker's readiness rule and its liveness clocks."""
    listed = s.use_endpoint_health_status
    rule = Rule.LISTED if listed else Rule.MONITORED
    counted = f" ({', '.join(listed)})" if listed else f" ({plan.endpoint})"
    over_grpc = s.grpc_registration is not None
    otherwise = "otherwise (or NOT_SERVING before it served)" if over_grpc else "with non-200"
    clocks = "; ".join(f"{cause} ({cause.brief})" for cause in causes(s))
    return [
        f"readiness      {RULE_TEXT[rule]}{counted}",
        f"               before an endpoint's first verdict: {s.starting_health_status} "
        "(DYN_SYSTEM_STARTING_HEALTH_STATUS)",
        f"liveness       fails after {s.liveness_window:g} s on one clock: {clocks}; never while "
        f"the engine answers its health route {otherwise}, refuses connections, or rejects a "
        "canary that never passed (4xx)",
    ]


def causes(s: Settings) -> tuple[Cause, ...]:
    """The liveness clocks that can run with this configuration (sidecar.core.verdict)."""
    plan = plan_canary(s.canary_config())
    dynamo = s.transport is Transport.DYNAMO
    return liveness_causes(
        canary=plan.enabled,
        progress=s.progress_enabled,
        discovery=dynamo and s.discovery_backend is not DiscoveryBackend.KUBERNETES,
        faults=plan.prober.fault_path is not None and not dynamo and _over_http(plan, s),
        grpc_health=s.grpc_registration is not None,
    )


def _grpc_line(plan: CanaryPlan, s: Settings) -> str:
    if s.grpc_port is None:
        return "grpc           no gRPC health service (SIDECAR_GRPC_PORT unset)"
    endpoints = [plan.endpoint, *(["kv_transfer"] if s.kv_peer_url is not None else [])]
    return (
        f"grpc           grpc.health.v1.Health (Check, Watch) on {s.system_host}:{s.grpc_port}: "
        f"'' and readiness as {s.health_path}, liveness as {s.live_path}, "
        f"{', '.join(endpoints)} as its endpoint in {s.health_path}"
    )
