"""One base for every process a test starts: a real engine, a fake one, a worker, the sidecar.

A :class:`Process` is started in a session (and so a process group) of its own, its output kept
in a log file of the session's log directory (:func:`log_dir`: under the temporary directory,
which the test session points at pytest's basetemp), on a loopback port picked in advance below
the kernel's ephemeral range (:func:`free_port`). It is ready when a poll with a deadline says so
(:meth:`Process.ready`, never a fixed sleep), reached at :attr:`Process.url`, frozen, thawed and
killed by its process group, and stopped by it: SIGCONT (it may be frozen), SIGTERM, then SIGKILL
for whatever is left. A launcher says only what differs: :meth:`Process.argv`,
:meth:`Process.env` and :meth:`Process.ready`.

:class:`Shared` hands one started engine (or a group of them) to each test of a module in turn,
each time after a cheap readiness poll, so that a test that left it broken cannot poison the
next: that one gets it restarted, and the restart is said (a warning). A test that ends the
engine on purpose (kills it) takes it for good (:func:`spends`); the next test to ask for it
gets a fresh one.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import httpx
import pytest

from tests.support.exposition import Samples, samples

LOOPBACK = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


# --- ports ---------------------------------------------------------------------------------------
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


# Ports are picked below the kernel's ephemeral range, so no socket the kernel numbers itself
# (a bind to port 0, a connect's source port) can take one between its pick and the engine's
# bind: a vLLM rank 0 once found its pre-picked RPC port taken by such a socket. Nor is a port
# handed out twice in one test session, so a process restarted on its port finds it free.
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


# --- waiting -------------------------------------------------------------------------------------
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


# --- the session's log directory -----------------------------------------------------------------
#: Where the logs go when set (inherited by child processes); else see :func:`log_dir`.
LOG_DIR_VARIABLE = "HEALTH_SIDECAR_PROCESS_LOGS"
_log_dir: Path | None = None


def set_log_dir(path: str | os.PathLike[str]) -> Path:
    """Put the logs (and work directories) of every process started from now on in ``path``."""
    global _log_dir
    _log_dir = Path(path)
    _log_dir.mkdir(parents=True, exist_ok=True)
    return _log_dir


def log_dir() -> Path:
    """This session's directory of process logs and work directories: ``$HEALTH_SIDECAR_PROCESS_
    LOGS``, or one made on first use in the temporary directory, which the test session points
    at pytest's basetemp (tests/conftest.py), so that nothing lands in /tmp itself."""
    if _log_dir is None:
        configured = os.environ.get(LOG_DIR_VARIABLE)
        if configured:
            return set_log_dir(configured)
        return set_log_dir(tempfile.mkdtemp(prefix="processes-"))
    return _log_dir


# --- processes -----------------------------------------------------------------------------------
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


def base_env() -> dict[str, str]:
    """The test's environment without variables that would change the sidecar's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "SIDECAR_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """A child process in its own session and process group, its output (stdout and stderr)
    in a log file of :func:`log_dir`. The primitive under :class:`Process`; also for a command
    that serves nothing (a client, a tool)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        name: str,
        nice: int = 0,
        cwd: str | os.PathLike[str] = ROOT,
    ) -> None:
        self.name = name
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir())
        os.close(fd)
        self.log_path = Path(path)
        self.log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            ["nice", "-n", str(nice), *argv] if nice else argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
        if nice:
            weigh_session(self.popen.pid, nice)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Signal the whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0, sig: int | None = None, group: bool = True) -> int | None:
        """SIGCONT (in case it is frozen), ``sig`` (SIGTERM) to the group (or, ``group`` false,
        to the leader alone, which then ends its children), SIGKILL after ``timeout``, and
        SIGKILL to whatever is left in the group; return the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            term = signal.SIGTERM if sig is None else sig
            if group:
                self.signal(term)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, term)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout)
        self.signal(signal.SIGKILL)  # anything left in the group
        self.log.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL to the whole group, and reap the leader."""
        self.signal(signal.SIGKILL)
        self.popen.wait(5)


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


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP: state T), from /proc/PID/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :].split()[0] in ("T", "t")


