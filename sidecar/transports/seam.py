"""The seam every transport fills in: what a transport is, in one class per transport package
(``sidecar/transports/<transport>/__init__.py``), listed once in ``sidecar/transports/__init__``.

A transport says, for a configuration:

- its configuration rules (:meth:`Transport.rules`, checked when it is chosen; :attr:`owns`, the
  variables only it reads, refused with any other transport), the values of its own variables
  (:meth:`Transport.choices`) and the variables it hands on (:attr:`passes`);
- what it resolves (:meth:`Transport.route`, pure): its wire's prober for the engine and role,
  what is read of the engine beside the canary, how registration is checked, where the engine's
  HTTP routes are, and why metrics or rank pins are off where they are;
- what ``--check-config`` and ``probes`` say of it (:meth:`Transport.said`);
- its I/O (:meth:`Transport.open`, on the monitor's loop): the canary's probe, the registration
  check (one signature for every transport: :class:`~sidecar.probes.exchange.Registration`) and,
  where it has one, its own source of the engine's load.

Nothing outside a transport's package branches on which transport it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sidecar.config import Rule, Settings
from sidecar.core.vocabulary import Cause, Role
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryPlan, Prober, Reads
from sidecar.probes.exchange import MetricsSource, Registration, Sweeper
from sidecar.probes.kinds import Probe
from sidecar.runtime.engine import EngineClient


@dataclass(frozen=True)
class Checking:
    """How the engine's registration is checked, as resolved."""

    asked: str  # what is asked, as --check-config names it ("GET /health")
    answers: str  # what a registered engine answers ("200", "SERVING")
    # The liveness clocks this check can start, beyond the canary's.
    clocks: tuple[Cause, ...] = ()
    # How the liveness line says an answer that stops every clock ("with non-200").
    otherwise: str = "with non-200"
    # Whether the engine's other HTTP routes (sleep, fault tolerance) can be asked without a
    # canary to show that the engine serves HTTP at all.
    http: bool = True


@dataclass(frozen=True)
class Said:
    """What ``--check-config`` and ``probes`` say of the transport; the rest they say from the
    blueprint, whatever the transport."""

    engine: tuple[str, ...]  # after the engine line: how the engine is found and checked
    request: tuple[str, ...]  # the canary's request as it goes out (with a canary)
    passes: str  # when a canary passes ("the whole call ends within 3 s, ...")
    # How the engine's metrics are read, as --check-config says it (empty: GET and the path).
    metrics: str = ""
    # Where the served model comes from, when the canary names it and SIDECAR_MODEL is unset.
    model: str = "discovered from GET /v1/models at each registration"
    reaches: str = ""  # how the probes' header says the canary travels
    warnings: tuple[str, ...] = ()  # what the probes' header warns of
    readiness: str = ""  # what the readiness probe's comment adds


@dataclass(frozen=True)
class Route:
    """What a transport resolved for one configuration."""

    prober: Prober
    reads: Reads
    checking: Checking
    http_url: str | None  # where the engine's HTTP routes (its metrics among them) are read
    metrics_off: str | None = None  # why the engine's metrics are never read, else None
    unpinned: str | None = None  # why canaries are never pinned to a rank, else None
    # Why the engine's own HTTP routes beside the canary (sleep, fault tolerance) are never
    # asked over this transport, else None.
    routes_off: str | None = None


@dataclass(frozen=True)
class Opening:
    """What a transport opens its I/O with, on the monitor's loop: each part it makes is pushed
    on ``stack`` (closed in reverse order when the monitor stops)."""

    settings: Settings
    plan: CanaryPlan
    route: Route
    stack: contextlib.AsyncExitStack
    clock: Callable[[], float]
    routes: EngineClient | None  # the engine's HTTP routes, at route.http_url
    client: Callable[[str], EngineClient]  # a canaries' client at a URL (no connection limit)
    sweeper: Sweeper | None  # removes what canaries caused the engine to write
    private_dir: str | None  # what :meth:`Transport.prepare` made


@dataclass(frozen=True)
class Opened:
    """A transport's I/O: the canary's probe, the registration check, and where the engine's
    load is read when not from its HTTP metrics (None: ``Opening.routes``)."""

    probe: Probe
    registration: Registration
    metrics: MetricsSource | None = None


