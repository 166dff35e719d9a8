from __future__ import annotations

import _posixsubprocess
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import FakeEngine, Sidecar
from tests.support.residue_watch import _health_sidecar_residue as watch

# Short timings keep the suite fast and steady on a busy 2-core machine.
FAST = {
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
}


@pytest.fixture
def engine() -> Iterator[Callable[..., FakeEngine]]:
    """Start fake engines; every one is ended when the test ends, pass or fail."""
    started: list[FakeEngine] = []

    def start(backend: str, mode: str = "aggregated", *extra: str) -> FakeEngine:
        fake = FakeEngine(backend, mode, *extra)
        started.append(fake)
        return fake.start()

    yield start
    for fake in reversed(started):
        fake.close()


@pytest.fixture
def sidecar() -> Iterator[Callable[..., Sidecar]]:
    """Start sidecars as users do (python -m sidecar); ended when the test ends."""
    started: list[Sidecar] = []

    def start(env: dict[str, str], *argv: str, wait: bool = True) -> Sidecar:
        proc = Sidecar(FAST | env, argv)
        started.append(proc)
        return proc.wait_serving() if wait else proc

    yield start
    for proc in reversed(started):
        proc.close()


# --- tiers (docs/develop/testing.md) -------------------------------------------------------------

TIERS = ("unit", "process", "engine", "system")
# A test that runs longer than its tier allows is hung, not slow: pytest-timeout fails it and
# prints every thread's stack. (A real engine's start-up, paid once per module, counts in the
# first test that uses it.)
TIMEOUTS = {"unit": 60, "process": 300, "engine": 1200, "system": 900}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: a test without a tier fails every run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test carries exactly one tier marker; collection fails naming those that do not."""
    wrong = []
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {' and '.join(tiers) or 'no tier'}")
    for item in items:
        tier = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
        if tier is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUTS[tier]))
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) without exactly one tier marker (one of {', '.join(TIERS)}: "
            "pytestmark = pytest.mark.<tier> in the module, or on the test; "
            "docs/develop/testing.md says which):\n" + "\n".join(wrong)
        )


class UnitTierViolation(pytest.fail.Exception):
    """A unit test started a process, used a network socket or slept. A BaseException (as
    pytest.fail's), so that no ``except Exception`` in the code under test swallows it."""


# Socket methods that reach the network: making a connection or a listener, and traffic on one
# (also on a connection a fixture opened earlier and a client keeps in its pool).
NETWORK_METHODS = (
    "connect",
    "connect_ex",
    "bind",
    "listen",
    "accept",
    "send",
    "sendall",
    "sendto",
    "sendmsg",
    "sendfile",
    "recv",
    "recv_into",
    "recvfrom",
    "recvfrom_into",
    "recvmsg",
)


@dataclass
class UnitGuard:
    """What the unit tier forbids, made to fail the test at once. Every violation is also kept,
    so that the phase fails even when the code under test caught the raise."""

    nodeid: str
    violations: list[str] = field(default_factory=list)

    def forbid(self, what: str) -> None:
        message = (
            f"{what}: not allowed in the unit tier (no subprocess, no network socket, no "
            f"time.sleep). Mark {self.nodeid} process, engine or system instead, or make it "
            "in-process: docs/develop/testing.md"
        )
        self.violations.append(message)
        raise UnitTierViolation(message, pytrace=True)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        forbid = self.forbid
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:
            if seconds > 0:
                forbid(f"time.sleep({seconds!r})")
            real_sleep(seconds)

        monkeypatch.setattr(time, "sleep", sleep)

        def execute_child(popen: subprocess.Popen[Any], args: Any, *rest: Any) -> None:
            forbid(f"subprocess.Popen({args!r})")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)

        def process_maker(name: str) -> Callable[..., Any]:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                forbid(f"{name}({', '.join(repr(a) for a in args[:2])})")

            return refuse

        # What subprocess, multiprocessing and asyncio start processes with, and the os calls.
        monkeypatch.setattr(_posixsubprocess, "fork_exec", process_maker("fork_exec"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, process_maker(f"os.{name}"))

        def async_process_maker(name: str) -> Callable[..., Any]:
            async def refuse(*args: Any, **kwargs: Any) -> Any:
                forbid(f"{name}({', '.join(repr(a) for a in args[:2])})")

            return refuse

        for name in ("create_subprocess_exec", "create_subprocess_shell"):
            refuse = async_process_maker(f"asyncio.{name}")
            monkeypatch.setattr(asyncio, name, refuse)
            monkeypatch.setattr(asyncio.subprocess, name, refuse)

        # Network sockets. AF_UNIX stays open: event loops wake themselves over a socketpair.
        # Sockets made in C (gRPC's core, uvloop) are out of reach here.
        network = (socket.AF_INET, socket.AF_INET6)

        def network_guard(name: str) -> Callable[..., Any]:
            real = getattr(socket.socket, name)

            def guarded(sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
                if sock.family in network:
                    if name in ("connect", "connect_ex", "bind", "sendto"):
                        forbid(f"socket.{name}({args[-1]!r})")
                    try:
                        peer = f" with {sock.getpeername()!r}"
                    except OSError:
                        peer = ""
                    forbid(f"socket.{name} on a network socket{peer}")
                return real(sock, *args, **kwargs)

            return guarded

        for name in NETWORK_METHODS:
            monkeypatch.setattr(socket.socket, name, network_guard(name))


UNIT_GUARD = pytest.StashKey[UnitGuard]()


def _guarded(item: pytest.Item) -> Generator[None, object, object]:
    """Run one phase of a unit test (setup, call or teardown) under its guard: the setup of a
    module's fixtures too, when a unit test is the first to ask for them."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    guard = item.stash.setdefault(UNIT_GUARD, UnitGuard(item.nodeid))
    before = len(guard.violations)
    with pytest.MonkeyPatch.context() as monkeypatch:
        guard.install(monkeypatch)
        try:
            result = yield
        except UnitTierViolation:
            raise
        except BaseException as exc:
            if len(guard.violations) > before:  # the code under test raised something else
                raise UnitTierViolation(guard.violations[before], pytrace=False) from exc
            raise
    if len(guard.violations) > before:  # caught by the code under test: fail the phase anyway
        raise UnitTierViolation("\n".join(guard.violations[before:]), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


# --- no residue: nothing left in the temp directory, no process left running ---------------------

SESSION_MARKER = "HEALTH_SIDECAR_TEST_SESSION"  # every process the tests start inherits it
PROCESS_GRACE = 3.0  # seconds for processes killed at teardown to be gone from /proc
# Its sitecustomize watches, in each Python process the tests start, what it makes in the
# temporary directory: residue is what the session made, not what other programs wrote meanwhile.
WATCH = Path(watch.__file__).parent


@dataclass
class Residue:
    temp_root: Path  # the temp directory before the session redirected it
    temp_before: set[str]
    session_tmp: Path
    session_id: str
    saved_env: str | None
    saved_tempdir: str | None
    saved_marker: str | None
    children_before: set[int]  # processes of the session before it started: not its residue
    saved_pythonpath: str | None
    watch_log: Path  # where the session's other Python processes record what they made
    made: set[str] = field(default_factory=set)  # what pytest's own process made
    found: list[str] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)  # made meanwhile by other programs


RESIDUE = pytest.StashKey[Residue]()


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, from /proc/PID/stat; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


def _carries(pid: int, session_id: str) -> bool:
    """Whether the process was started with this session's marker (a pytest run by a test adds
    its own session to the marker it inherits: SESSION_MARKER=outer,inner)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    prefix = f"{SESSION_MARKER}=".encode()
    for entry in environ:
        if entry.startswith(prefix):
            return session_id.encode() in entry.removeprefix(prefix).split(b",")
    return False


def session_processes(root: int, session_id: str) -> dict[int, str]:
    """Live processes of this session: descendants of ``root`` (pytest), and processes whose
    environment carries the session's marker (also those that left their parent for init, in
    sessions and process groups of their own). pid -> command line."""
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    found = {}
    for pid, (_ppid, state) in stats.items():
        if pid == root or state in ("Z", "X"):  # a zombie is gone; its parent has yet to reap it
            continue
        ancestor, seen = pid, set()
        while ancestor in stats and ancestor not in (0, 1, root) and ancestor not in seen:
            seen.add(ancestor)
            ancestor = stats[ancestor][0]
        if ancestor == root or _carries(pid, session_id):
            found[pid] = _cmdline(pid)
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Record the temp directory's entries and this process's children; point TMPDIR (here and
    in every child) at a directory under pytest's basetemp, which a passing run removes."""
    config = session.config
    temp_root = Path(tempfile.gettempdir())
    temp_before = set(os.listdir(temp_root))  # before pytest makes its own root there
    basetemp = config._tmp_path_factory.getbasetemp()  # what the tmp_path_factory fixture uses
    session_tmp = basetemp / "tmp"
    session_tmp.mkdir(exist_ok=True)
    session_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # beside basetemp, not in it: pytest removes a passing run's basetemp before the check reads it
    watch_log = basetemp.parent / f"residue-watch-{session_id}"
    watch_log.mkdir()
    config.stash[RESIDUE] = residue = Residue(
        temp_root=temp_root,
        temp_before=temp_before,
        session_tmp=session_tmp,
        session_id=session_id,
        saved_env=os.environ.get("TMPDIR"),
        saved_tempdir=tempfile.tempdir,
        saved_marker=os.environ.get(SESSION_MARKER),
        children_before=set(session_processes(os.getpid(), session_id)),
        saved_pythonpath=os.environ.get("PYTHONPATH"),
        watch_log=watch_log,
    )
    pass_over = _pytest_roots(residue, config)
    watch.install(str(temp_root), pass_over, residue.made.add)
    os.environ[watch.ROOT] = str(temp_root)
    os.environ[watch.LOG] = str(watch_log)
    os.environ[watch.PASS_OVER] = os.pathsep.join(sorted(pass_over))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(WATCH), residue.saved_pythonpath)))
    os.environ["TMPDIR"] = str(session_tmp)
    tempfile.tempdir = str(session_tmp)
    outer = os.environ.get(SESSION_MARKER)
    os.environ[SESSION_MARKER] = f"{outer},{session_id}" if outer else session_id


