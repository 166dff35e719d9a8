"""What the sidecar will do, worked out once from the settings: one :class:`Blueprint`.

The engine (``sidecar/engines/``) says what each role needs; the transport
(``sidecar/transports/``) resolves its wire's prober and what it reads of the engine; this module
puts them together: each endpoint's plan, the policy and the schedule, the rank count, whether
the engine's metrics are read and the stall rule can run, which liveness clocks can run, and what
this machine lacks. The monitor runs the blueprint; ``--check-config``, ``probes``, ``demo`` and
the generated docs only print it.

The rules that need what is resolved here (a rank pin, the transfer probe, what a canary leaves)
are checked here too, and handed to the configuration's loader with each transport's own
(:func:`catalog`), so one pass says all that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from sidecar.config import (
    Catalog,
    ConfigError,
    Settings,
    env_name,
    load_settings,
    shown,
    validated,
)
from sidecar.core.evidence.policy import Policy, default_stall_window
from sidecar.core.schedule import Timing
from sidecar.core.vocabulary import GENERATE, KV_TRANSFER, Cause, Role
from sidecar.engines import ENGINES, Engine
from sidecar.probes.base import CanaryPlan
from sidecar.probes.plan import plan_canary, plan_transfer_probe
from sidecar.redact import redact
from sidecar.surface.view import About, ControlConfig
from sidecar.transports import TRANSPORTS, Transport
from sidecar.transports.seam import Route, Said

TRANSFER_ROLE = "the transfer probe speaks vLLM's NIXL connector from a decode worker"


@dataclass(frozen=True)
class Blueprint:
    """Everything the sidecar decided for one configuration."""

    settings: Settings
    engine: Engine
    transport: Transport
    route: Route
    plans: Mapping[str, CanaryPlan]  # each endpoint's plan, generate first
    policy: Policy
    timing: Timing
    ranks: int | Literal["auto"]  # the data-parallel ranks as they apply
    causes: tuple[Cause, ...]  # the liveness clocks that can run
    metrics_off: str | None  # why the engine's metrics are not read (None: they are)
    routes_off: str | None  # why the engine's sleep and fault routes are not asked (None: are)
    stall_off: str | None  # why the stall rule cannot run (None: it can)
    said: Said
    missing: tuple[str, ...]  # what this machine lacks to start it (an extra, a directory)
    about: About
    control: ControlConfig

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values the user set as tokens: hidden wherever they would show."""
        s = self.settings
        return tuple(v.get_secret_value() for v in (s.engine_api_key, s.control_token) if v)

    @property
    def plan(self) -> CanaryPlan:
        """The generate endpoint's plan."""
        return self.plans[GENERATE]

    @property
    def canary(self) -> bool:
        return self.plan.enabled

    @property
    def metrics_read(self) -> bool:
        return self.metrics_off is None


def role_of(s: Settings) -> Role:
    return Role(s.disaggregation_mode, s.model_type)


def stall_window_of(s: Settings) -> float:
    """SIDECAR_STALL_WINDOW, or, unset, :func:`default_stall_window`."""
    if s.stall_window is not None:
        return s.stall_window
    return default_stall_window(s.request_timeout, s.canary_wait_time)


def policy_of(s: Settings) -> Policy:
    """The thresholds and timings the evidence sources and the verdict follow."""
    return Policy(
        failure_threshold=s.failure_threshold,
        success_threshold=s.success_threshold,
        wait=s.canary_wait_time,
        retry=s.retry_interval,
        timeout=s.request_timeout,
        liveness_window=s.liveness_window,
        stall_window=stall_window_of(s),
        metrics_interval=s.metrics_interval,
        registration_interval=s.registration_interval,
        check_answer=s.check_answer,
    )


def _metrics_off(s: Settings, plan: CanaryPlan, route: Route) -> str | None:
    if not plan.enabled:
        return "no canary: the metrics would have nothing to confirm"
    if not s.progress_enabled:
        return "SIDECAR_PROGRESS_ENABLED=false"
    if route.metrics_off is not None:
        return f"{route.metrics_off}: the canary alone decides; the stall rule is off"
    if not plan.reads.progress.every() and plan.reads.load is None:
        return (
            f"{s.backend}'s {s.disaggregation_mode} worker publishes no series that shows its "
            "work: the canary alone decides"
        )
    return None