class Process:
    """A server process a test starts and owns: an engine, a worker, a fake, the sidecar.

    A launcher sets ``name`` and says :meth:`argv`, :meth:`env` and :meth:`ready`; the base
    gives it a port (:func:`free_port`, picked at construction and kept over restarts), starts
    it in its own process group with its log in :func:`log_dir`, polls :meth:`ready` with a
    deadline, and freezes, thaws, kills and stops it by its process group."""

    name: str = "process"
    host: str = LOOPBACK
    nice: int = 0
    start_timeout: float = 30.0  # seconds for :meth:`ready` after a start
    ready_interval: float = 0.1
    handover_timeout: float = 10.0  # seconds for :meth:`ready` at a hand-over (:class:`Shared`)
    stop_timeout: float = 5.0  # seconds between SIGTERM and SIGKILL
    stop_signal: int = signal.SIGTERM
    stop_group: bool = True  # SIGTERM to the whole group, or to the leader alone
    http_timeout: float = 2.0

    proc: Proc | None = None
    started_at: float | None = None
    ready_after: float | None = None
    _http: httpx.Client | None = None
    _workdir: Path | None = None

    def __init__(self, port: int | None = None) -> None:
        self.port = free_port() if port is None else port

    # --- what a launcher says ---------------------------------------------------------------
    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return base_env()

    def ready(self) -> Any:
        """One readiness check: truthy once ready (an HTTP error counts as not yet). The default:
        its port accepts a connection."""
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 1):
            return True
        return False

    # --- where it is ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def http(self) -> httpx.Client:
        """A client of its own (never the environment's proxies), made again after close()."""
        if self._http is None or self._http.is_closed:
            self._http = httpx.Client(timeout=self.http_timeout, trust_env=False)
        return self._http

    @property
    def workdir(self) -> Path:
        """A directory of its own in :func:`log_dir` (port files, its TMPDIR), made on first use."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=log_dir()))
        return self._workdir

    # --- start ------------------------------------------------------------------------------
    def spawn(
        self, argv: list[str], env: dict[str, str], name: str | None = None, nice: int | None = None
    ) -> Proc:
        """Start ``argv`` as this process (its own group, its log), without waiting; what is
        left of an earlier start is ended first."""
        if self.proc is not None:
            self.proc.stop(self.stop_timeout, sig=self.stop_signal, group=self.stop_group)
        self.started_at = time.monotonic()
        self.ready_after = None
        self.proc = Proc(argv, env, name or self.name, nice=self.nice if nice is None else nice)
        return self.proc

    def start(self, *, wait: bool = True, timeout: float | None = None) -> Self:
        self.spawn(self.argv(), self.env())
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll :meth:`ready` until it holds (failing at once, with the log, if the process
        exits); return the seconds since the start."""
        self._poll_ready(self.start_timeout if timeout is None else timeout)
        self.ready_after = self.since_start()
        return self.ready_after

    def _poll_ready(self, timeout: float) -> Any:
        def ready() -> Any:
            self._check_alive()
            return self.ready()

        return wait_until(ready, timeout, interval=self.ready_interval, what=f"{self.name} ready")

    # --- state ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name}: not started"
        return self.proc.pid

    def output(self) -> str:
        assert self.proc is not None, f"{self.name}: not started"
        return self.proc.output()

    def _check_alive(self) -> None:
        """Fail at once, with its output, when the process has exited."""
        assert self.proc is not None, f"{self.name}: not started"
        if self.proc.popen.poll() is not None:
            raise AssertionError(
                f"{self.proc.name} exited ({self.proc.popen.returncode}): "
                f"{self.proc.output()[-3000:]}"
            )

    def since_start(self) -> float:
        assert self.started_at is not None, f"{self.name}: not started"
        return time.monotonic() - self.started_at

    def processes(self) -> dict[int, str]:
        """Its descendants: pid -> process title."""
        assert self.proc is not None, f"{self.name}: not started"
        return descendants(self.proc.pid)

    def pid_of(self, title: str, timeout: float = 10) -> int:
        """The pid of the descendant whose process title starts with ``title``."""

        def find() -> int | None:
            return next((p for p, n in self.processes().items() if n.startswith(title)), None)

        return wait_until(find, timeout, interval=0.1, what=f"{title} under {self.name}")

    def stopped(self) -> list[int]:
        """Its processes (itself and its descendants) that are stopped (SIGSTOP)."""
        if not self.running:
            return []
        return [p for p in (self.pid, *self.processes()) if is_stopped(p)]

    def unhealthy(self, timeout: float | None = None) -> str | None:
        """Why it cannot be handed to the next test, or None: exited, a process of it stopped,
        or :meth:`ready` not holding within ``timeout`` (:attr:`handover_timeout`)."""
        if self.proc is None:
            return "not started"
        code = self.proc.popen.poll()
        if code is not None:
            return f"exited ({code})"
        frozen = self.stopped()
        if frozen:
            return f"stopped (SIGSTOP): pids {frozen}"
        try:
            self._poll_ready(self.handover_timeout if timeout is None else timeout)
        except AssertionError as exc:
            return str(exc)[:500]
        return None

    # --- faults -----------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Signal its whole process group."""
        assert self.proc is not None, f"{self.name}: not started"
        self.proc.signal(sig)

    def freeze(self, pid: int | None = None) -> None:
        """SIGSTOP its whole process group, or the one process ``pid`` of it."""
        if pid is None:
            self.signal(signal.SIGSTOP)
        else:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self, pid: int | None = None) -> None:
        """SIGCONT its whole process group, or the one process ``pid`` of it."""
        if pid is None:
            self.signal(signal.SIGCONT)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL its whole process group."""
        assert self.proc is not None, f"{self.name}: not started"
        self.proc.kill()

    # --- end --------------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> int | None:
        """End it by its process group (SIGCONT, SIGTERM, then SIGKILL); return its exit code.
        It can be started again (on the same port)."""
        if self.proc is None:
            return None
        limit = self.stop_timeout if timeout is None else timeout
        return self.proc.stop(limit, sig=self.stop_signal, group=self.stop_group)

    def close(self) -> int | None:
        """:meth:`stop`, and its HTTP client closed."""
        code = self.stop()
        if self._http is not None:
            self._http.close()
        return code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsServer(Process):
    """An engine with a Prometheus ``/metrics`` route."""

    def metrics_text(self, timeout: float = 5) -> str:
        answer = self.http.get(f"{self.url}/metrics", timeout=timeout)
        answer.raise_for_status()
        return answer.text

    def metrics(self, timeout: float = 5) -> Samples:
        """Its samples: {(name, labels): value}."""
        return samples(self.metrics_text(timeout))


class Command(Process):
    """A server process given whole: its argv, environment and readiness check."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        port: int | None = None,
        ready: Callable[[], Any] | None = None,
        start_timeout: float | None = None,
    ) -> None:
        super().__init__(port)
        self.name = name
        self._argv, self._env, self._ready = list(argv), env, ready
        if start_timeout is not None:
            self.start_timeout = start_timeout

    def argv(self) -> list[str]:
        return self._argv

    def env(self) -> dict[str, str]:
        return base_env() if self._env is None else self._env

    def ready(self) -> Any:
        return super().ready() if self._ready is None else self._ready()


