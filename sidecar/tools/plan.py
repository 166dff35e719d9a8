"""What ``health-sidecar --check-config`` prints: the blueprint (``sidecar/wiring/resolve.py``),
what will be checked, how, and which rule will decide. It decides nothing: every line says what
the blueprint holds, and a transport's own lines are the transport's (``Said``).

The headline says two things apart: whether the configuration is valid (else the error lines,
exit 2), and whether this machine has what starting it needs (an extra, a mounted directory:
else the lines of what is missing, exit 3).
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.core.verdict import RULE_TEXT, Rule
from sidecar.redact import redact
from sidecar.runtime.exits import EXIT_NOT_HERE
from sidecar.wiring import Blueprint


def headline(b: Blueprint) -> list[str]:
    if not b.missing:
        return ["health-sidecar: configuration is valid, and it can start here"]
    return [
        f"health-sidecar: configuration is valid, but it cannot start here (exit {EXIT_NOT_HERE}):",
        *(f"  missing      {why}" for why in b.missing),
    ]


def _load_lines(b: Blueprint, read: str) -> list[str]:
    if b.plan.reads.load is None:
        return []
    return [
        f"load           {read} every {b.settings.metrics_interval:g} s: the engine's own "
        "report, shown in /health, never holding a canary back; its stale answer while requests "
        "are active sends a canary at once, and that canary's timeout is notready 'stalled'",
    ]


def _progress_lines(b: Blueprint) -> list[str]:
    s, plan = b.settings, b.plan
    if b.metrics_off is not None:
        return [f"progress       engine metrics not read ({b.metrics_off})"]
    spec = plan.reads.progress
    path = spec.path
    if b.route.http_url not in (None, s.engine_url):
        path = f"{b.route.http_url}{path}"
    read = b.said.metrics or f"GET {path}"
    if not spec.every():
        return [
            "progress       no counter shows the engine's progress: the canary alone decides; "
            f"the stall rule is off ({b.stall_off})",
            *_load_lines(b, read),
        ]
    counters = ", ".join(
        f"{category} {' | '.join(map(str, names))}" for category, names in spec.counters.items()
    )
    gauges = " + ".join(map(str, spec.running + spec.waiting))
    shown = spec.in_flight_shown
    return [
        f"progress       {read} every {s.metrics_interval:g} s"
        + (
            f", every {b.policy.busy_metrics_interval:g} s while work is in flight"
            if b.policy.busy_metrics_interval < s.metrics_interval
            else ""
        )
        + ", and around each canary; a hint, never a verdict",
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
        *_stall_lines(b),
        *_load_lines(b, read),
    ]


def _stall_lines(b: Blueprint) -> list[str]:
    """The stall rule: on only with a counter that moves at every engine step."""
    s, spec, policy = b.settings, b.plan.reads.progress, b.policy
    if not spec.in_flight_shown:
        return ["  stall rule   off: no request shows in flight"]
    blind = (
        "a canary timeout behind requests in flight is load (not counted) while any counter "
        f"moved within {s.liveness_window:g} s (SIDECAR_LIVENESS_WINDOW); after a whole window "
        "with none moving it counts"
    )
    if b.stall_off is not None:
        return [f"  stall rule   off: {b.stall_off}; {blind}"]
    steps = ", ".join(map(str, spec.step_series()))
    return [
        f"  per step     {steps}: the stall rule needs one of them; an engine that publishes "
        f"none (an older version) gets none, and the first log line says so: {blind}",
        f"  suspects     a stall after {policy.suspect_after:g} s of work in flight with quiet "
        "counters, and sends a canary to confirm it: a timeout with no progress since it left "
        'is notready "stalled"; a pass clears it',
        f"  bound        a hang under load is notready within {policy.stall_bound:g} s of the "
        f"counters stopping ({policy.to_stalled()}); SIDECAR_STALL_WINDOW "
        f"{policy.stall_window:g} s"
        + (
            ""
            if policy.stall_bound <= policy.stall_window
            else f": raise it to at least {policy.stall_bound:g} s to meet it"
        ),
    ]


def _lifecycle_lines(b: Blueprint) -> list[str]:
    s, plan = b.settings, b.plan
    api, reads = b.engine.api(plan.role), plan.reads
    if reads.sleep_path:
        gauges = " or ".join(f"{g} at 0" for g in reads.awake)
        sleep = (
            f"sleep          GET {reads.sleep_path} with each registration check (a 404: the "
            "engine serves no sleep route, not asked again)"
            + (f", and {gauges} in its metrics" if gauges and b.metrics_read else "")
            + ": asleep -> notready 'sleeping', live, no canary"
        )
    elif api.sleep_path:
        sleep = f"sleep          not asked ({b.routes_off})"
    else:
        sleep = f"sleep          not detected ({s.backend} has no sleep-state route)"
    if reads.fault_path:
        faults = (
            f"faults         GET {reads.fault_path} with each registration check (vLLM's fault "
            "tolerance; a 404: not served, not asked again this incarnation): a rank reported "
            f"unhealthy or dead -> notready, /live fails after {s.liveness_window:g} s of it; "
            "recovering or paused -> notready, live, no canary; healthy again -> a canary "
            "proves it first"
        )
    elif api.fault_path:
        faults = f"faults         not read ({b.routes_off})"
    else:
        faults = f"faults         not read ({s.backend} over {s.transport} reports none)"
    if s.control_port is None:
        control = "maintenance    no control routes (SIDECAR_CONTROL_PORT unset)"
    else:
        guard = "Bearer token (SIDECAR_CONTROL_TOKEN)" if s.control_token else "no token"
        control = (
            f"maintenance    PUT/DELETE/GET http://127.0.0.1:{s.control_port}/maintenance "
            f"(loopback only, {guard}): notready 'maintenance', live, no canary, for at most "
            f"{s.maintenance_max:g} s; it ends by itself"
        )
    return [sleep, faults, control]


def _rank_lines(b: Blueprint) -> list[str]:
    s, plan = b.settings, b.plan
    source = "SIDECAR_DP_RANKS" if s.dp_ranks is not None else "the default"
    pin = plan.reads.pin
    if b.ranks == 1 or pin is None:
        if s.dp_ranks is not None:
            why = ""
        elif b.route.unpinned is not None:
            why = f": {b.route.unpinned}"
        else:
            why = f": a canary to {s.backend}'s {s.disaggregation_mode} worker cannot be pinned"
        return [f"ranks          1 ({source}{why}): the server is checked as one"]
    if b.ranks == "auto" and not plan.enabled:
        return [f"ranks          auto ({source}): not counted without a canary; checked as one"]
    count = (
        f"auto ({source}): counted from the engine's metrics once they answer and after each "
        "restart (one unpinned canary until then; one rank: checked as one); more than one:"
        if b.ranks == "auto"
        else f"{b.ranks} ({source}):"
    )
    need = "every rank" if s.dp_min_ready_ranks is None else f"{s.dp_min_ready_ranks}"
    return [
        f"ranks          {count} each its own canary ({pin.how}), its own progress "
        f"({pin.label}=<rank>)",
        f"  ready when   {need} ready (SIDECAR_DP_MIN_READY_RANKS); fewer but enough: degraded",
    ]


def _transfer_lines(b: Blueprint) -> list[str]:
    s = b.settings
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


def render(b: Blueprint, ignored: Iterable[tuple[str, str]] = ()) -> str:
    """What ``--check-config`` prints, its secrets hidden (the one rule, ``sidecar/redact.py``);
    ``ignored``: the DYN_* variables set that the sidecar does not read, and why
    (config.check_names)."""
    s, plan = b.settings, b.plan
    lines = [
        *headline(b),
        "",
        *_engine_lines(b),
        "",
        f"endpoint {plan.endpoint}",
        *(_canary_lines(b) if plan.enabled else _no_canary_lines(b)),
        "",
        *_verdict_lines(b),
        *_progress_lines(b),
        *_lifecycle_lines(b),
        *_rank_lines(b),
        *_transfer_lines(b),
        f"shutdown       on SIGTERM: readiness draining (503), /live 200, until the engine is "
        f"gone or {s.drain_timeout:g} s have passed; then exit 0",
        f"serving        http://{s.system_host}:{s.system_port}  {s.health_path} (readiness)  "
        f"{s.live_path} (liveness)  /metrics  /sidecar/live (the sidecar's own probe)",
        _grpc_line(b),
        *_ignored_lines(ignored),
    ]
    return redact("\n".join(lines), b.secrets)


def _ignored_lines(ignored: Iterable[tuple[str, str]]) -> list[str]:
    said = [f"{name} ({why})" for name, why in ignored]
    if not said:
        return []
    return [f"ignored        {said[0]}", *(f"               {each}" for each in said[1:])]


def _engine_lines(b: Blueprint) -> list[str]:
    """The engine, how the sidecar reaches it and how it checks it is registered."""
    s, checking = b.settings, b.route.checking
    auth = "bearer token from SIDECAR_ENGINE_API_KEY" if s.engine_api_key else "none"
    every = f"every {s.registration_interval:g} s, timeout {s.request_timeout:g} s"
    return [
        f"engine         {b.about.engine_url}  (backend {s.backend}, mode "
        f"{s.disaggregation_mode}, model type {s.model_type}, transport {s.transport})",
        f"engine auth    {auth}",
        *b.said.engine,
        f"registration   {checking.asked} {every}: registered while it answers {checking.answers}",
    ]


def _leftover_lines(b: Blueprint) -> list[str]:
    s, plan = b.settings, b.plan
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


def _hysteresis(b: Blueprint) -> str:
    s = b.settings
    line = f"notready after {s.failure_threshold} consecutive failure(s)"
    if b.metrics_read:
        line += (
            ", or at the first timeout with requests held and no engine progress since it was "
            "sent (a hang the metrics confirm)"
        )
    return f"{line}; ready after {s.success_threshold} consecutive pass(es)"


def _canary_lines(b: Blueprint) -> list[str]:
    """The endpoint's canary: what is sent, when it passes, its schedule and hysteresis."""
    s, plan = b.settings, b.plan
    if s.model:
        model = f"{s.model} (SIDECAR_MODEL)"
    elif plan.wants_model:
        model = b.said.model
    else:
        model = "not needed"
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
        *b.said.request,
        f"  passes when  {b.said.passes}",
        *_leftover_lines(b),
        f"  schedule     once registered; then after {s.canary_wait_time:g} s without a passed "
        f"canary; every {s.retry_interval:g} s while failing or unproven; one at a time",
        f"  hysteresis   {_hysteresis(b)}",
        f"  answer       {answer}",
        "  ready when   registered and the canary's verdict is ready",
    ]


