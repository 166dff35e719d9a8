"""``health-sidecar probes``: the engine container's Kubernetes probes, sized from the settings.

The probes belong to the *engine* container and target the sidecar's port in the same pod: a
liveness failure restarts only the container whose probe failed, so a probe on the sidecar could
never restart a hung engine. The sidecar answers every probe from memory, so the probe timeouts
are headroom for a starved node, never time given to the engine.

- startupProbe, ``DYN_SYSTEM_HEALTH_PATH``: 200 once the model is loaded and (with a canary) a
  canary passed. Liveness and readiness start only after it, so ``failureThreshold`` x
  ``periodSeconds`` covers the longest load. (``/live`` answers 200 while the engine loads, so a
  startupProbe on it would pass at once and gate nothing.)
- livenessProbe, ``DYN_SYSTEM_LIVE_PATH``: fails only after ``SIDECAR_LIVENESS_WINDOW`` of
  uninterrupted hard failure, never while loading or busy; the kubelet adds a few failures so a
  sidecar restart never restarts the engine.
- readinessProbe, ``DYN_SYSTEM_HEALTH_PATH``: the sidecar already applies hysteresis, so the
  kubelet needs few failures; the period is chosen so that a hung engine leaves rotation within
  :data:`READINESS_TARGET_SECONDS`.

:func:`size` computes the numbers and the arithmetic behind them (pure, tested);
:func:`render` prints them as a YAML fragment (written by PyYAML) with a comment on each number.
With ``grpc`` (``probes --grpc``) the same probes are kubelet ``grpc:`` probes on the gRPC health
service (SIDECAR_GRPC_PORT): service ``readiness`` for startup and readiness (as /health),
``liveness`` for liveness (as /live), with the same numbers.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Any

import yaml

from sidecar.core.evidence.policy import Policy
from sidecar.redact import redact
from sidecar.surface.grpcnames import LIVENESS, READINESS
from sidecar.wiring import Blueprint

READINESS_TARGET_SECONDS = 30.0
"""A hung engine leaves rotation within this many seconds (when the settings allow it)."""

PROBE_TIMEOUT = 5
"""Startup and liveness timeoutSeconds: the sidecar answers from memory; this is headroom."""
READINESS_TIMEOUT = 3
READINESS_FAILURES = 2  # one lost probe does not flap readiness
READINESS_MAX_PERIOD = 5
STARTUP_PERIOD = 10
LIVENESS_PERIOD = 10
LIVENESS_FAILURES = 3  # 30 s: rides out a restart of the sidecar (the probes' target)
LIVENESS_GRACE = 30  # probe-level terminationGracePeriodSeconds: a hung engine drains nothing
WIDTH = 100
BIND_ALL = ("0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Probe:
    path: str
    period: int
    timeout: int
    failures: int


@dataclass(frozen=True)
class Sizing:
    """The three probes and the arithmetic behind them (seconds); the sidecar's own bounds are
    the policy's (sidecar/core/evidence/policy.py), with their terms."""

    port: int
    canary: bool
    policy: Policy
    startup: Probe
    liveness: Probe
    readiness: Probe
    max_load: float
    load_to_ready: float  # after the engine is up: registration seen, first canaries passed
    hang_to_notready: float  # the sidecar's worst case from a hang to /health 503
    stall_to_notready: float | None  # the same with work in flight (engine metrics read)
    hang_to_unready: float  # ... plus the kubelet's readiness failures: out of rotation
    hang_to_notlive_min: float  # the earliest /live can fail after a hang starts
    hang_to_restart: float  # the worst case from a hang to the kubelet's restart

    @property
    def startup_budget(self) -> float:
        """Seconds from container start to the startupProbe's last allowed failure."""
        return (self.startup.failures - 1) * self.startup.period

    @property
    def liveness_tolerance(self) -> float:
        """Seconds of failing /live (or of an absent sidecar) the kubelet tolerates."""
        return (self.liveness.failures - 1) * self.liveness.period


def _secs(value: float) -> str:
    return f"{round(value, 3):g}"