def read_port_file(path: Path) -> int | None:
    """The port a process wrote to ``path`` (written whole, then renamed), or None yet."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


# --- engines shared by a module's tests ----------------------------------------------------------
class EngineRestarted(UserWarning):
    """A shared engine was not healthy when handed to the next test, and was restarted."""


def unhealthy(value: Any) -> str | None:
    """Why ``value`` (a :class:`Process`, or a tuple, list or dict of them) cannot be handed
    over, or None."""
    if isinstance(value, Process):
        return value.unhealthy()
    members: Iterable[Any] = value.values() if isinstance(value, dict) else value
    for member in members:
        why = unhealthy(member)
        if why is not None:
            return f"{getattr(member, 'name', member)}: {why}"
    return None


_SPENDS = "_spends_shared"


def spends(*fixtures: str) -> Callable[[T], T]:
    """Mark a test that ends (kills) the shared engines of ``fixtures``: it gets them for good,
    and the next test that asks for them gets fresh ones."""

    def mark(test: T) -> T:
        setattr(test, _SPENDS, (*getattr(test, _SPENDS, ()), *fixtures))
        return test

    return mark


class Shared(Generic[T]):
    """One engine (or a group) for the tests of a module: started on first use by ``open`` (a
    context manager that starts it and ends it on exit), then handed to each test after a cheap
    readiness poll (``check``: :func:`unhealthy`). Not healthy, it is ended and started again,
    and a warning says so. Use it from a module-scoped fixture (``with Shared(...) as pool``) and
    hand it over in a function-scoped one (``pool.hand_over(request)``)."""

    def __init__(
        self,
        name: str,
        open: Callable[[], AbstractContextManager[T]],
        check: Callable[[T], str | None] = unhealthy,
    ) -> None:
        self.name, self.open, self.check = name, open, check
        self._stack: ExitStack | None = None
        self._value: T | None = None
        self._spent = False
        self.starts = 0
        self.restarts = 0

    @property
    def current(self) -> T:
        """The engine as the last test left it (no readiness poll)."""
        assert self._value is not None, f"{self.name}: not started"
        return self._value

    def _start(self) -> T:
        stack = ExitStack()
        try:
            self._value = stack.enter_context(self.open())
        except BaseException:
            stack.close()
            raise
        self._stack, self._spent = stack, False
        self.starts += 1
        return self._value

    def _end(self) -> None:
        stack, self._stack, self._value, self._spent = self._stack, None, None, False
        if stack is not None:
            stack.close()

    def get(self) -> T:
        """The running engine, healthy (restarted, and said so, when it was not)."""
        if self._spent:
            self._end()  # a test took it for good: a fresh one
        if self._stack is not None:
            assert self._value is not None
            why = self.check(self._value)
            if why is not None:
                message = f"{self.name}: not healthy at hand-over ({why}); restarting it"
                print(f"\n{message}", file=sys.stderr)
                warnings.warn(message, EngineRestarted, stacklevel=2)
                self._end()
                self.restarts += 1
        if self._stack is None:
            return self._start()
        assert self._value is not None
        return self._value

    def spend(self) -> T:
        """The running engine for good (a test that kills it): ended before the next test
        gets one, or with the module."""
        value = self.get()
        self._spent = True
        return value

    def adopt(self, value: T, stop: Callable[[T], object]) -> bool:
        """Take ``value``, started by a test, as the shared engine when none runs and it is
        healthy (``stop`` ends it later); return whether it was taken."""
        if self._stack is not None or self.check(value) is not None:
            return False
        stack = ExitStack()
        stack.callback(stop, value)
        self._stack, self._value, self._spent = stack, value, False
        self.starts += 1
        return True

    def hand_over(self, request: Any) -> T:
        """For a function-scoped fixture: :meth:`spend` when the requesting test is marked
        :func:`spends` for this fixture, else :meth:`get`."""
        spenders = getattr(getattr(request, "function", None), _SPENDS, ())
        return self.spend() if request.fixturename in spenders else self.get()

    def close(self) -> None:
        self._end()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def handed_over(name: str) -> Any:
    """A function-scoped fixture ``name`` that hands each test the engine of the module's
    fixture ``<name>_pool`` (a :class:`Shared`): ``server = handed_over("server")``."""

    pool_name = f"{name}_pool"

    def fixture(request: pytest.FixtureRequest, **pool: Shared[Any]) -> Any:
        """The engine of the module's ``<name>_pool``, healthy (restarted if it was not)."""
        return pool[pool_name].hand_over(request)

    # pytest reads what a fixture needs from its signature: the pool, by its name.
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fixture.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("request", keyword), inspect.Parameter(pool_name, keyword)]
    )
    return pytest.fixture(name=name)(fixture)


P = TypeVar("P", bound=Process)


@contextlib.contextmanager
def started(process: P, **start: Any) -> Iterator[P]:
    """``process`` started (``start``'s keywords), and closed on exit, started or not."""
    try:
        yield process.start(**start)
    finally:
        process.close()