def _no_canary_lines(b: Blueprint) -> list[str]:
    checking = b.route.checking
    when = f"registered ({checking.asked} answers {checking.answers})"
    return [f"  canary       no: {b.plan.why}", f"  ready when   {when}"]


def _verdict_lines(b: Blueprint) -> list[str]:
    """The worker's readiness rule and its liveness clocks."""
    s, plan = b.settings, b.plan
    listed = s.use_endpoint_health_status
    rule = Rule.LISTED if listed else Rule.MONITORED
    counted = f" ({', '.join(listed)})" if listed else f" ({plan.endpoint})"
    clocks = "; ".join(f"{cause} ({cause.brief})" for cause in b.causes)
    return [
        f"readiness      {RULE_TEXT[rule]}{counted}",
        f"               before an endpoint's first verdict: {s.starting_health_status} "
        "(DYN_SYSTEM_STARTING_HEALTH_STATUS)",
        f"liveness       fails after {s.liveness_window:g} s on one clock: {clocks}; never while "
        f"the engine answers its health route {b.route.checking.otherwise}, refuses "
        "connections, or rejects a canary that never passed (4xx)",
        _pod_restart_line(s.pod_restart_exit_code),
    ]


def _pod_restart_line(code: int | None) -> str:
    if code is None:
        return "               not live: /live 503 (SIDECAR_POD_RESTART_EXIT_CODE unset)"
    return (
        f"               not live: /live 503, and exit {code} (SIDECAR_POD_RESTART_EXIT_CODE) "
        "for the kubelet to restart the whole pod"
    )


def _grpc_line(b: Blueprint) -> str:
    s = b.settings
    if s.grpc_port is None:
        return "grpc           no gRPC health service (SIDECAR_GRPC_PORT unset)"
    endpoints = ", ".join(b.plans)
    return (
        f"grpc           grpc.health.v1.Health (Check, Watch) on {s.system_host}:{s.grpc_port}: "
        f"'' and readiness as {s.health_path}, liveness as {s.live_path}, "
        f"{endpoints} as its endpoint in {s.health_path}"
    )
