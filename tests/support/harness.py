"""Real processes over loopback: the fake engine and the sidecar, started as users start them.

Every process is a :class:`tests.support.processes.Process`: its own process group, ended by it;
a free port on 127.0.0.1 (nothing here talks to any other address); readiness polled with a
deadline; its log in the session's log directory. The primitives (ports, waits, ``Proc``) are
:mod:`tests.support.processes`', named here too for the tests and benchmarks that import them
from here.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import (
    LOOPBACK,
    ROOT,
    Proc,
    Process,
    base_env,
    free_port,
    read_port_file,
    wait_until,
)

# What the tests and benchmarks import from here.
__all__ = ["LOOPBACK", "ROOT", "FakeEngine", "Proc", "Sidecar", "base_env", "free_port"]
__all__ += ["running", "wait_until"]


class FakeEngine(Process):
    """``python -m fakeengine`` on a free loopback port, restartable on the same port: the port
    is picked below the ephemeral range (no client socket can take it while the engine is down),
    and the engine's port file says when it listens."""

    start_timeout = 10.0
    ready_interval = 0.02

    def __init__(self, backend: str, mode: str = "aggregated", *extra: str) -> None:
        super().__init__()
        self.backend, self.mode, self.extra = backend, mode, list(extra)
        self.name = f"fakeengine-{backend}-{mode}"
        self._start_extra: tuple[str, ...] = ()

    @property
    def port_file(self) -> Path:
        return self.workdir / "port"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "fakeengine", "--backend", self.backend]
        argv += ["--mode", self.mode, "--host", LOOPBACK, "--port", str(self.port)]
        return [*argv, "--port-file", str(self.port_file), *self.extra, *self._start_extra]

    def ready(self) -> bool:
        return read_port_file(self.port_file) == self.port

    def start(self, *extra: str, wait: bool = True) -> FakeEngine:
        self._start_extra = extra
        self.port_file.unlink(missing_ok=True)
        return super().start(wait=wait)

    def restart(self, *extra: str) -> None:
        self.kill()
        self.start(*extra)

    def fault(self, **faults: Any) -> dict[str, Any]:
        response = self.http.post(f"{self.url}/_fake/fault", json=faults)
        response.raise_for_status()
        return response.json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.url}/_fake/requests").json()


class Sidecar(Process):
    """``python -m sidecar`` (the installed ``health-sidecar``) on a free loopback port, started
    at once; :meth:`wait_serving` waits for it to answer."""

    name = "sidecar"
    http_timeout = 1.0
    start_timeout = 10.0
    ready_interval = 0.02
    stop_signal = signal.SIGINT  # exit at once (SIGTERM would drain while the engine is up)

    def __init__(self, env: dict[str, str], argv: tuple[str, ...] = ()) -> None:
        super().__init__()
        full = base_env() | {"DYN_SYSTEM_HOST": LOOPBACK, "DYN_SYSTEM_PORT": str(self.port)}
        self.variables = full | env
        self.args = tuple(argv)
        self.start(wait=False)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "sidecar", *self.args]

    def env(self) -> dict[str, str]:
        return self.variables

    def ready(self) -> bool:
        self.http.get(f"{self.url}/live")  # any answer: it serves
        return True

    def wait_serving(self, timeout: float = 10) -> Sidecar:
        self.wait_ready(timeout)
        return self

    def get(self, path: str) -> httpx.Response:
        return self.http.get(f"{self.url}{path}")

    def health(self) -> tuple[int, dict[str, Any]]:
        response = self.get(self.variables.get("DYN_SYSTEM_HEALTH_PATH", "/health"))
        return response.status_code, response.json()

    def wait_status(self, code: int, timeout: float, path: str = "/health") -> float:
        """Wait until ``path`` answers ``code``; return the seconds it took."""
        start = time.monotonic()
        wait_until(lambda: self.get(path).status_code == code, timeout, what=f"{path} -> {code}")
        return time.monotonic() - start

    def metrics(self) -> str:
        return self.get("/metrics").text


@contextlib.contextmanager
def running(*things: Process) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            thing.close()