def size(blueprint: Blueprint, max_load_seconds: float) -> Sizing:
    """Size the engine container's probes for this configuration and load time."""
    if not math.isfinite(max_load_seconds) or max_load_seconds <= 0:
        raise ValueError(f"--max-load-seconds must be a number > 0, not {max_load_seconds!r}")
    s = blueprint.settings
    canary = blueprint.canary
    policy = blueprint.policy  # the bounds and their terms: sidecar/core/evidence/policy.py
    load_to_ready = policy.to_ready(canary).seconds
    hang_to_notready = policy.to_notready(canary).seconds
    hang_to_notlive = policy.to_notlive(canary).seconds
    # With work in flight, quiet counters raise a suspicion that one canary confirms, where the
    # stall rule can run (the blueprint says).
    stalls = canary and blueprint.stall_off is None
    stall_to_notready = policy.to_stalled().seconds if stalls else None

    startup = Probe(
        s.health_path,
        STARTUP_PERIOD,
        PROBE_TIMEOUT,
        math.ceil((max_load_seconds + load_to_ready) / STARTUP_PERIOD) + 1,
    )
    liveness = Probe(s.live_path, LIVENESS_PERIOD, PROBE_TIMEOUT, LIVENESS_FAILURES)
    spare = READINESS_TARGET_SECONDS - hang_to_notready
    period = min(READINESS_MAX_PERIOD, max(1, math.floor(spare / READINESS_FAILURES)))
    readiness = Probe(s.health_path, period, READINESS_TIMEOUT, READINESS_FAILURES)
    return Sizing(
        port=s.system_port,
        canary=canary,
        policy=policy,
        startup=startup,
        liveness=liveness,
        readiness=readiness,
        max_load=max_load_seconds,
        load_to_ready=load_to_ready,
        hang_to_notready=hang_to_notready,
        stall_to_notready=stall_to_notready,
        hang_to_unready=hang_to_notready + readiness.failures * readiness.period,
        hang_to_notlive_min=s.liveness_window,
        hang_to_restart=hang_to_notlive + liveness.failures * liveness.period,
    )


def _comment(text: str, indent: str = "") -> list[str]:
    prefix = indent + "# "
    return textwrap.wrap(text, WIDTH, initial_indent=prefix, subsequent_indent=prefix)


@dataclass(frozen=True)
class Target:
    """What the probes ask: the HTTP routes (``httpGet``), or the gRPC health service's services
    (``grpc``); and how the text names the answers."""

    port: int
    grpc: bool
    ready: str  # what the startup and readiness probes ask, as the comments name it
    live: str
    ok: str  # a passing answer
    bad: str  # a failing readiness answer

    def action(self, path: str, service: str) -> dict[str, Any]:
        if self.grpc:
            return {"grpc": {"port": self.port, "service": service}}
        return {"httpGet": {"path": path, "port": self.port}}


def target(blueprint: Blueprint, grpc: bool = False) -> Target:
    """The HTTP routes, or (``grpc``) the gRPC health service: ValueError when it is off."""
    s = blueprint.settings
    if not grpc:
        return Target(s.system_port, False, s.health_path, s.live_path, "200", "503")
    if s.grpc_port is None:
        raise ValueError(
            "--grpc: expected SIDECAR_GRPC_PORT set (the gRPC health service is off without it)"
        )
    return Target(
        s.grpc_port,
        True,
        f'gRPC service "{READINESS}"',
        f'gRPC service "{LIVENESS}"',
        "SERVING",
        "NOT_SERVING",
    )


def _probe(
    key: str,
    why: str,
    probe: Probe,
    action: dict[str, Any],
    notes: dict[str, str],
    extra: tuple[tuple[str, int, str], ...] = (),
) -> list[str]:
    """One probe: PyYAML writes the mapping (quoting included); the comments are woven in after,
    since PyYAML keeps none."""
    fields = [
        ("periodSeconds", probe.period, notes.get("periodSeconds", "")),
        ("timeoutSeconds", probe.timeout, notes.get("timeoutSeconds", "")),
        ("failureThreshold", probe.failures, notes.get("failureThreshold", "")),
        *extra,
    ]
    data = action | {n: v for n, v, _ in fields}
    dumped = yaml.safe_dump({key: data}, sort_keys=False, width=1 << 16).splitlines()
    comments = {f"  {name}: ": note for name, _, note in fields if note}
    lines = [dumped[0], *_comment(why, "  ")]
    for line in dumped[1:]:
        note = next((n for prefix, n in comments.items() if line.startswith(prefix)), "")
        if note and len(line) + 3 + len(note) <= WIDTH:
            line += f"  # {note}"
        elif note:
            lines += _comment(note, "  ")
        lines.append(line)
    return lines


def render(blueprint: Blueprint, max_load_seconds: float, grpc: bool = False) -> str:
    """The engine container's probes as a YAML fragment with the arithmetic in comments;
    ``grpc``: as ``grpc:`` probes on the gRPC health service (ValueError when it is off)."""
    t = target(blueprint, grpc)
    z = size(blueprint, max_load_seconds)
    text = "\n".join(
        [
            *_header(blueprint, z, t),
            *_startup(z, t),
            *_liveness(blueprint, z, t),
            *_readiness(blueprint, z, t),
        ]
    )
    return redact(text, blueprint.secrets)  # its secrets hidden: the one rule


