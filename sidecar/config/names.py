"""The names of the variables: a misspelled name is no exception.

SIDECAR_ENGIN_URL would leave the engine URL at its default, DYN_HEALTH_CHECK_ENABLE the canaries
off. Every SIDECAR_* name the sidecar does not read is refused; a DYN_* name is refused when it is
neither the sidecar's nor one of Dynamo's own (the sidecar shares the pod's environment with
Dynamo's worker: sidecar/dynamo_variables.txt), nor handed on by a transport (Dynamo's runtime
client takes its DYN_TCP_*, NATS_*, ... variables), and is close to one the sidecar reads. Other
names are ignored, and --check-config says so.

A refused name's hint points at the variable that does what the name says (:data:`GUESSES`: the
names users guess for the canary's timeout, wait, interval and port, across the SIDECAR_ and DYN_
prefixes), else at the nearest name the sidecar reads.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dotenv import dotenv_values

from sidecar.config.fields import Settings

SIDECAR_PREFIX, DYNAMO_PREFIX = "SIDECAR_", "DYN_"
# How close a DYN_* name must be to one the sidecar reads to be taken for its misspelling
# (difflib's ratio: DYN_HEALTH_CHECK_ENABLE to ..._ENABLED is 0.98, DYN_CANARY_WAIT to
# DYN_CANARY_WAIT_TIME 0.86); suggestions for a SIDECAR_* name need less.
MISSPELLED, SUGGESTED = 0.85, 0.6
DYNAMO_VARIABLES = Path(__file__).resolve().parents[1] / "dynamo_variables.txt"

#: What a guessed name means, by the words in it (after its prefix): the variable that does it.
#: Checked before the nearest spelling, which would point a guess at a name that merely looks
#: alike (SIDECAR_CANARY_TIMEOUT is nearest to SIDECAR_DRAIN_TIMEOUT). A DYN_* name is taken for
#: a guess only when it says CANARY: the pod's other DYN_* names are Dynamo's business.
GUESSES: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"CANARY", "TIMEOUT"}), "DYN_HEALTH_CHECK_REQUEST_TIMEOUT"),
    (frozenset({"REQUEST", "TIMEOUT"}), "DYN_HEALTH_CHECK_REQUEST_TIMEOUT"),
    (frozenset({"HEALTH", "TIMEOUT"}), "DYN_HEALTH_CHECK_REQUEST_TIMEOUT"),
    (frozenset({"CANARY", "WAIT"}), "DYN_CANARY_WAIT_TIME"),
    (frozenset({"CANARY", "INTERVAL"}), "DYN_CANARY_WAIT_TIME"),
    (frozenset({"CHECK", "INTERVAL"}), "DYN_CANARY_WAIT_TIME"),
    (frozenset({"CANARY", "ENABLED"}), "DYN_HEALTH_CHECK_ENABLED"),
    (frozenset({"CANARY", "PAYLOAD"}), "DYN_HEALTH_CHECK_PAYLOAD"),
    (frozenset({"PORT"}), "DYN_SYSTEM_PORT"),
    (frozenset({"HOST"}), "DYN_SYSTEM_HOST"),
)


def read_names() -> frozenset[str]:
    """Every variable the sidecar itself reads."""
    return frozenset(str(field.validation_alias) for field in Settings.model_fields.values())


def dynamo_names() -> frozenset[str]:
    """Dynamo's own variables (ai-dynamo-runtime 1.6.1 and its operator): never refused."""
    text = DYNAMO_VARIABLES.read_text(encoding="utf-8")
    return frozenset(line for line in text.split() if line.startswith(DYNAMO_PREFIX))


def guessed(name: str, ours: frozenset[str]) -> str | None:
    """The variable a guessed name means by its words (:data:`GUESSES`), if it is one we read."""
    words = set(name.removeprefix(SIDECAR_PREFIX).removeprefix(DYNAMO_PREFIX).split("_"))
    for needs, meant in GUESSES:
        if needs <= words and meant in ours and meant != name:
            return meant
    return None


def _nearest_sidecar(name: str, ours: Iterable[str], cutoff: float) -> str | None:
    """The SIDECAR_* name the sidecar reads that ``name`` is closest to, compared after the
    prefix they share, at least ``cutoff`` alike (difflib's ratio); None when none is."""
    tails = {n.removeprefix(SIDECAR_PREFIX): n for n in ours if n.startswith(SIDECAR_PREFIX)}
    near = difflib.get_close_matches(name.removeprefix(SIDECAR_PREFIX), sorted(tails), 1, cutoff)
    return tails[near[0]] if near else None


@dataclass(frozen=True)
class Names:
    """What the variables' names say: lines refusing the misspelled ones, and the ones ignored
    (name, why)."""

    refused: tuple[str, ...]
    ignored: tuple[tuple[str, str], ...]


def check_names(names: Iterable[str], passes: Iterable[str] = ()) -> Names:
    """Judge the names of the variables set (the environment's and the env file's); ``passes``:
    the names, or prefixes ending in ``_``, a transport hands on to a client of its own."""
    ours, dynamos, handed = read_names(), dynamo_names(), tuple(passes)
    dyns = [n for n in ours if n.startswith(DYNAMO_PREFIX)]
    refused: list[str] = []
    ignored: list[tuple[str, str]] = []
    for name in sorted(set(names) - ours):
        if name.startswith(SIDECAR_PREFIX):
            # A likely typo of a name we read first; then what its words mean; then anything
            # near.
            near = (
                _nearest_sidecar(name, ours, MISSPELLED)
                or guessed(name, ours)
                or _nearest_sidecar(name, ours, SUGGESTED)
            )
            hint = f"did you mean {near}?" if near else "docs/reference/configuration.md has them"
            refused.append(f"{name}: expected a variable the sidecar reads ({hint})")
        elif not name.startswith(DYNAMO_PREFIX):
            continue
        elif name in dynamos:
            ignored.append((name, "Dynamo's own: the worker reads it"))
        elif any(name == p or (p.endswith("_") and name.startswith(p)) for p in handed):
            ignored.append((name, "passed to Dynamo's runtime client (SIDECAR_TRANSPORT=dynamo)"))
        elif near := next(
            iter(difflib.get_close_matches(name, sorted(dyns), 1, MISSPELLED)), None
        ) or (guessed(name, ours) if "_CANARY_" in f"{name}_" else None):
            refused.append(
                f"{name}: expected a variable the sidecar or Dynamo reads (did you mean {near}?)"
            )
        else:
            ignored.append((name, "neither the sidecar's nor Dynamo's, nor close to the sidecar's"))
    return Names(tuple(refused), tuple(ignored))


def names_set(env_file: str | None = None) -> set[str]:
    """The names of the variables set: the environment's, and the env file's."""
    names = set(os.environ)
    if env_file is not None and Path(env_file).is_file():
        names |= set(dotenv_values(env_file))
    return names