def _pytest_roots(residue: Residue, config: pytest.Config) -> set[str]:
    """The temp directory's entries that hold pytest's own basetemp (pytest-of-USER)."""
    basetemp = config._tmp_path_factory.getbasetemp().resolve()
    root = residue.temp_root.resolve()
    return {basetemp.relative_to(root).parts[0]} if basetemp.is_relative_to(root) else set()


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run (exit status 1) when the tests left entries in the temp directory or
    processes running; list them, and end those processes."""
    config = session.config
    residue = config.stash.get(RESIDUE, None)
    if residue is None:
        return
    try:
        before = residue.children_before
        deadline = time.monotonic() + PROCESS_GRACE
        while True:
            alive = {
                pid: what
                for pid, what in session_processes(os.getpid(), residue.session_id).items()
                if pid not in before
            }
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for pid, cmdline in sorted(alive.items()):
            residue.found.append(f"process {pid} still running: {cmdline[:200]} (killed)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = set(os.listdir(residue.temp_root)) - residue.temp_before
        left -= _pytest_roots(residue, config)
        made = residue.made | watch.recorded(str(residue.watch_log))
        shutil.rmtree(residue.watch_log, ignore_errors=True)
        residue.passed_over = sorted(left - made)
        for name in sorted(left & made):
            path = residue.temp_root / name
            kind = "directory" if path.is_dir() else "file"
            residue.found.append(f"{kind} left in {residue.temp_root}: {path}")
        if residue.found and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        for name, value in (
            ("TMPDIR", residue.saved_env),
            (SESSION_MARKER, residue.saved_marker),
            ("PYTHONPATH", residue.saved_pythonpath),
            (watch.ROOT, None),
            (watch.LOG, None),
            (watch.PASS_OVER, None),
        ):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = residue.saved_tempdir


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove pytest's own root in the temp directory (pytest-of-USER) when this session made it
    and a passing run left it empty: pytest removes the run's basetemp, never its parent."""
    residue = config.stash.get(RESIDUE, None)
    if residue is None:
        return
    for name in _pytest_roots(residue, config) - residue.temp_before:
        with contextlib.suppress(OSError):  # not empty: a failing run keeps its files to read
            (residue.temp_root / name).rmdir()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    residue = config.stash.get(RESIDUE, None)
    if residue is None:
        return
    reporter = terminalreporter
    if residue.passed_over:
        over = residue.passed_over
        names = ", ".join(over[:5]) + (", ..." if len(over) > 5 else "")
        reporter.line(
            f"residue check: passed over {len(over)} new entries in "
            f"{residue.temp_root} that no process of the tests made ({names})"
        )
    if not residue.found:
        return
    reporter.section("residue: the run fails (exit status 1)", sep="=", red=True, bold=True)
    reporter.line("The tests left behind (every test writes under tmp_path and ends what it")
    reporter.line("starts: docs/develop/testing.md).")
    for line in residue.found:
        reporter.line(f"  {line}", red=True)
