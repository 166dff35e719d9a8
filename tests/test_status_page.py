"""The status page (/) and /debug/history: the bounded history, the renderer, the page against the
fake engine over loopback (ready, then hung), no secret served, and the page in headless Chromium.

Chromium is Debian's ``chromium`` (``scripts/prepare_chromium.sh``): missing, its tests skip
naming the script, and fail under CI. ``STATUS_PAGE_SCREENSHOTS=1`` writes the screenshots to
docs/status-page.png (ready) and docs/status-page-hung.png instead of a temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sidecar.config import ConfigError
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.observations import CanaryDone, Registered
from sidecar.runtime.health import Health
from sidecar.surface.app import create_app
from sidecar.surface.history import History, scrub
from sidecar.surface.metrics import Metrics
from sidecar.surface.statuspage import render
from sidecar.surface.view import About
from sidecar.wiring import health_for
from tests.support.configured import blueprint_from, settings_from
from tests.support.harness import ROOT, Sidecar, base_env, wait_until
from tests.support.prerequisites import missing as prerequisite_missing

PREPARE = "scripts/prepare_chromium.sh"
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_LOG_LEVEL": "DEBUG"}
CHROMIUM_TIMEOUT = 60.0


def result(outcome: Outcome, at: float, reason: str = "fine", rid: str = "") -> Result:
    return Result(outcome, reason, at, at + 0.01, 1_700_000_000 + at, rid or f"canary-{at}", 200)


# --- the history ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_failures_outlive_a_flood_of_successes() -> None:
    history = History(successes=3, failures=2, changes=2)
    history.add_canary("generate", result(Outcome.TIMEOUT, 1, "timed out", "old-failure"))
    history.add_canary("generate", result(Outcome.ERROR, 2, "HTTP 500", "new-failure"))
    for i in range(10, 30):
        history.add_canary("generate", result(Outcome.SUCCESS, i))
    for i in range(5):
        history.add_change("worker", "readiness", "ready", f"change {i}", "listed_endpoints")
    view = history.view()
    ids = [c.request_id for c in view.canaries]
    assert ids == ["canary-29", "canary-28", "canary-27", "new-failure", "old-failure"]  # newest
    assert (view.successes_kept, view.failures_kept, view.changes_kept) == (3, 2, 2)
    assert [c.reason for c in view.changes] == ["change 4", "change 3"]
    history.add_canary("generate", result(Outcome.REFUSED, 40, "refused", "newest-failure"))
    ids = [c.request_id for c in history.view().canaries]
    assert len(ids) == 5
    assert "old-failure" not in ids
    assert ids[0] == "newest-failure"
    assert history.limits == {"successes": 3, "failures": 2, "changes": 2}


@pytest.mark.unit
def test_history_keeps_no_credentials() -> None:
    history = History(secrets=["sk-secret-123"])
    reason = (
        "GET http://admin:hunter2@10.0.0.1:8000/health: Authorization: Bearer sk-secret-123 "
        "rejected; bearer abc.def; key sk-secret-123"
    )
    history.add_canary("generate", result(Outcome.ERROR, 1, reason))
    history.add_change("endpoint", "generate", "notready", reason)
    view = history.view()
    for text in (view.canaries[0].reason, view.changes[0].reason):
        assert "hunter2" not in text
        assert "sk-secret-123" not in text
        assert "abc.def" not in text
        assert "http://<hidden>@10.0.0.1:8000" in text
    assert len(scrub("x" * 5000)) == 500


def health_with_history(monkeypatch: pytest.MonkeyPatch) -> tuple[Health, History, TestClient]:
    # SIDECAR_MODEL: a model the canary names, so no lookup is needed.
    blueprint = blueprint_from(monkeypatch, DYN_HEALTH_CHECK_ENABLED="true", SIDECAR_MODEL="tiny")
    health = health_for(blueprint)
    history = History()
    health.subscribe(history.on_event)
    about = blueprint.about
    app = create_app(about, health, Metrics(health, about), history)
    return health, history, TestClient(app)


@pytest.mark.unit
def test_the_listener_records_canaries_and_changes_of_every_verdict(monkeypatch) -> None:
    health, history, client = health_with_history(monkeypatch)
    ok = Result(Outcome.SUCCESS, "GET /health -> 200", 0, 0.01, 1e9, "", 200)
    health.observe(Registered("generate", ok))
    incarnation = health.snapshot.endpoints["generate"].incarnation
    health.observe(CanaryDone("generate", result(Outcome.SUCCESS, 1, rid="canary-a"), incarnation))
    view = history.view()
    assert [c.request_id for c in view.canaries] == ["canary-a"]
    assert {(c.scope, c.name, c.to) for c in view.changes} >= {
        ("endpoint", "generate", "ready"),
        ("worker", "readiness", "ready"),
    }
    body = client.get("/debug/history").json()
    assert body["status"] == "ready"
    assert body["canaries"][0]["request_id"] == "canary-a"


@pytest.mark.unit
def test_the_renderer_escapes_every_dynamic_value(monkeypatch) -> None:
    health, history, _ = health_with_history(monkeypatch)
    evil = '<script>alert("x")</script>'
    history.add_canary("generate", result(Outcome.ERROR, 1, f"HTTP 500: {evil}", f'id"{evil}'))
    history.add_change("worker", "readiness", "notready", evil, "listed_endpoints")
    page = render(About(), health.snapshot, history.view(), 0.0, 1.0, 1.7e9)
    assert "<script" not in page
    # The reason, the request id (its row and the chart's tooltip), the change's reason.
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") == 4
    assert "<svg" in page
    assert 'class="point error"' in page


@pytest.mark.unit
@pytest.mark.parametrize("path", ["/", "/debug/history"])
def test_the_page_routes_are_reserved(monkeypatch, path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from(monkeypatch, DYN_SYSTEM_HEALTH_PATH=path)
    assert "DYN_SYSTEM_HEALTH_PATH" in str(caught.value)


@pytest.mark.process
def test_an_engine_url_with_credentials_is_refused_without_echoing_them() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "--check-config"],
        env=base_env() | {"SIDECAR_ENGINE_URL": "http://user:password123@127.0.0.1:8000"},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2
    assert "SIDECAR_ENGINE_URL" in done.stderr
    assert "password123" not in done.stdout + done.stderr


# --- against the fake engine ---------------------------------------------------------------------


def rows(page: str, table: str) -> list[str]:
    found = re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', page, re.S)
    return re.findall(r"<tr>.*?</tr>", found.group(1), re.S) if found else []


def history_of(side: Sidecar) -> dict[str, Any]:
    answer = side.get("/debug/history")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    return answer.json()


@pytest.mark.process
def test_page_and_history_ready_then_hung(engine, sidecar) -> None:
    needle = uuid.uuid4().hex
    key = f"sk-hs-{needle}"
    fake = engine("vllm")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_ENGINE_API_KEY": key})
    side.wait_status(200, 5)
    wait_until(lambda: len(history_of(side)["canaries"]) >= 2, 5, what="two canaries")

    answer = side.get("/")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/html")
    page = answer.text
    assert '<strong id="readiness" class="ready">ready</strong>' in page
    assert '<strong id="liveness" class="live">live</strong>' in page
    body = history_of(side)
    assert body["status"] == "ready"
    assert body["live"] == "live"
    assert set(body) >= {"canaries", "changes", "limits", "kept", "timeout_seconds"}
    first = body["canaries"][0]
    assert set(first) == {
        "time",
        "unix_time",
        "endpoint",
        "request_id",
        "outcome",
        "latency_seconds",
        "status_code",
        "reason",
    }
    assert first["outcome"] == "success"
    assert first["request_id"].startswith("canary-")
    canary_rows = rows(page, "canaries")
    assert canary_rows
    assert all('class="success"' in row for row in canary_rows)
    assert all(c["request_id"] in page for c in body["canaries"][:2])
    assert re.search(r"<svg[^>]*>.*<circle class=\"point success\"", page, re.S)
    assert 'class="timeout-line"' in page
    head = side.http.head(f"{side.url}/")
    assert head.status_code == 200
    assert head.content == b""

    # The engine rejects with a text echoing credentials, then its generation hangs.
    fake.fault(
        generation_status=401,
        generation_error=f"bad key {key}; Authorization: Bearer {key}; at http://u:pw{needle}@x/",
    )
    wait_until(lambda: history_of(side)["kept"]["failures"] >= 1, 5, what="a rejected canary")
    fake.fault(generation_status=None, hang_generation=True)
    side.wait_status(503, 5)
    wait_until(
        lambda: (
            any(c["outcome"] == "timeout" for c in history_of(side)["canaries"])
            and "timeout" in history_of(side)["reason"]
        ),
        5,
        what="a timed-out canary in the history and the reason",
    )
    page = side.get("/").text
    body = history_of(side)
    assert body["status"] == "notready"
    assert '<strong id="readiness" class="notready">notready</strong>' in page
    reason = re.search(r'<span id="reason">(.*?)</span>', page, re.S)
    assert reason
    assert "timeout" in reason.group(1)
    assert any('class="timeout"' in row for row in rows(page, "canaries"))
    assert 'class="point timeout"' in page
    worker = [c for c in body["changes"] if c["scope"] == "worker" and c["name"] == "readiness"]
    assert worker[0]["to"] == "notready"
    assert worker[0]["reason"]
    assert any(c["to"] == "ready" for c in worker[1:])
    assert any('class="notready"' in row for row in rows(page, "changes"))
    assert len(body["canaries"]) <= sum(body["limits"][k] for k in ("successes", "failures"))

    # Nothing secret, on either route, by GET or HEAD, bodies or headers.
    for path in ("/", "/debug/history"):
        for method in ("GET", "HEAD"):
            answer = side.http.request(method, f"{side.url}{path}")
            text = answer.text + repr(dict(answer.headers))
            assert needle not in text, (method, path)
            assert f"pw{needle}" not in text


# --- headless Chromium ---------------------------------------------------------------------------


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        prerequisite_missing(f"chromium missing: run {PREPARE}")
    return found


def run_chromium(binary: str, url: str, *args: str) -> str:
    """One headless Chromium run in its own process group, killed by it if it overstays."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        argv += [f"--user-data-dir={profile}", "--no-first-run", "--window-size=1200,900"]
        proc = subprocess.Popen(
            [*argv, *args, url],
            env=base_env() | {"HOME": profile},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"chromium took more than {CHROMIUM_TIMEOUT} s on {url}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # helpers left behind, if any
        assert proc.returncode == 0, err[-2000:]
        return out


def screenshot(binary: str, url: str, path: Path) -> None:
    run_chromium(binary, url, f"--screenshot={path}")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


@pytest.mark.system
def test_headless_chromium_renders_the_page_ready_and_hung(engine, sidecar, tmp_path) -> None:
    binary = chromium()
    out = ROOT / "docs" if os.environ.get("STATUS_PAGE_SCREENSHOTS") else tmp_path
    fake = engine("vllm")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    wait_until(lambda: len(history_of(side)["canaries"]) >= 6, 10, what="six canaries")
    url = f"{side.url}/"

    dom = run_chromium(binary, url, "--dump-dom")
    assert '<strong id="readiness" class="ready">ready</strong>' in dom
    assert "<svg" in dom
    assert 'class="point success"' in dom
    screenshot(binary, url, out / "status-page.png")

    fake.fault(hang_generation=True)
    side.wait_status(503, 5)
    wait_until(
        lambda: sum(c["outcome"] == "timeout" for c in history_of(side)["canaries"]) >= 3,
        10,
        what="three timed-out canaries",
    )
    dom = run_chromium(binary, url, "--dump-dom")
    assert '<strong id="readiness" class="notready">notready</strong>' in dom
    assert 'class="point timeout"' in dom
    screenshot(binary, url, out / "status-page-hung.png")
