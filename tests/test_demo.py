"""The README's first command: ``health-sidecar demo`` shows the sidecar working and cleans up."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests.support.harness import LOOPBACK, Proc, base_env, free_port, wait_until


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


def test_demo_starts_a_fake_engine_goes_ready_and_ends_it_on_ctrl_c():
    nothing_there = f"http://{LOOPBACK}:{free_port()}"
    demo, url = start_demo({"SIDECAR_ENGINE_URL": nothing_there})
    try:
        engine = re.search(r"fakeengine listening on (http://\S+)", demo.output())
        assert engine is not None, demo.output()
        assert f"curl -s {url}/health" in demo.output()
        demo.popen.send_signal(signal.SIGINT)  # Ctrl-C: exit now (SIGTERM would drain)
        assert demo.popen.wait(10) == 0
        try:
            httpx.get(f"{engine[1]}/health", timeout=1, trust_env=False)
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("the demo left its fake engine running")
    finally:
        demo.stop()


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
        assert "bootstrap_host" in body["checks"]["generate"]["canary_why"]
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

        shell(commands["hang the engine's GPU loop"])
        wait_until(lambda: status() == "notready", 5, interval=0.1, what="notready after the hang")
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
