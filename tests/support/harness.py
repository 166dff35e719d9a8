"""Real processes over loopback: the fake engine and the sidecar, started as users start them.

Every process gets its own process group and is ended by it. Ports are free ports on
127.0.0.1; nothing here talks to any other address. Waits poll with deadlines.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

LOOPBACK = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


# Ports are picked below the kernel's ephemeral range, so no socket the kernel numbers itself
# (a bind to port 0, a connect's source port) can take one between its pick and the engine's
# bind: a vLLM rank 0 once found its pre-picked RPC port taken by such a socket. Nor is a port
# handed out twice in one test session.
_PORTS_LOW, _PORTS_HIGH = 10000, min(_ephemeral_low() - 1, 32767)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now, outside the ephemeral range, never handed out before."""
    return free_port_in(_PORTS_LOW, _PORTS_HIGH)


def free_port_in(low: int, high: int) -> int:
    """A free loopback port in [low, high] (Dynamo's DYN_SYSTEM_PORT is an i16: at most 32767),
    never one handed out before in this session."""
    for _ in range(200):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


def wait_until(
    condition: Callable[[], T], timeout: float, interval: float = 0.02, what: str = "condition"
) -> T:
    """Poll ``condition`` until it returns something truthy; return it. Raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = condition()
        except httpx.HTTPError as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def weigh_session(pid: int, nice: int) -> None:
    """Give the session that ``pid`` leads the CPU weight of ``nice``.

    In a pod the engine and the sidecar are containers with CPU cgroups of their own, and the
    sidecar's request guarantees it a share however hard the engine computes. Here every process
    shares one cgroup, and Linux's autogroup makes each session (each ``Proc`` starts one) a
    scheduling group of equal weight, where a process's own nice value counts only inside its
    group. Beside a vLLM computing on both cores, every other process then waited on the run
    queue for up to 1.1-1.8 s at a time (measured with a 10 ms sleep loop, at nice 0 and -20
    alike; SCHED_FIFO saw 10 ms), the sidecar included, and a probe went unanswered for 5 s in
    CI. The engine's session weighted at nice 19 brought the longest wait to 13 ms: that is what
    the cgroups of a pod do. Without autogroup the file is absent and ``nice`` (set on the
    command line above) already weighs the process against the others."""
    with contextlib.suppress(FileNotFoundError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


class Proc:
    """A child process in its own process group, with its output kept in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str, nice: int = 0) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.popen = subprocess.Popen(
            ["nice", "-n", str(nice), *argv] if nice else argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        if nice:
            weigh_session(self.popen.pid, nice)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0, sig: int | None = None) -> int | None:
        """SIGCONT (in case it is frozen), ``sig`` (SIGTERM), then SIGKILL; return the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM if sig is None else sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout)
        self.signal(signal.SIGKILL)  # anything left in the group
        self.log.close()
        return self.popen.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(5)


class Owned:
    """A process a test started and owns (an engine, a worker): its state, and what a test does to
    it, always by its process group. Subclasses set ``proc`` with :meth:`spawn`."""

    proc: Proc | None = None
    started_at: float | None = None

    def spawn(self, argv: list[str], env: dict[str, str], name: str, nice: int = 0) -> Proc:
        self.started_at = time.monotonic()
        self.proc = Proc(argv, env, name, nice=nice)
        return self.proc

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    def _check_alive(self) -> None:
        """Fail at once, with its output, when the process has exited."""
        assert self.proc is not None, "not started"
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"{self.proc.name} exited: {self.proc.output()[-3000:]}")

    def since_start(self) -> float:
        assert self.started_at is not None, "not started"
        return time.monotonic() - self.started_at

    def processes(self) -> dict[int, str]:
        """Its process and descendants: pid -> process title."""
        assert self.proc is not None
        return descendants(self.proc.pid)

    def pid_of(self, title: str, timeout: float = 10) -> int:
        """The pid of the descendant whose process title starts with ``title``."""
        assert self.proc is not None

        def find() -> int | None:
            return next((p for p, n in self.processes().items() if n.startswith(title)), None)

        return wait_until(find, timeout, interval=0.1, what=f"{title} under {self.proc.name}")

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGCONT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _comm_and_cmdline(pid: int) -> tuple[str, str]:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "", ""
    return comm, cmdline.strip()


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(p) for p in children.read_text().split()]
        except OSError:
            continue
    return kids


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid`` (walking /proc/PID/task/*/children): pid -> name, where
    the name is the process title an engine sets (vLLM's ``VLLM::EngineCore``, SGLang's
    ``sglang::scheduler_DP1``): ``comm`` is cut at 15 characters, so the title is taken from the
    command line when it starts with the comm."""
    found: dict[int, str] = {}
    todo = _children(pid)
    while todo:
        child = todo.pop()
        if child in found:
            continue
        comm, cmdline = _comm_and_cmdline(child)
        if not comm:
            continue
        found[child] = cmdline if cmdline.startswith(comm) and "::" in comm else comm
        todo += _children(child)
    return found


