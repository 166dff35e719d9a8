"""``health-sidecar demo``: see the sidecar work in one command.

Uses the engine at SIDECAR_ENGINE_URL when one answers there; otherwise starts the bundled fake
engine (``python -m sidecar.fakeengine``) on a free loopback port, and ends it on exit. Canaries
are on with a short wait unless the environment says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"
DEMO_DEFAULTS = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "5",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "2",
    "DYN_SYSTEM_HOST": LOOPBACK,
    "SIDECAR_LIVENESS_WINDOW": "30",
}


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _engine_answers(url: str) -> bool:
    try:
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            return client.get(f"{url.rstrip('/')}/v1/models").status_code < 500
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _fake_engine(backend: str, mode: str) -> Iterator[str]:
    port_file = Path(tempfile.mkdtemp(prefix="health-sidecar-demo-")) / "port"
    argv = [sys.executable, "-m", "sidecar.fakeengine", "--backend", backend, "--mode", mode]
    argv += ["--host", LOOPBACK, "--port", "0", "--port-file", str(port_file)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("health-sidecar demo: the fake engine did not start")
            time.sleep(0.05)
        yield f"http://{LOOPBACK}:{port_file.read_text().strip()}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    from sidecar.cli import main as cli_main

    for key, value in DEMO_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "DYN_SYSTEM_PORT" not in os.environ:
        os.environ["DYN_SYSTEM_PORT"] = str(9090 if _port_free(9090) else _free_port())
    port = os.environ["DYN_SYSTEM_PORT"]
    base = f"http://{os.environ['DYN_SYSTEM_HOST']}:{port}"
    engine_url = os.environ.get("SIDECAR_ENGINE_URL", "http://127.0.0.1:8000")

    with contextlib.ExitStack() as stack:
        if _engine_answers(engine_url):
            print(f"demo: using the engine that answers at {engine_url}")
            hint = ""
        else:
            backend = os.environ.setdefault("SIDECAR_BACKEND", "vllm")
            mode = os.environ.setdefault("SIDECAR_DISAGGREGATION_MODE", "aggregated")
            print(f"demo: no engine answers at {engine_url}; starting the fake {backend} engine")
            engine_url = stack.enter_context(_fake_engine(backend, mode))
            os.environ["SIDECAR_ENGINE_URL"] = engine_url
            hint = (
                f"  hang the engine's GPU loop:  curl -s -X POST {engine_url}/_fake/fault "
                """-d '{"hang_generation": true}'\n"""
                f"  and release it:              curl -s -X POST {engine_url}/_fake/fault "
                """-d '{"hang_generation": false}'\n"""
            )
        print(
            f"demo: sidecar on {base} (Ctrl-C to stop). Try:\n"
            f"  curl -s {base}/health\n  curl -s {base}/live\n  curl -s {base}/metrics\n{hint}",
            flush=True,
        )
        return cli_main([])
