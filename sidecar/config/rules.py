"""The rules across variables that hold whatever the engine and transport: each a row of
:data:`RULES`, checked in order once every variable is valid on its own. A transport's own rules
live in its module (``sidecar/transports/<transport>/``) and a rule that needs what the sidecar
resolves (a rank pin, the transfer probe) in the resolution (``sidecar/wiring/resolve.py``); the
loader runs them all, in one pass (``load.py``).

How a value is shown in an error line (:func:`shown`) is here too, with the one rule for
secrets (:mod:`sidecar.redact`): a token is never shown, a URL's credentials never.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from sidecar.config.fields import Settings
from sidecar.core.vocabulary import KV_TRANSFER
from sidecar.redact import HIDDEN, redact, scrubbed, secret_name
from sidecar.surface.routes import RESERVED_ROUTES

MAX_VALUE_SHOWN = 80


def env_name(field: str) -> str:
    alias = Settings.model_fields[field].validation_alias
    assert isinstance(alias, str)
    return alias


def expected(field: str) -> str:
    extra = Settings.model_fields[field].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["expected"])


def shown(field: str, value: Any) -> str:
    """A variable's value as an error line shows it: secrets hidden (a token whole, a URL's
    credentials, a payload's fields named like keys), long values cut."""
    if isinstance(value, SecretStr) or (field in Settings.model_fields and secret_name(field)):
        return HIDDEN
    value = scrubbed(value)
    text = redact(value) if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > MAX_VALUE_SHOWN:
        text = text[: MAX_VALUE_SHOWN - 3] + "..."
    return repr(text)


@dataclass(frozen=True)
class Rule:
    """One rule across variables: when ``broken`` holds, the line names the variable to change
    (``blame``, a field), its value (``said``; None: unset, no value) and what was
    ``expected``."""

    blame: str | Callable[[Settings], str]
    broken: Callable[[Settings], bool]
    expected: Callable[[Settings], str]
    said: Callable[[Settings], str | None] | None = None

    def line(self, s: Settings) -> str:
        field = self.blame(s) if callable(self.blame) else self.blame
        value = self.said(s) if self.said is not None else shown(field, getattr(s, field))
        return (
            f"{env_name(field)}{'' if value is None else f'={value}'}: expected {self.expected(s)}"
        )


def unset_with(field: str, why: Callable[[Settings], str]) -> Rule:
    """``field`` must be unset, for the reason ``why`` gives (a rule the caller says when)."""
    return Rule(field, lambda s: getattr(s, field) is not None, lambda s: f"unset ({why(s)})")


def _taken_by_grpc(s: Settings) -> str:
    return "system_port" if s.grpc_port == s.system_port else "control_port"


def _blamed_path(s: Settings) -> str:
    """Of two equal probe paths, the one the user set (both set: the live path)."""
    return "health_path" if "live_path" not in s.model_fields_set else "live_path"


# Every rule across variables that holds whatever the engine and transport, in this order.
RULES: tuple[Rule, ...] = (
    *(
        Rule(
            field,
            lambda s, f=field: getattr(s, f) in RESERVED_ROUTES,
            lambda s, f=field: f"a path not already used by {RESERVED_ROUTES[getattr(s, f)]}",
        )
        for field in ("health_path", "live_path")
    ),
    Rule(
        "use_endpoint_health_status",
        lambda s: KV_TRANSFER in s.use_endpoint_health_status and s.kv_peer_url is None,
        lambda s: f"{KV_TRANSFER!r} listed only with {env_name('kv_peer_url')} set",
    ),
    Rule(
        "dp_min_ready_ranks",
        lambda s: (
            s.dp_min_ready_ranks is not None
            and isinstance(s.dp_ranks, int)
            and s.dp_min_ready_ranks > s.dp_ranks
        ),
        lambda s: f"at most {env_name('dp_ranks')} ({s.dp_ranks})",
        lambda s: str(s.dp_min_ready_ranks),
    ),
    Rule(
        "registration_path",
        lambda s: s.registration is not None and s.registration_path is not None,
        lambda s: (
            f"unset with {env_name('registration')} (the registration check asks the gRPC "
            "health service instead)"
        ),
    ),
    Rule(
        "control_port",
        lambda s: s.control_port is not None and s.control_port == s.system_port,
        lambda s: (
            f"a port other than {env_name('system_port')}'s (the control routes are never "
            "served to the pod network)"
        ),
        lambda s: str(s.control_port),
    ),
    Rule(
        "grpc_port",
        lambda s: s.grpc_port is not None and s.grpc_port in (s.system_port, s.control_port),
        lambda s: (
            f"a port other than {env_name(_taken_by_grpc(s))}'s (the gRPC health service has "
            "a port of its own)"
        ),
        lambda s: str(s.grpc_port),
    ),
    Rule(
        "control_token",
        lambda s: s.control_token is not None and s.control_port is None,
        lambda s: (
            f"{env_name('control_port')} too (the token guards the control routes, which "
            "are off without a port)"
        ),
        lambda s: "<set>",
    ),
    Rule(
        _blamed_path,
        lambda s: s.health_path == s.live_path,
        lambda s: (
            "a path not already used by "
            f"{env_name('live_path' if _blamed_path(s) == 'health_path' else 'health_path')}"
        ),
        lambda s: repr(s.health_path),
    ),
)


def broken_rules(s: Settings, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """The line of every rule the settings break, in order."""
    return [rule.line(s) for rule in rules if rule.broken(s)]
