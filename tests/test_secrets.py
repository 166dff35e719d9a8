"""No secret in any output: a secret planted in every variable that can carry one never shows,
wherever the sidecar speaks: its configuration error lines, --check-config, probes, the log, the
HTTP bodies (/health, /live, /, /debug/history), /metrics, and the reasons of a hang and of an
engine that echoes what it was sent, through its recovery. One rule decides what is secret
(sidecar/redact.py)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from sidecar.config import ConfigError
from sidecar.redact import HIDDEN, RedactingFilter, scrubbed
from sidecar.tools.plan import render
from sidecar.tools.probes import render as render_probes
from sidecar.wiring import load, resolve
from tests.support.inprocess import EngineLink, run_virtually, running

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-planted-value"
URL = "http://127.0.0.1:8000"
# Every variable whose value can carry a secret, and a value that carries it; each refused, so
# that its error line is what shows.
REFUSED = {
    "SIDECAR_ENGINE_URL": f"http://user:{SECRET}@127.0.0.1:8000",
    "SIDECAR_METRICS_URL": f"http://user:{SECRET}@127.0.0.1:1/metrics",
    "SIDECAR_KV_PEER_URL": f"http://user:{SECRET}@127.0.0.1:8001",
    "SIDECAR_REGISTRATION": f"grpc://user:{SECRET}@127.0.0.1:1/x",
    "SIDECAR_ENGINE_API_KEY": f"{SECRET} with spaces",
    "SIDECAR_CONTROL_TOKEN": f"{SECRET} with spaces",
    # NaN is no JSON: refused, its api_key shown nowhere
    "DYN_HEALTH_CHECK_PAYLOAD": json.dumps({"api_key": SECRET, "prompt": "x", "bad": float("nan")}),
}
# And accepted: the sidecar runs with them.
ACCEPTED = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_ENGINE_API_KEY": SECRET,
    "SIDECAR_CONTROL_PORT": "9191",
    "SIDECAR_CONTROL_TOKEN": SECRET + "-control",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_value_never_shows_its_secret(monkeypatch: pytest.MonkeyPatch, name: str):
    monkeypatch.setenv(name, REFUSED[name])
    with pytest.raises(ConfigError) as raised:
        load()
    lines = raised.value.lines
    assert any(name in line for line in lines), lines
    assert not [line for line in lines if SECRET in line], lines


def test_a_payloads_fields_named_like_keys_are_hidden_at_any_depth():
    payload = {"prompt": "x", "api_key": SECRET, "nested": {"accessToken": SECRET, "max_tokens": 2}}
    shown = json.dumps(scrubbed(payload))
    assert SECRET not in shown
    assert '"max_tokens": 2' in shown  # a count is not a secret


def test_check_config_and_probes_never_show_a_secret(monkeypatch: pytest.MonkeyPatch):
    for name, value in ACCEPTED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", json.dumps({"prompt": "x", "api_key": SECRET}))
    blueprint = resolve(load())
    texts = [render(blueprint), render_probes(blueprint, 600.0)]
    assert not [t for t in texts if SECRET in t]


def test_no_secret_in_any_body_metric_or_log_line_through_a_hang_and_an_echoing_engine():
    """The engine echoes the bearer token in its error text (a gateway that does): every reason
    that reaches /health, the history, the status page and the log is scrubbed."""
    env = ACCEPTED | {"SIDECAR_ENGINE_URL": URL}

    async def main() -> list[str]:
        seen: list[str] = []
        async with running(env, {URL: EngineLink("vllm")}) as side:

            async def outputs() -> None:
                for path in ("/health", "/live", "/", "/debug/history", "/metrics"):
                    seen.append((await side.get(path)).text)

            await side.wait_status(200, 5)
            engine = side.engines[URL]
            await engine.fault(hang_generation=True)
            await side.wait_status(503, 5)
            await outputs()
            await engine.fault(hang_generation=False)
            await side.wait_status(200, 5)
            echo = f"bad request from Authorization: Bearer {SECRET} (token {SECRET})"
            await engine.fault(generation_status=500, generation_error=echo)
            await side.wait_status(503, 5)
            await outputs()
            await engine.fault(generation_status=None)
            await side.wait_status(200, 5)
            await outputs()
            seen.extend(side.log)
        return seen

    seen = run_virtually(main)
    assert any("HTTP 500" in text for text in seen), "the echoing engine's error never showed"
    assert not [text for text in seen if SECRET in text]


def test_the_log_hides_secrets_at_every_level_and_in_tracebacks():
    record = logging.LogRecord(
        "sidecar", logging.DEBUG, __file__, 1, "engine said %s", (f"Bearer {SECRET}",), None
    )
    try:
        raise ValueError(f"http://u:{SECRET}@host/ failed with key {SECRET}")
    except ValueError:
        record.exc_info = sys.exc_info()
    RedactingFilter([SECRET]).filter(record)
    text = logging.Formatter().format(record)
    assert SECRET not in text
    assert HIDDEN in text
