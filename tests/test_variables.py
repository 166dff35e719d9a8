"""A misspelled variable is refused, with one line naming it and the name it is closest to; a
name Dynamo reads is never refused (the sidecar shares the pod's environment with Dynamo's
worker); other names are ignored, and --check-config says which and why."""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import wiring
from sidecar.config import ConfigError, check_names
from sidecar.config.names import DYNAMO_PREFIX, SIDECAR_PREFIX, dynamo_names, read_names

pytestmark = pytest.mark.unit

OURS = sorted(read_names())
SIDECARS = [n for n in OURS if n.startswith(SIDECAR_PREFIX)]
DYNS = [n for n in OURS if n.startswith(DYNAMO_PREFIX)]
DYNAMOS = sorted(dynamo_names())
KNOWN = set(OURS) | set(DYNAMOS)
LETTERS = string.ascii_uppercase + "_"
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def one_edit(draw: st.DrawFn, name: str) -> str:
    """``name`` with one letter dropped, added, changed, or two neighbours swapped (after its
    prefix, which a misspelling keeps)."""
    prefix = SIDECAR_PREFIX if name.startswith(SIDECAR_PREFIX) else DYNAMO_PREFIX
    tail = name.removeprefix(prefix)
    at = draw(st.integers(0, len(tail) - 1))
    letter = draw(st.sampled_from(LETTERS))
    kind = draw(st.sampled_from(["drop", "add", "change", "swap"]))
    if kind == "drop":
        tail = tail[:at] + tail[at + 1 :]
    elif kind == "add":
        tail = tail[:at] + letter + tail[at:]
    elif kind == "change":
        tail = tail[:at] + letter + tail[at + 1 :]
    elif at + 1 < len(tail):
        tail = tail[:at] + tail[at + 1] + tail[at] + tail[at + 2 :]
    return prefix + tail


def misspelled(names: list[str]) -> st.SearchStrategy[tuple[str, str]]:
    """(the name, one edit of it that no one reads)."""
    return (
        st.sampled_from(names)
        .flatmap(lambda name: st.tuples(st.just(name), one_edit(name)))
        .filter(lambda pair: pair[1] not in KNOWN and pair[1] != pair[0])
    )


def test_every_name_the_sidecar_or_dynamo_reads_is_taken():
    said = check_names([*OURS, *DYNAMOS])
    assert said.refused == ()
    assert {name for name, _ in said.ignored} == set(DYNAMOS) - set(OURS)


@PROPERTY
@given(pair=misspelled(SIDECARS))
def test_a_misspelled_sidecar_name_is_refused_naming_it_and_the_nearest(pair):
    _, typo = pair
    (line,) = check_names([typo]).refused
    assert line.startswith(f"{typo}: expected a variable the sidecar reads")
    assert "did you mean SIDECAR_" in line  # one edit away: a name it reads is close


@PROPERTY
@given(pair=misspelled(DYNS))
def test_a_misspelled_dynamo_name_the_sidecar_reads_is_refused(pair):
    _, typo = pair
    (line,) = check_names([typo]).refused
    assert line.startswith(f"{typo}: expected a variable the sidecar or Dynamo reads")
    assert "did you mean DYN_" in line


@PROPERTY
@given(name=st.sampled_from(DYNAMOS))
def test_a_name_dynamo_reads_is_never_refused(name):
    said = check_names([name])
    assert said.refused == ()


@PROPERTY
@given(tail=st.text(LETTERS, min_size=1, max_size=30))
def test_any_sidecar_name_it_does_not_read_is_refused(tail):
    name = SIDECAR_PREFIX + tail
    said = check_names([name])
    assert (name in OURS) == (said.refused == ())


@PROPERTY
@given(tail=st.text(LETTERS, min_size=1, max_size=30))
def test_a_dynamo_name_is_refused_only_when_close_to_the_sidecars(tail):
    name = DYNAMO_PREFIX + tail
    said = check_names([name])
    if name in KNOWN or not said.refused:
        assert said.refused == ()
    else:
        (line,) = said.refused
        near = line.split("did you mean ")[1].rstrip("?)")
        assert near in DYNS


def test_other_names_are_not_the_sidecars_business():
    assert check_names(["PATH", "HOME", "VLLM_USE_V1", "NATS_SERVER"]) == check_names([])


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("SIDECAR_ENGIN_URL", "SIDECAR_ENGINE_URL"),
        ("DYN_HEALTH_CHECK_ENABLE", "DYN_HEALTH_CHECK_ENABLED"),
        ("DYN_CANARY_WAIT", "DYN_CANARY_WAIT_TIME"),
        ("SIDECAR_DP_RANK", "SIDECAR_DP_RANKS"),
    ],
)
def test_the_cases_users_hit_are_refused_with_one_line(monkeypatch, tmp_path, name, nearest):
    """In the environment and in an --env-file alike; the value of the right name is taken when
    both are set, but the misspelling is still refused (it may have been meant to win)."""
    for key in list(__import__("os").environ):
        if key.startswith((SIDECAR_PREFIX, DYNAMO_PREFIX)):
            monkeypatch.delenv(key)
    monkeypatch.setenv(name, "true")
    with pytest.raises(ConfigError) as raised:
        wiring.load()
    assert raised.value.lines == [
        f"{name}: expected a variable the sidecar {'or Dynamo ' if name.startswith('DYN') else ''}"
        f"reads (did you mean {nearest}?)"
    ]
    monkeypatch.delenv(name)
    env_file = tmp_path / "profile.env"
    env_file.write_text(f"{name}=true\n")
    with pytest.raises(ConfigError) as raised:
        wiring.load(str(env_file))
    assert len(raised.value.lines) == 1
    assert raised.value.lines[0].startswith(f"{name}: ")
