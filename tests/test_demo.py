"""The README's first command: ``health-sidecar demo`` shows the sidecar working and cleans up."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakeengine.backends import BACKENDS as FAKE_BACKENDS
from sidecar.core.vocabulary import Mode, ModelType, Role
from sidecar.engines import ENGINES
from sidecar.tools import demo as demo_tool
from tests.support.configured import blueprint_from
from tests.support.harness import LOOPBACK, ROOT, Proc, base_env, free_port, wait_until
from tests.support.inprocess import EngineLink

WHY_503 = ROOT / "docs" / "operate" / "why-503.md"


def start_demo(env: dict[str, str], *argv: str) -> tuple[Proc, str]:
    """``health-sidecar [argv] demo`` on a free port; returns it once /health answers 200."""
    port = free_port()
    demo = Proc(
        [sys.executable, "-m", "sidecar", *argv, "demo"],
        base_env() | {"DYN_SYSTEM_PORT": str(port)} | env,
        "demo",
    )
    url = f"http://{LOOPBACK}:{port}"

    def ready() -> bool:
        assert demo.popen.poll() is None, demo.output()
        return httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200

    try:
        wait_until(ready, 15, what="the demo to be ready")
    except BaseException:
        demo.stop(sig=signal.SIGINT)
        raise
    return demo, url


@pytest.mark.process
def test_demo_starts_a_fake_engine_goes_ready_and_ends_it_on_ctrl_c(tmp_path):
    """It also leaves nothing in the temporary directory: the fake engine's folder goes with it."""
    nothing_there = f"http://{LOOPBACK}:{free_port()}"
    temp = tmp_path / "tmp"
    temp.mkdir()
    demo, url = start_demo({"SIDECAR_ENGINE_URL": nothing_there, "TMPDIR": str(temp)})
    try:
        engine = re.search(r"fakeengine listening on (http://\S+)", demo.output())
        assert engine is not None, demo.output()
        assert f"curl -s {url}/health" in demo.output()
        assert [p.name[:20] for p in temp.iterdir()] == ["health-sidecar-demo-"]
        demo.popen.send_signal(signal.SIGINT)  # Ctrl-C: exit now (SIGTERM would drain)
        assert demo.popen.wait(10) == 0
        assert not list(temp.iterdir())
        try:
            httpx.get(f"{engine[1]}/health", timeout=1, trust_env=False)
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("the demo left its fake engine running")
    finally:
        demo.stop()


@pytest.mark.process
def test_demo_honours_the_env_file_and_starts_the_configured_fake_engine(tmp_path):
    """``health-sidecar --env-file F demo``: the file's backend and role pick the fake engine, and
    its values win over the demo's defaults (the environment wins over both)."""
    nothing_there = f"http://{LOOPBACK}:{free_port()}"
    env_file = tmp_path / "sglang-decode.env"
    env_file.write_text(
        "SIDECAR_BACKEND=sglang\n"
        "SIDECAR_DISAGGREGATION_MODE=decode\n"
        "DYN_CANARY_WAIT_TIME=7\n"
        f"SIDECAR_ENGINE_URL={nothing_there}\n"
    )
    demo, url = start_demo({}, "--env-file", str(env_file))
    try:
        assert "starting the fake sglang engine (decode)" in demo.output()
        assert "backend=sglang mode=decode" in demo.output()
        body = httpx.get(f"{url}/health", timeout=1, trust_env=False).json()
        why = body["checks"]["generate"]["canary_why"]
        assert "bootstrap host 2.2.2.2" in why, why  # SGLang's fake KV transfer: no peer needed
        assert "fake KV transfer" in why, why
        metrics = httpx.get(f"{url}/metrics", timeout=1, trust_env=False).text
        assert 'backend="sglang"' in metrics
        assert 'mode="decode"' in metrics
        demo.popen.send_signal(signal.SIGINT)
        assert demo.popen.wait(10) == 0
    finally:
        demo.stop()