def _stall_off(s: Settings, plan: CanaryPlan, metrics_off: str | None) -> str | None:
    spec = plan.reads.progress
    if metrics_off is not None:
        return "the engine's metrics are not read"
    if not spec.in_flight_shown:
        return "no request shows in flight"
    if not spec.counters:
        return f"nothing read over {s.transport} counts the engine's steps"
    if not spec.step_series():
        return f"{s.backend} has no counter known to move at every step"
    return None


def ranks_of(s: Settings, plan: CanaryPlan) -> int | Literal["auto"]:
    """SIDECAR_DP_RANKS as it applies: unset is auto where a canary can be pinned to one rank and
    the engine's metrics tell the ranks apart, else 1."""
    if s.dp_ranks is not None:
        return s.dp_ranks
    return "auto" if plan.reads.pin is not None else 1


def _causes(plan: CanaryPlan, route: Route, stall_off: str | None) -> tuple[Cause, ...]:
    """The liveness clocks that can run for a worker checked so."""
    runs = {
        Cause.REGISTRATION: not plan.enabled,
        Cause.CANARY: plan.enabled,
        Cause.STALL: plan.enabled and stall_off is None,
        Cause.FAULT: plan.reads.fault_path is not None,
        **{cause: True for cause in route.checking.clocks},
    }
    return tuple(cause for cause in Cause if runs.get(cause))


def missing_here(s: Settings, transport: Transport) -> tuple[str, ...]:
    """What this machine lacks that start-up needs: the transport's extra, a mounted directory."""
    lacks = []
    if (why := transport.missing()) is not None:
        lacks.append(why)
    storage = s.ec_storage_path
    if storage is not None and not Path(storage).is_dir():
        lacks.append(
            f"SIDECAR_EC_STORAGE_PATH={storage}: expected a directory here (it is not one)"
        )
    return tuple(lacks)


def resolve(s: Settings) -> Blueprint:
    """The blueprint of valid settings (:func:`load`'s: every rule holds)."""
    engine, transport, role = ENGINES[s.backend], TRANSPORTS[s.transport], role_of(s)
    rule = engine.canary(role, bootstrap_port=s.sglang_bootstrap_port)
    route = transport.route(s, engine, role, rule)
    plan = plan_canary(
        route.prober,
        route.reads,
        kind=transport.name,
        enabled=s.health_check_enabled,
        payload=s.health_check_payload,
    )
    routes_off = route.routes_off
    if not (route.checking.http or plan.enabled):
        # Registered without a canary over a check that is not HTTP: the engine may serve no HTTP
        # at all (vLLM's gRPC server does not), and only a canary would show that it does.
        plan = replace(plan, reads=replace(plan.reads, sleep_path=None, fault_path=None))
        routes_off = routes_off or (
            f"registered by {route.checking.asked} without a canary: the engine may serve no HTTP"
        )
    plans = {GENERATE: plan}
    if s.kv_peer_url is not None:
        plans[KV_TRANSFER] = plan_transfer_probe(
            route.prober, plan.reads, s.kv_peer_url, s.kv_probe_interval
        )
    metrics_off = _metrics_off(s, plan, route)
    stall_off = _stall_off(s, plan, metrics_off)
    ranks = ranks_of(s, plan)
    timing = Timing(
        registration=s.registration_interval,
        metrics=s.metrics_interval if metrics_off is None else None,
        transfer=s.kv_probe_interval,
        count_ranks=ranks == "auto" and plan.enabled,
    )
    return Blueprint(
        settings=s,
        engine=engine,
        transport=transport,
        route=route,
        plans=plans,
        policy=policy_of(s),
        timing=timing,
        ranks=ranks,
        causes=_causes(plan, route, stall_off),
        metrics_off=metrics_off,
        routes_off=routes_off,
        stall_off=stall_off,
        said=transport.said(s, plan, route),
        missing=missing_here(s, transport),
        about=About(
            health_path=s.health_path,
            live_path=s.live_path,
            backend=s.backend,
            mode=s.disaggregation_mode.value,
            transport=s.transport,
            canaries=s.health_check_enabled,
            engine_url=redact(s.engine_url),
        ),
        control=ControlConfig(
            token=s.control_token.get_secret_value() if s.control_token else None,
            maintenance_max=s.maintenance_max,
        ),
    )


