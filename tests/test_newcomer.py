"""What a newcomer meets on a fresh clone, as they meet it: the README's example 503 body is what
the sidecar says, the first log line of an engine not up yet says it is coming, a failure count
counts failures in a row (a confirmed hang says so apart), a guessed variable name is pointed at
the one that does it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dotenv import dotenv_values

from sidecar.config import ConfigError
from sidecar.wiring import load
from tests.support.inprocess import EngineLink, run_virtually, running

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"


def _readme_example() -> dict:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"```json\n(\{.*?\})\n```", text, re.S)
    assert found, "no JSON example in the README"
    return json.loads(found.group(1))


def _subset(shown: object, real: object, where: str = "") -> list[str]:
    """Where the README shows a value the real body does not have."""
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{where}: not an object"]
        return [p for k, v in shown.items() for p in _subset(v, real.get(k), f"{where}.{k}")]
    return [] if shown == real else [f"{where}: README {shown!r}, sidecar {real!r}"]


def test_the_readmes_503_body_is_what_the_sidecar_says_for_a_hang() -> None:
    """The README's profile (config/vllm-aggregated.env) at its default timings, the engine's
    generation hung while its /health answers 200: the body's fields the README shows, as the
    sidecar shows them."""
    env = {
        k: v for k, v in dotenv_values(ROOT / "config/vllm-aggregated.env").items() if v is not None
    } | {"DYN_CANARY_WAIT_TIME": "10", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "3"}

    async def main() -> dict:
        async with running(env, {URL: EngineLink("vllm")}) as side:
            await side.wait_status(200, 15)
            await side.engines[URL].fault(hang_generation=True)
            await side.wait_status(503, 20)
            return (await side.health_body())[1]

    real = run_virtually(main)
    wrong = _subset(_readme_example(), real)
    assert not wrong, wrong


def test_an_engine_never_registered_is_not_reachable_yet_not_deregistered() -> None:
    async def main() -> list[str]:
        link = EngineLink("vllm", load_seconds=5.0)  # vLLM opens its port once loaded
        async with running({"DYN_HEALTH_CHECK_ENABLED": "true"}, {URL: link}) as side:
            await side.wait_status(200, 15)
            return side.log

    log = run_virtually(main)
    first = next(line for line in log if "generate: engine" in line)
    assert "generate: engine not reachable yet (GET /health: cannot connect" in first, first
    assert not [line for line in log if "deregistered" in line], log


def test_consecutive_failures_counts_failures_in_a_row_and_a_confirmed_hang_says_so() -> None:
    """One timed-out canary with no engine progress: notready at once (the metrics confirm the
    hang), with one failure counted, not the threshold; the metric agrees with the count."""

    async def main() -> tuple[dict, str]:
        async with running({"DYN_HEALTH_CHECK_ENABLED": "true"}, {URL: EngineLink("vllm")}) as side:
            await side.wait_status(200, 5)
            await side.engines[URL].fault(hang_generation=True)
            await side.wait_status(503, 5)
            return (await side.health_body())[1], await side.metrics()

    body, metrics = run_virtually(main)
    check = body["checks"]["generate"]
    assert check["consecutive_failures"] == 1, check
    assert check["hang_confirmed"] is True, check
    assert "no engine progress since it was sent" in check["reason"]
    counted = re.search(r"health_sidecar_canary_consecutive_failures\{[^}]*\} (\S+)", metrics)
    timeouts = re.search(
        r'health_sidecar_canary_total\{[^}]*outcome="timeout"[^}]*\} (\S+)', metrics
    )
    assert counted, metrics
    assert timeouts, metrics
    assert float(counted.group(1)) == float(timeouts.group(1)) == 1.0


@pytest.mark.parametrize(
    ("guess", "meant"),
    [
        ("SIDECAR_CANARY_TIMEOUT", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT"),
        ("SIDECAR_CANARY_INTERVAL", "DYN_CANARY_WAIT_TIME"),
        ("SIDECAR_CANARY_WAIT", "DYN_CANARY_WAIT_TIME"),
        ("SIDECAR_PORT", "DYN_SYSTEM_PORT"),
        ("DYN_CANARY_TIMEOUT", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT"),
        ("SIDECAR_CANARY_ETRY_INTERVAL", "SIDECAR_CANARY_RETRY_INTERVAL"),  # a typo stays one
    ],
)
def test_a_guessed_name_is_pointed_at_the_variable_that_does_it(
    monkeypatch: pytest.MonkeyPatch, guess: str, meant: str
) -> None:
    monkeypatch.setenv(guess, "abc")
    with pytest.raises(ConfigError) as raised:
        load()
    assert any(
        f"{guess}:" in line and f"did you mean {meant}?" in line for line in raised.value.lines
    ), raised.value.lines