def base_env() -> dict[str, str]:
    """The test's environment without variables that would change the sidecar's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "SIDECAR_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class FakeEngine:
    """``python -m fakeengine`` on a free loopback port, restartable on the same port."""

    def __init__(self, backend: str, mode: str = "aggregated", *extra: str) -> None:
        self.backend, self.mode, self.extra = backend, mode, list(extra)
        self.port: int | None = None
        self.proc: Proc | None = None
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, *extra: str, wait: bool = True) -> FakeEngine:
        port_file = Path(tempfile.mkdtemp(prefix="fakeengine-")) / "port"
        argv = [sys.executable, "-m", "fakeengine", "--backend", self.backend]
        argv += ["--mode", self.mode, "--host", LOOPBACK, "--port", str(self.port or 0)]
        argv += ["--port-file", str(port_file), *self.extra, *extra]
        self.proc = Proc(argv, base_env(), f"fakeengine-{self.backend}-{self.mode}")
        if wait:
            wait_until(port_file.exists, 10, what=f"{self.proc.name} to bind")
            self.port = int(port_file.read_text())
        return self

    def restart(self, *extra: str) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.start(*extra)

    def fault(self, **faults: Any) -> dict[str, Any]:
        response = self.http.post(f"{self.url}/_fake/fault", json=faults)
        response.raise_for_status()
        return response.json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.url}/_fake/requests").json()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.http.close()


class Sidecar:
    """``python -m sidecar`` (the installed ``health-sidecar``) on a free loopback port."""

    def __init__(self, env: dict[str, str], argv: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        full = base_env() | {"DYN_SYSTEM_HOST": LOOPBACK, "DYN_SYSTEM_PORT": str(self.port)}
        self.env = full | env
        self.proc = Proc([sys.executable, "-m", "sidecar", *argv], self.env, "sidecar")
        self.http = httpx.Client(timeout=1.0, trust_env=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def wait_serving(self, timeout: float = 10) -> Sidecar:
        def serving() -> bool:
            if self.proc.popen.poll() is not None:
                raise AssertionError(f"sidecar exited: {self.proc.output()}")
            self.http.get(f"{self.url}/live")
            return True

        wait_until(serving, timeout, what="sidecar to serve")
        return self

    def get(self, path: str) -> httpx.Response:
        return self.http.get(f"{self.url}{path}")

    def health(self) -> tuple[int, dict[str, Any]]:
        response = self.get(self.env.get("DYN_SYSTEM_HEALTH_PATH", "/health"))
        return response.status_code, response.json()

    def wait_status(self, code: int, timeout: float, path: str = "/health") -> float:
        """Wait until ``path`` answers ``code``; return the seconds it took."""
        start = time.monotonic()
        wait_until(lambda: self.get(path).status_code == code, timeout, what=f"{path} -> {code}")
        return time.monotonic() - start

    def metrics(self) -> str:
        return self.get("/metrics").text

    def close(self) -> int | None:
        """SIGINT: exit at once (SIGTERM would drain while the engine is still up)."""
        self.http.close()
        return self.proc.stop(sig=signal.SIGINT)


@contextlib.contextmanager
def running(*things: FakeEngine | Sidecar) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            thing.close()