def printed_commands(output: str) -> dict[str, str]:
    """The commands the demo prints under "Try:", by what each line says it does."""
    commands = {}
    for line in output.splitlines():
        label, sep, command = line.strip().partition(":  ")
        command = command.strip() if sep else label
        if command.startswith("curl "):
            commands[label.strip() if sep else command.split()[-1]] = command
    return commands


def shell(command: str) -> str:
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=10, env=base_env()
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


@pytest.mark.process
def test_the_commands_the_demo_prints_work_when_pasted():
    nothing_there = f"http://{LOOPBACK}:{free_port()}"
    quick = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5"}
    demo, url = start_demo({"SIDECAR_ENGINE_URL": nothing_there} | quick)
    try:
        commands = printed_commands(demo.output())
        assert set(commands) == {
            f"{url}/health",
            f"{url}/live",
            f"{url}/metrics",
            "hang the engine's GPU loop",
            "and release it",
        }, demo.output()
        assert json.loads(shell(commands[f"{url}/health"]))["status"] == "ready"
        assert json.loads(shell(commands[f"{url}/live"]))["status"] == "live"
        assert "health_sidecar_ready 1.0" in shell(commands[f"{url}/metrics"])

        def status() -> str:
            return json.loads(shell(commands[f"{url}/health"]))["status"]

        # The demo says how soon a hang shows (these settings are not its defaults), and it does.
        said = re.search(r"notready within (\d+(?:\.\d+)?) s of a hang", demo.output())
        assert said is not None, demo.output()
        assert "timings (as configured;" in demo.output()
        bound = float(said[1])
        assert bound == 1 + 1 + 1 + 0.5  # wait + retry + (failures - 1) x timeout + timeout
        assert shell(commands["hang the engine's GPU loop"]) == '{"hang_generation":true}'
        # + 1.5 s: the polls are shell commands, each a bash and a curl.
        wait_until(lambda: status() == "notready", bound + 1.5, interval=0.1, what="the hang seen")
        # What a newcomer then reads in /health is in why-503.md's table of reasons.
        reason = json.loads(shell(commands[f"{url}/health"]))["reason"]
        assert reason.startswith("generate: canary timeout: "), reason
        assert any(reason.startswith(prefix) for prefix in documented_reasons()), reason
        shell(commands["and release it"])
        wait_until(lambda: status() == "ready", 5, interval=0.1, what="ready after the release")
    finally:
        # Ctrl-C, as a person ends it: the demo ends its fake engine (SIGTERM would drain it
        # past stop()'s patience, and the SIGKILL after it would leave the engine behind).
        demo.stop(sig=signal.SIGINT)
    engine = re.search(r"fakeengine listening on (http://\S+)", demo.output())
    assert engine is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{engine[1]}/health", timeout=1, trust_env=False)


def documented_reasons() -> list[str]:
    """What each row of why-503.md's "Reading `reason`" table says a reason starts with (its
    first code span, up to a "...")."""
    section = WHY_503.read_text("utf-8").split("## Reading `reason`", 1)[1]
    rows = re.findall(r"^\| `([^`]+)`", section, re.M)
    return [row.split("...")[0].rstrip() for row in rows]


# --- which engine the demo uses --------------------------------------------------------------