class Transport(ABC):
    """One transport. Subclasses live one per package and fill in what differs."""

    name: ClassVar[str]  # SIDECAR_TRANSPORT
    summary: ClassVar[str]  # one sentence: what it reaches and how
    engine_url: ClassVar[str]  # what SIDECAR_ENGINE_URL is with it
    grpc_url: ClassVar[bool] = False  # SIDECAR_ENGINE_URL is grpc://HOST:PORT (else http(s))
    # The extra that installs what it needs, and the module that extra brings (looked up at
    # start, never imported for it); None: in the base install.
    extra: ClassVar[str | None] = None
    module: ClassVar[str | None] = None
    # Variables it hands on to a client of its own (names, or prefixes ending in _).
    passes: ClassVar[tuple[str, ...]] = ()
    # The variables only this transport reads (field -> what for): unset with any other.
    owns: ClassVar[Mapping[str, str]] = {}
    # Whether the KV transfer probe (SIDECAR_KV_PEER_URL: vLLM's HTTP API) can run beside it.
    transfer_probe: ClassVar[bool] = False
    # The engines it reaches (SIDECAR_BACKEND), and why only those.
    backends: ClassVar[tuple[str, ...]]
    backends_why: ClassVar[str] = ""

    def choices(self) -> Mapping[str, tuple[str, ...]]:
        """The values its own variables may take (field -> values)."""
        return {}

    def rules(self) -> tuple[Rule, ...]:
        """Its rules across variables, checked when it is chosen."""
        return ()

    def problems(self, s: Settings) -> list[str]:
        """What the settings break of this transport's rules, when it is chosen: the backends
        it reaches, the engine URL's scheme, then its own rules."""
        rules = (
            Rule(
                "backend",
                lambda s: s.backend not in self.backends,
                lambda s: (
                    f"one of {', '.join(self.backends)} with SIDECAR_TRANSPORT={self.name} "
                    f"({self.backends_why})"
                ),
            ),
            Rule(
                "engine_url",
                lambda s: self.grpc_url != s.engine_url.startswith("grpc:"),
                lambda s: f"{self.engine_url} with SIDECAR_TRANSPORT={self.name}",
            ),
            *self.rules(),
        )
        return [rule.line(s) for rule in rules if rule.broken(s)]

    @abstractmethod
    def route(self, s: Settings, engine: Engine, role: Role, rule: Canary | NoCanary) -> Route:
        """Resolve this transport's part of the sidecar's plan (pure)."""

    @abstractmethod
    def said(self, s: Settings, plan: CanaryPlan, route: Route) -> Said:
        """What ``--check-config`` and ``probes`` say of it."""

    def missing(self) -> str | None:
        """What this machine lacks for it (its extra not installed), as one line; None."""
        if self.module is None:
            return None
        try:
            found = importlib.util.find_spec(self.module)
            why = f"No module named {self.module!r}"
        except ImportError as exc:
            found, why = None, f"{type(exc).__name__}: {exc}"
        if found is not None:
            return None
        return (
            f"SIDECAR_TRANSPORT={self.name}: expected the {self.extra} extra installed "
            f"({install_hint(self.extra or '')}): {why}"
        )

    def prepare(self, s: Settings) -> str | None:
        """What must happen in the main thread before any other starts (Dynamo's environment);
        what it made (a private directory), for :class:`Opening`."""
        return None

    @abstractmethod
    async def open(self, o: Opening) -> Opened:
        """Make its I/O parts on the monitor's loop, each pushed on ``o.stack``."""


MODEL_PLACEHOLDER = "<served model>"


def shown_body(plan: CanaryPlan, s: Settings) -> dict[str, Any]:
    """The canary's body as --check-config shows it: the model a placeholder when it is
    discovered, the bootstrap room fresh per canary, each inline image named, not shown."""
    return _short(plan.request(s.model or MODEL_PLACEHOLDER, "canary-<uuid>").body)


def _short(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: "<fresh per canary>" if key == "bootstrap_room" else _short(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_short(item) for item in value]
    if isinstance(value, str) and value.startswith("data:") and "," in value:
        kind = value[len("data:") : value.index(",")]
        return f"data:{kind},<{len(value) - len(kind) - 6} characters: a new image per canary>"
    return value


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` where this sidecar runs: the pip of its own Python, from
    the source checkout it was installed from (an editable install) or as a package."""
    root = Path(__file__).resolve().parents[2]
    pip = f"{sys.executable} -m pip install"
    if (root / "pyproject.toml").is_file() and (root / "sidecar").is_dir():
        return f"{pip} -e '{root}[{extra}]'"
    return f"{pip} 'health-sidecar[{extra}]'"
