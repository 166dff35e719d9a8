"""Loading: the one entry point, :func:`load_settings`. It returns valid settings or raises
:class:`ConfigError`, whose lines each name one variable, the value it had (secrets hidden) and
what was expected: every malformed variable at once, then every rule across variables that is
broken. Nothing falls back silently.

What the configuration cannot know by itself, the composition root hands in as a
:class:`Catalog`: the names its tables hold (the backends, the transports, a transport's
services), the variables a transport hands on, and the rules of the parts it would build (each
transport's, and those that need what it resolves). So one pass says all that is wrong.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import ValidationError

from sidecar.config.fields import Settings
from sidecar.config.names import check_names, names_set
from sidecar.config.rules import broken_rules, env_name, expected, shown
from sidecar.config.values import CHOICES, choice_expected


class ConfigError(Exception):
    """Invalid configuration. Each line names one variable, its value, and what was expected."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class Catalog:
    """What the composition root knows that the configuration cannot."""

    # field -> the values it may take (SIDECAR_BACKEND: the engines' names)
    choices: Mapping[str, Collection[str]] = field(default_factory=dict)
    # names, or prefixes ending in _, that a transport hands on (never refused as misspelled)
    passes: tuple[str, ...] = ()
    # the lines of the rules the parts' settings break (run once every variable is valid)
    problems: Callable[[Settings], list[str]] = lambda s: []


def _error_lines(exc: ValidationError, catalog: Catalog) -> list[str]:
    by_alias = {env_name(name): name for name in Settings.model_fields}
    lines = []
    for err in exc.errors(include_url=False):
        key = str(err["loc"][0]) if err["loc"] else ""
        name = by_alias.get(key, key)
        known = name in Settings.model_fields
        detail = err["msg"].removeprefix("Value error, ")
        want = expected(name) if known else "a valid value"
        if name in catalog.choices:
            want, detail = choice_expected(catalog.choices[name]), ""
        said = f"{env_name(name) if known else key}={shown(name, err['input'])}: expected {want}"
        lines.append(f"{said} ({detail})" if detail else said)
    return lines


def validated(settings: Settings, catalog: Catalog | None = None) -> list[str]:
    """What is wrong with settings whose variables are each valid: a value its table does not
    hold, then every broken rule across variables (the configuration's and the parts')."""
    catalog = catalog or Catalog()
    unknown = [
        f"{env_name(name)}={shown(name, value)}: expected {choice_expected(values)}"
        for name, values in catalog.choices.items()
        if (value := getattr(settings, name)) is not None and value not in values
    ]
    return unknown or broken_rules(settings) + catalog.problems(settings)


def load_settings(
    env_file: str | None = None,
    defaults: Mapping[str, str] | None = None,
    catalog: Catalog | None = None,
) -> Settings:
    """Read and validate the configuration from the environment and an optional env file (the
    environment wins). ``defaults`` give values to variables set in neither. A misspelled name
    is an error like a malformed value."""
    catalog = catalog or Catalog()
    kwargs: dict[str, Any] = {}
    present = set(os.environ)
    if env_file is not None:
        if not Path(env_file).is_file():
            raise ConfigError([f"--env-file={env_file!r}: expected an existing file"])
        try:
            Path(env_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                [f"--env-file={env_file!r}: expected UTF-8 text (byte {exc.start} is not)"]
            ) from None
        except OSError as exc:
            said = f"--env-file={env_file!r}: cannot be read: {exc.strerror}"
            raise ConfigError([said]) from None
        kwargs["_env_file"] = env_file
        present |= {k for k, v in dotenv_values(env_file).items() if v}
    for name, value in (defaults or {}).items():
        if name not in present:
            kwargs[name] = value
    refused = list(check_names(names_set(env_file), catalog.passes).refused)
    token = CHOICES.set(catalog.choices)
    try:
        settings = Settings(**kwargs)
    except ValidationError as exc:
        raise ConfigError(refused + _error_lines(exc, catalog)) from None
    finally:
        CHOICES.reset(token)
    errors = refused + validated(settings, catalog)
    if errors:
        raise ConfigError(errors)
    return settings