def _resolved_problems(s: Settings, transport: Transport) -> list[str]:
    """The rules that need what is resolved: a rank pin, the transfer probe, leftovers."""
    engine, role = ENGINES[s.backend], role_of(s)
    rule = engine.canary(role, bootstrap_port=s.sglang_bootstrap_port)
    route = transport.route(s, engine, role, rule)
    lines = []
    if s.dp_ranks not in (None, 1) and route.reads.pin is None:
        why = route.unpinned or (
            f"{s.backend}'s {s.disaggregation_mode} worker cannot be sent a canary pinned to a "
            "data-parallel rank, so ranks cannot be told apart"
        )
        lines.append(f"{env_name('dp_ranks')}={s.dp_ranks}: expected 1 ({why})")
    if s.kv_peer_url is not None:
        if engine.transfer_role is not s.disaggregation_mode:
            lines.append(
                f"{env_name('kv_peer_url')}={shown('kv_peer_url', s.kv_peer_url)}: expected unset "
                f"({TRANSFER_ROLE}; this is {s.backend} {s.disaggregation_mode})"
            )
        elif not transport.transfer_probe:
            lines.append(
                f"{env_name('kv_peer_url')}={shown('kv_peer_url', s.kv_peer_url)}: expected unset "
                f"with SIDECAR_TRANSPORT={s.transport} (the transfer probe speaks vLLM's HTTP API)"
            )
    if s.ec_storage_path is not None and route.prober.leaves is None:
        lines.append(
            f"{env_name('ec_storage_path')}={shown('ec_storage_path', s.ec_storage_path)}: "
            "expected unset (only a canary that leaves files writes there: a vLLM encoder's, "
            "SIDECAR_BACKEND=vllm, SIDECAR_DISAGGREGATION_MODE=encode, "
            "SIDECAR_MODEL_TYPE=multimodal, over http or dynamo)"
        )
    return lines


def problems(s: Settings) -> list[str]:
    """Every transport's rules for these settings: the variables only another transport reads,
    the chosen one's own rules, and the rules that need what is resolved."""
    lines = [
        f"{env_name(field)}={shown(field, getattr(s, field))}: expected unset "
        f"(SIDECAR_TRANSPORT={s.transport} does not read it: it is {what}, with "
        f"SIDECAR_TRANSPORT={other.name})"
        for other in TRANSPORTS.values()
        if other.name != s.transport
        for field, what in other.owns.items()
        if getattr(s, field) is not None
    ]
    chosen = TRANSPORTS[s.transport]
    lines += chosen.problems(s)
    if lines:
        return lines
    return _resolved_problems(s, chosen)


def catalog() -> Catalog:
    """What the configuration is told of the tables: the names they hold, the variables the
    transports hand on, and the rules of the parts."""
    choices: dict[str, tuple[str, ...]] = {
        "backend": tuple(ENGINES),
        "transport": tuple(TRANSPORTS),
    }
    for transport in TRANSPORTS.values():
        choices.update(transport.choices())
    passes = tuple(p for t in TRANSPORTS.values() for p in t.passes)
    return Catalog(choices=choices, passes=passes, problems=problems)


def check(s: Settings) -> list[str]:
    """What is wrong with settings made without the loader (each variable valid on its own):
    the lines :func:`load` would raise."""
    return validated(s, catalog())


def load(env_file: str | None = None, defaults: Mapping[str, str] | None = None) -> Settings:
    """The configuration, validated whole: the variables, the rules across them, each
    transport's, and those of what is resolved. Raises ConfigError."""
    return load_settings(env_file, defaults, catalog())


__all__ = [
    "Blueprint",
    "ConfigError",
    "catalog",
    "check",
    "load",
    "policy_of",
    "problems",
    "resolve",
]