def _header(b: Blueprint, z: Sizing, t: Target) -> list[str]:
    """Where the probes go and what sized them, and a warning for each setting that defeats
    them."""
    s = b.settings
    role = f"backend {s.backend}, mode {s.disaggregation_mode}, model type {s.model_type}"
    canary = "canary on" if z.canary else "no canary"
    if z.canary:
        canary += b.said.reaches
    lines = _comment(
        f"Probes for the engine container (paste them under it, not under the sidecar: a "
        f"liveness failure restarts only the container whose probe failed). They target the "
        f"health-sidecar on port {t.port} of the same pod, which answers from memory. Sized by "
        f"`health-sidecar probes --max-load-seconds {_secs(z.max_load)}"
        f"{' --grpc' if t.grpc else ''}` for {role}, {canary}."
    )
    if s.system_host not in BIND_ALL:
        lines += _comment(
            f"WARNING: DYN_SYSTEM_HOST={s.system_host}: the kubelet probes the pod IP, so the "
            "sidecar must bind 0.0.0.0 for these probes to reach it."
        )
    for warning in b.said.warnings:
        lines += _comment(warning)
    if z.hang_to_unready > READINESS_TARGET_SECONDS:
        lines += _comment(
            f"WARNING: a hung engine leaves rotation only after {_secs(z.hang_to_unready)} s, "
            f"above the {_secs(READINESS_TARGET_SECONDS)} s target: lower DYN_CANARY_WAIT_TIME, "
            "DYN_HEALTH_CHECK_REQUEST_TIMEOUT or SIDECAR_FAILURE_THRESHOLD."
        )
    return lines


def _startup(z: Sizing, t: Target) -> list[str]:
    st = z.startup
    ready_what = "the model is loaded and a canary passed" if z.canary else "the model is loaded"
    return _probe(
        "startupProbe",
        f"{t.ready} is {t.ok} once {ready_what}. Liveness and readiness wait for it, so a "
        f"load of up to {_secs(z.max_load)} s is never taken for a hang; after it, liveness "
        "takes over.",
        st,
        t.action(st.path, READINESS),
        {
            "timeoutSeconds": "answered from memory; headroom for a busy node",
            "failureThreshold": f"restarted only after {st.failures - 1} x {st.period} s = "
            f"{_secs(z.startup_budget)} s >= {_secs(z.max_load)} s load + "
            f"{_secs(z.load_to_ready)} s to ready ({z.policy.to_ready(z.canary)})",
        },
    )


def _liveness(b: Blueprint, z: Sizing, t: Target) -> list[str]:
    s, lv = b.settings, z.liveness
    if z.canary:
        restart = (
            f"a hung engine is restarted within {_secs(z.hang_to_restart)} s "
            f"({z.policy.to_notlive()} + {lv.failures} x {lv.period} s)"
        )
    else:
        restart = (
            "without a canary only an engine whose own health route hangs or answers 5xx is "
            f"restarted, within {_secs(z.hang_to_restart)} s"
        )
    busy = "while canaries still pass however busy it is" if z.canary else "while it is busy"
    clocks = "; ".join(f"{cause} ({cause.brief})" for cause in b.causes)
    return _probe(
        "livenessProbe",
        f"{t.live} fails only after {_secs(s.liveness_window)} s on one liveness clock "
        f"({clocks}); never while it loads, {busy}, or while it refuses connections; "
        f"{restart}.",
        lv,
        t.action(lv.path, LIVENESS),
        {
            "failureThreshold": f"failures span {_secs(z.liveness_tolerance)} s: a sidecar "
            "restart does not restart the engine",
        },
        (("terminationGracePeriodSeconds", LIVENESS_GRACE, "a hung engine drains nothing"),),
    )


def _readiness(b: Blueprint, z: Sizing, t: Target) -> list[str]:
    s, rd = b.settings, z.readiness
    if z.canary:
        detect = (
            f"{t.ready} turns {t.bad} within {_secs(z.hang_to_notready)} s of a hang "
            f"({z.policy.to_notready()}: {s.failure_threshold} failed canaries) and "
            "already applies that hysteresis, so the kubelet needs few failures."
        )
        if z.stall_to_notready is not None:
            detect += (
                f" Under load, when the engine publishes its metrics, {t.ready} turns {t.bad} "
                f"within {_secs(z.stall_to_notready)} s of its counters stopping "
                f"({z.policy.to_stalled()})."
            )
    else:
        detect = (
            f"{t.ready} follows the engine's own health route (no canary): {t.bad} within "
            f"{_secs(z.hang_to_notready)} s of it failing or refusing. A hang behind a 200 "
            "health route is not seen without a canary."
        )
    if b.said.readiness:
        detect += " " + b.said.readiness
    return _probe(
        "readinessProbe",
        detect,
        rd,
        t.action(rd.path, READINESS),
        {
            "failureThreshold": f"out of rotation within {_secs(z.hang_to_notready)} + "
            f"{rd.failures} x {rd.period} = {_secs(z.hang_to_unready)} s",
        },
        (("successThreshold", 1, "ready as soon as the sidecar says so"),),
    )
