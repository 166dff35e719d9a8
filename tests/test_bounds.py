"""Every bound the sidecar prints is the code's own: ``health-sidecar probes`` and
``--check-config`` render each bound from the policy's sums of named terms
(sidecar/core/evidence/policy.py), and the arithmetic in the text adds up to the total printed
beside it, for several configurations. The schedule itself keeps to the same numbers: the
monitor's tests on a virtual clock (tests/test_monitor.py) hold it to
``size(...).hang_to_notready``.
"""

from __future__ import annotations

import re

import pytest

from sidecar.core.evidence.policy import Policy, Sum, Term
from sidecar.tools.plan import render as render_plan
from sidecar.tools.probes import render, size
from tests.support.configured import blueprint_from

pytestmark = pytest.mark.unit

CONFIGURATIONS = [
    {},
    {"DYN_HEALTH_CHECK_ENABLED": "true"},
    {"DYN_HEALTH_CHECK_ENABLED": "true", "DYN_CANARY_WAIT_TIME": "1.5"},
    {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_FAILURE_THRESHOLD": "3",
        "SIDECAR_SUCCESS_THRESHOLD": "2",
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
        "SIDECAR_CANARY_RETRY_INTERVAL": "2",
    },
    {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_PROGRESS_ENABLED": "false"},
    {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_BACKEND": "sglang", "SIDECAR_STALL_WINDOW": "9"},
    {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_DISAGGREGATION_MODE": "encode"},
    {"SIDECAR_REGISTRATION_INTERVAL": "4", "SIDECAR_LIVENESS_WINDOW": "30"},
]
NUMBER = r"\d+(?:\.\d+)?"
# "<total> s <words> (<terms>...)": the terms of a sum, as Sum prints them.
WITH_TERMS = re.compile(rf"({NUMBER}) s[a-z ]{{0,40}} \(((?:\d+ x )?{NUMBER} s[^():]*)[:)]")
TERM = re.compile(rf"^(?:(\d+) x )?({NUMBER}) s(?: [a-z ]+)?$")
# "<a> + <n> x <b> = <total> s" and "<n> x <b> s = <total> s"
PLAIN_SUM = re.compile(rf"({NUMBER}) \+ (\d+) x ({NUMBER}) = ({NUMBER}) s")
PRODUCT = re.compile(rf"(\d+) x ({NUMBER}) s = ({NUMBER}) s")


def unwrapped(text: str) -> str:
    """The text with its YAML comments joined into one line each paragraph."""
    lines = [line.strip().removeprefix("#").strip() for line in text.splitlines()]
    return re.sub(r"\s+", " ", " ".join(lines))


def added(terms: str) -> float:
    total = 0.0
    for term in terms.split(" + "):
        found = TERM.match(term.strip())
        assert found, f"not a term: {term!r} in {terms!r}"
        times, seconds = found.groups()
        total += float(seconds) * (int(times) if times else 1)
    return total


@pytest.mark.parametrize("env", CONFIGURATIONS)
def test_every_printed_sum_adds_up_to_the_total_it_prints(monkeypatch, env):
    blueprint = blueprint_from(monkeypatch, **env)
    text = unwrapped(render(blueprint, 7200)) + " " + unwrapped(render_plan(blueprint))
    sums = WITH_TERMS.findall(text)
    assert sums, text
    for total, terms in sums:
        assert added(terms) == pytest.approx(float(total)), (total, terms)
    for a, times, b, total in PLAIN_SUM.findall(text):
        assert float(a) + int(times) * float(b) == pytest.approx(float(total))
    for times, b, total in PRODUCT.findall(text):
        assert int(times) * float(b) == pytest.approx(float(total))


@pytest.mark.parametrize("env", CONFIGURATIONS)
def test_the_printed_bounds_are_the_policys(monkeypatch, env):
    """What the probes are sized by is what the policy computes, terms and totals alike."""
    blueprint = blueprint_from(monkeypatch, **env)
    z = size(blueprint, 7200)
    policy = blueprint.policy
    assert z.hang_to_notready == policy.to_notready(z.canary).seconds
    assert z.load_to_ready == policy.to_ready(z.canary).seconds
    assert z.hang_to_restart == pytest.approx(
        policy.to_notlive(z.canary).seconds + z.liveness.failures * z.liveness.period
    )
    text = unwrapped(render(blueprint, 7200))
    if z.canary:
        assert f"({policy.to_notready()}:" in text
        assert f"({policy.to_notlive()} +" in text
    if z.stall_to_notready is not None:
        assert f"({policy.to_stalled()})" in text
        assert z.stall_to_notready == policy.stall_bound


@pytest.mark.parametrize(
    "policy",
    [
        Policy(),
        Policy(failure_threshold=4, retry=5, timeout=2, wait=1.5),
        Policy(success_threshold=3),
    ],
)
def test_a_sum_says_what_it_adds(policy):
    for made in (policy.to_ready(), policy.to_notready(), policy.to_notlive(), policy.to_stalled()):
        assert added(str(made)) == pytest.approx(made.seconds)
    assert policy.hang_to_notready == policy.to_notready().seconds
    assert policy.hang_to_notlive == policy.to_notlive().seconds


def test_a_term_taken_no_times_is_not_said():
    assert str(Sum((Term(1, "a"), Term(2, "b", 0), Term(3, "c", 2)))) == "1 s a + 2 x 3 s c"