class QuietFileServer(SimpleHTTPRequestHandler):
    """``python3 -m http.server``'s handler, without its log lines."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[str]:
    """An HTTP server that is no engine: ``python3 -m http.server`` in a thread, serving an
    empty folder (404 for /v1/models and /health)."""
    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(QuietFileServer, directory=str(folder))
    server = ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.process
def test_the_demo_starts_its_fake_engine_beside_a_server_that_is_no_engine(file_server):
    """``python3 -m http.server 8000`` is not taken for the engine: the demo says why, starts its
    fake engine on a port of its own, prints the fault commands and goes ready."""
    demo, url = start_demo({"SIDECAR_ENGINE_URL": file_server})
    try:
        output = demo.output()
        assert (
            f"demo: {file_server} answers, but not as a vllm engine (GET /v1/models -> 404, "
            "GET /health -> 404); starting the fake vllm engine (aggregated)"
        ) in output
        engine = re.search(r"fakeengine listening on (http://\S+)", output)
        assert engine is not None, output
        assert engine[1] != file_server
        assert "hang the engine's GPU loop" in printed_commands(output)
        assert "using the engine" not in output
        assert f"curl -s {url}/health" in output
    finally:
        demo.stop(sig=signal.SIGINT)


def looked(
    transport: Callable[[], httpx.AsyncBaseTransport], registration: str = "/health"
) -> demo_tool.Found:
    """What the demo finds behind ``transport`` (made inside the loop), its registration route
    ``registration``."""

    async def look() -> demo_tool.Found:
        client = httpx.AsyncClient(transport=transport(), base_url="http://engine:8000")
        async with client:
            return await demo_tool.look_for_engine(client, registration)

    return asyncio.run(look())


def answering(status: int, body: bytes = b"") -> Callable[[], httpx.AsyncBaseTransport]:
    return lambda: httpx.MockTransport(lambda request: httpx.Response(status, content=body))


@pytest.mark.unit
@pytest.mark.parametrize("backend", [b for b in ENGINES if b in FAKE_BACKENDS])
def test_the_demo_uses_an_engine_of_the_configured_backend(backend: str):
    """Each fake engine answers as its backend's prober expects: its registration route (the
    sidecar's, from the engine's API) with 200, or its model list with a model id."""
    role = Role(Mode.AGGREGATED, ModelType.TEXT)
    registration = ENGINES[backend].api(role).registration_path
    found = looked(lambda: EngineLink(backend), registration)
    assert found.engine, found
    assert found.answers


@pytest.mark.unit
def test_the_demo_says_what_a_server_that_is_no_engine_answered():
    found = looked(answering(404, b"<html>File not found</html>"))
    assert not found.engine
    assert found.answers == ("GET /v1/models -> 404", "GET /health -> 404")
    listless = looked(answering(200, b'{"object": "list", "data": []}'), "/v1/models")
    assert not listless.engine
    assert listless.answers == ("GET /v1/models -> 200 without a model id",)


@pytest.mark.unit
def test_the_demo_finds_nothing_where_nothing_listens():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    found = looked(lambda: httpx.MockTransport(refuse))
    assert found == demo_tool.Found(engine=False, answers=())


# --- what the demo says of its timings --------------------------------------------------------


@pytest.mark.unit
def test_the_demo_says_its_timings_and_serves(monkeypatch: pytest.MonkeyPatch):
    """The demo's defaults are shorter than serve's; it says both, and the bound of a hang that
    follows from them (wait 5 + retry 1 + 2 timeouts of 2 s: 10 s, not the 7 s one may time)."""
    said = demo_tool.timings(blueprint_from(monkeypatch, **demo_tool.DEMO_DEFAULTS))
    assert said.startswith("demo: timings (demo defaults; serve's defaults: a canary every 10 s, ")
    assert "3 s timeout, 120 s liveness window)" in said
    assert "a canary every 5 s when ready, 2 s timeout" in said
    assert "notready within 10 s of a hang" in said
    assert "/live fails within 36 s (30 s liveness window)" in said  # 5 + 1 + 30

    configured = demo_tool.DEMO_DEFAULTS | {"DYN_CANARY_WAIT_TIME": "7"}
    said = demo_tool.timings(blueprint_from(monkeypatch, **configured))
    assert said.startswith("demo: timings (as configured; serve's defaults: ")
    assert "a canary every 7 s when ready" in said
    assert "notready within 12 s of a hang" in said


@pytest.mark.unit
def test_the_demo_says_when_no_canary_would_see_a_hang(monkeypatch: pytest.MonkeyPatch):
    env = demo_tool.DEMO_DEFAULTS | {
        "SIDECAR_DISAGGREGATION_MODE": "encode",
        "SIDECAR_MODEL_TYPE": "text",
    }
    said = demo_tool.timings(blueprint_from(monkeypatch, **env))
    assert "no canary" in said
    assert "a hang behind its 200 is not seen" in said
    # An image encoder has its canary.
    env["SIDECAR_MODEL_TYPE"] = "multimodal"
    said = demo_tool.timings(blueprint_from(monkeypatch, **env))
    assert "notready within 10 s of a hang" in said
