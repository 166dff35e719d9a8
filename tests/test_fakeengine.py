"""``python -m fakeengine`` as a process on 127.0.0.1: what only the process shows. Its command
line (flags refused with exit status 2, SGLang's prefill refusing the fake transfer with 1 before
it listens), its port file and listening line, SIGTERM (exit 0) and a restart on the same port
after SIGKILL, vLLM's port closed while it loads (a real refused connect), and SGLang's decode
server killing its own process tree.

The engine's HTTP behaviour (each backend's routes and role rules, metrics, faults, sleep, ranks,
NIXL transfers, the request log, loading as the app shows it) is tested on its ASGI app
in-process, on a virtual clock: ``tests/test_fakeengine_app.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.process

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT = 10.0
POLL_INTERVAL = 0.02
CANARY_IDS = [101, 102, 103, 104, 105, 106, 107, 108]
SGLANG_DECODE_CRASH = "AttributeError: 'NoneType' object has no attribute 'startswith'"


# --------------------------------------------------------------------------------- harness


def wait_for(predicate: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(POLL_INTERVAL)


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 5.0, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout, **kw)

    def state(self) -> dict[str, Any]:
        return self.get("/_fake/state").json()


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate all at once, then give each up to 3 s before SIGKILL."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli_env() -> dict[str, str]:
    """This environment, with the repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class Launcher:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, port: int = 0, wait: bool = True) -> Engine:
        n = len(self.procs)
        port_file = self.workdir / f"engine-{n}.port"
        log = self.workdir / f"engine-{n}.log"
        command = [sys.executable, "-m", "fakeengine", "--host", HOST, "--port", str(port)]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [*command, "--port-file", str(port_file), *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=cli_env(),
            )
        self.procs.append(proc)
        engine = Engine(proc, port, log)
        if wait:
            engine.port = self._read_port(port_file, proc)
        return engine

    @staticmethod
    def _read_port(port_file: Path, proc: subprocess.Popen[bytes]) -> int:
        def ready() -> bool:
            assert proc.poll() is None, f"engine exited early with {proc.returncode}"
            return port_file.exists()

        wait_for(ready)
        return int(port_file.read_text())

    def stop_all(self) -> None:
        stop_processes(self.procs)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher.start
    finally:
        launcher.stop_all()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def completion(**overrides: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": CANARY_IDS,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }
    return {**body, **overrides}


def sglang_generate(max_new_tokens: int = 1, **overrides: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": CANARY_IDS, "sampling_params": sampling, "rid": "canary-1"}
    return {**body, **overrides}


# ------------------------------------------------------------------------------ lifecycle


def test_port_file_and_listening_line(launch: Callable[..., Engine]) -> None:
    vllm = launch("--backend", "vllm")
    line = f"fakeengine listening on http://{HOST}:{vllm.port} backend=vllm mode=aggregated"
    assert line in vllm.log.read_text()
    state = vllm.state()
    assert state["backend"] == "vllm"
    assert state["mode"] == "aggregated"
    assert state["model"] == "tiny"
    assert state["loading"] is False
    assert state["pid"] == vllm.proc.pid


def test_listening_line_names_the_data_parallel_ranks(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dp-size", "2")
    assert "backend=vllm mode=aggregated dp-size=2" in engine.log.read_text()
    assert engine.state()["dp_size"] == 2


def test_sigterm_exits_zero_and_restart_after_sigkill(launch: Callable[..., Engine]) -> None:
    first = launch("--backend", "openai")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=5)
    second = launch("--backend", "openai", port=first.port)
    assert second.port == first.port
    assert second.get("/health").json() == {"status": "ok"}
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=5) == 0


def test_vllm_loading_refuses_connections(launch: Callable[..., Engine]) -> None:
    port = free_port()
    engine = launch("--backend", "vllm", "--load-seconds", "1.0", port=port, wait=False)
    refused = 0

    def healthy() -> bool:
        nonlocal refused
        try:
            return engine.get("/health", timeout=1.0).status_code == 200
        except httpx.ConnectError:
            refused += 1
            return False

    wait_for(healthy)
    assert refused > 0


# ---------------------------------------------------------------------------------- SGLang


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_sglang_decode_request_without_bootstrap_host_kills_the_server(
    launch: Callable[..., Engine], path: str
) -> None:
    decode = launch("--backend", "sglang", "--mode", "decode")
    body = sglang_generate(bootstrap_room=5) if path == "/generate" else completion()
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        decode.post(path, body)
    # SGLang's clean-up kills its own process tree.
    assert decode.proc.wait(timeout=5) == -signal.SIGKILL
    log = decode.log.read_text()
    assert SGLANG_DECODE_CRASH in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    with pytest.raises(httpx.ConnectError):
        decode.get("/v1/models")


def test_sglang_transfer_backend_fake_refused_by_prefill_only(
    launch: Callable[..., Engine], tmp_path: Path
) -> None:
    env = cli_env()
    port_file = tmp_path / "prefill.port"
    command = [sys.executable, "-m", "fakeengine", "--port", "0"]
    command += ["--port-file", str(port_file), "--disaggregation-transfer-backend", "fake"]
    refused = subprocess.run(
        [*command, "--backend", "sglang", "--mode", "prefill"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert refused.returncode == 1
    assert "Prefill server does not support 'fake' as the transfer backend" in refused.stderr
    assert not port_file.exists()  # it never listened
    other = subprocess.run(
        [*command, "--backend", "vllm"], capture_output=True, text=True, env=env, timeout=30
    )
    assert other.returncode == 2
    assert "--disaggregation-transfer-backend exists only for --backend sglang" in other.stderr

    decode = launch(
        "--backend", "sglang", "--mode", "decode", "--disaggregation-transfer-backend", "fake"
    )
    assert decode.get("/v1/models").status_code == 200
    prefill = launch(
        "--backend",
        "sglang",
        "--mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "mooncake_tcp",
    )
    assert prefill.get("/v1/models").status_code == 200


# ---------------------------------------------------------------------- command-line checks


def test_dev_mode_is_vllm_only() -> None:
    command = [sys.executable, "-m", "fakeengine", "--backend", "sglang", "--dev-mode"]
    refused = subprocess.run(
        [*command, "--port", "0"], capture_output=True, text=True, env=cli_env(), timeout=30
    )
    assert refused.returncode == 2
    assert "--dev-mode (sleep mode) exists only for --backend vllm" in refused.stderr


@pytest.mark.parametrize("backend", ["trtllm", "openai"])
def test_dp_size_is_for_vllm_and_sglang_only(backend: str) -> None:
    env = cli_env()
    command = [sys.executable, "-m", "fakeengine", "--backend", backend, "--port", "0"]
    refused = subprocess.run(
        [*command, "--dp-size", "2"], capture_output=True, text=True, env=env, timeout=30
    )
    assert refused.returncode == 2
    assert "usage:" in refused.stderr
    assert "--dp-size 2: data-parallel ranks exist only for --backend vllm and sglang" in (
        refused.stderr
    )
    zero = subprocess.run(
        [*command, "--dp-size", "0"], capture_output=True, text=True, env=env, timeout=30
    )
    assert zero.returncode == 2
