"""``health-sidecar demo``: see the sidecar work in one command.

Reads the configuration as ``serve`` does (environment, then ``--env-file``), with demo defaults
for what neither sets: canaries on, a short wait. Uses the engine at SIDECAR_ENGINE_URL when one
answers there; otherwise starts the bundled fake engine of the configured backend and role
(``python -m fakeengine``) on a free loopback port, and ends it on exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
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

from sidecar.config import Settings

LOOPBACK = "127.0.0.1"
DEMO_DEFAULTS = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "5",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "2",
    "DYN_SYSTEM_HOST": LOOPBACK,
    "SIDECAR_LIVENESS_WINDOW": "30",
}


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def demo_defaults() -> dict[str, str]:
    """DEMO_DEFAULTS, and a port: 9090 when free, else any free one."""
    return DEMO_DEFAULTS | {"DYN_SYSTEM_PORT": str(9090 if port_free(9090) else free_port())}


def _engine_answers(url: str) -> bool:
    try:
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            return client.get(f"{url.rstrip('/')}/v1/models").status_code < 500
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _fake_engine(backend: str, mode: str) -> Iterator[str]:
    if importlib.util.find_spec("fakeengine") is None:  # the image installs the sidecar alone
        raise SystemExit(
            "health-sidecar demo: no engine answers and the fake engine is not installed "
            "(pip install -e . from a clone has it)"
        )
    # The port file's folder goes with the fake engine: removed once the engine has ended.
    with tempfile.TemporaryDirectory(prefix="health-sidecar-demo-") as folder:
        port_file = Path(folder) / "port"
        argv = [sys.executable, "-m", "fakeengine", "--backend", backend, "--mode", mode]
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


def run(settings: Settings) -> int:
    from sidecar.wiring import run as serve

    base = f"http://{settings.system_host}:{settings.system_port}"
    with contextlib.ExitStack() as stack:
        hint = ""
        if _engine_answers(settings.engine_url):
            print(f"demo: using the engine that answers at {settings.engine_url}")
        else:
            backend, mode = settings.backend.value, settings.disaggregation_mode.value
            print(
                f"demo: no engine answers at {settings.engine_url}; starting the fake {backend} "
                f"engine ({mode})"
            )
            url = stack.enter_context(_fake_engine(backend, mode))
            settings = settings.model_copy(update={"engine_url": url})
            fault = f"curl -s -X POST {url}/_fake/fault -H 'Content-Type: application/json'"
            hint = (
                f"""  hang the engine's GPU loop:  {fault} -d '{{"hang_generation": true}}'\n"""
                f"""  and release it:              {fault} -d '{{"hang_generation": false}}'\n"""
            )
        print(
            f"demo: sidecar on {base} (Ctrl-C to stop). Try:\n"
            f"  curl -s {base}/health\n  curl -s {base}/live\n  curl -s {base}/metrics\n{hint}",
            flush=True,
        )
        return serve(settings)
