"""The tiers stay true and a run leaves nothing behind (tests/conftest.py).

Every test carries exactly one tier, or collection fails; a unit test that starts a process,
uses a network socket or sleeps on the wall clock fails at once; and a run whose tests leave an
entry in the temporary directory or a process running fails, naming them. Each is shown on a
throwaway test run in-process by pytester (the unit tier) or as ``python -m pytest`` (the
process tier).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SESSION_MARKER, UNIT_GUARD, UnitGuard, UnitTierViolation
from tests.support.harness import ROOT, base_env

pytest_plugins = ["pytester"]

# A throwaway run with the suite's tier rules: its markers, and the hooks of tests/conftest.py.
HOOKS = """
from tests.conftest import (
    pytest_collection_modifyitems,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)
"""


@pytest.fixture
def tiered(pytester: pytest.Pytester) -> pytest.Pytester:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    markers = options["ini_options"]["markers"]
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    " + "\n    ".join(markers)
    )
    pytester.makeconftest(HOOKS)
    return pytester


def failures(reprec: pytest.HookRecorder) -> dict[str, str]:
    """Test name -> the text of its failed (or errored) phase."""
    failed = {}
    for report in reprec.getreports("pytest_runtest_logreport"):
        if report.failed:
            failed.setdefault(report.nodeid.split("::")[-1], report.longreprtext)
    return failed


# --- every test has one tier ---------------------------------------------------------------------


@pytest.mark.unit
def test_a_test_without_a_tier_or_with_two_fails_collection_naming_each(tiered):
    tiered.makepyfile(
        test_throwaway="""
        import pytest

        def test_without_a_tier():
            pass

        @pytest.mark.unit
        @pytest.mark.process
        def test_with_two():
            pass

        @pytest.mark.unit
        def test_with_one():
            pass
        """
    )
    result = tiered.runpytest("-m", "unit")  # before the selection: no tier drifts unseen
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    error = result.stderr.str()
    assert "2 test(s) without exactly one tier marker" in error, error
    assert "test_throwaway.py::test_without_a_tier: no tier" in error
    assert "test_throwaway.py::test_with_two: process and unit" in error
    assert "test_with_one" not in error


# --- the unit tier: no process, no network socket, no wall-clock sleep ---------------------------

FORBIDDEN = {
    "test_subprocess": ('subprocess.run(["true"])', r"subprocess\.Popen\(\['true'\]\)"),
    "test_os_system": ('os.system("true")', r"os\.system\('true'\)"),
    "test_fork": ("os.fork()", r"os\.fork"),
    "test_posix_spawn": ('os.posix_spawn("/bin/true", ["true"], {})', r"os\.posix_spawn"),
    "test_asyncio_subprocess": (
        'asyncio.run(asyncio.create_subprocess_exec("true"))',
        r"asyncio\.create_subprocess_exec",
    ),
    "test_connect": (
        'socket.create_connection(("127.0.0.1", 9), timeout=1)',
        r"socket\.connect\(\('127\.0\.0\.1', 9\)\)",
    ),
    "test_connect_ex": (
        'with socket.socket() as s: s.connect_ex(("127.0.0.1", 9))',
        r"socket\.connect_ex",
    ),
    "test_bind_ipv6": (
        'with socket.socket(socket.AF_INET6) as s: s.bind(("::1", 0))',
        r"socket\.bind\(\('::1', 0\)\)",
    ),
    "test_udp": (
        'with socket.socket(type=socket.SOCK_DGRAM) as s: s.sendto(b"x", ("127.0.0.1", 9))',
        r"socket\.sendto",
    ),
    "test_sleep": ("time.sleep(0.01)", r"time\.sleep\(0\.01\)"),
    "test_swallowed": (
        "try:\n        time.sleep(0.01)\n    except BaseException:\n        pass",
        r"time\.sleep\(0\.01\)",
    ),
    "test_module_fixture": ("assert started", r"subprocess\.Popen\(\['true'\]\)"),
}

ALLOWED = '''
async def asgi(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"in-process"})


def test_allowed():
    """A socketpair (AF_UNIX, as event loops use), sleep(0), an event loop, an in-process ASGI
    transport and the test's own files."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    time.sleep(0)

    async def get():
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return (await client.get("/")).text

    assert asyncio.run(get()) == "in-process"
'''


def throwaway_unit_tests() -> str:
    body = "import asyncio, os, socket, subprocess, time\n\nimport httpx\nimport pytest\n\n"
    body += "pytestmark = pytest.mark.unit\n\n\n"
    body += "@pytest.fixture(scope='module')\ndef started():\n"
    body += "    return subprocess.run(['true'])\n\n\n"
    for name, (code, _) in FORBIDDEN.items():
        args = "started" if name == "test_module_fixture" else ""
        body += f"def {name}({args}):\n    {code}\n\n\n"
    return body + ALLOWED


@pytest.mark.unit
def test_each_forbidden_thing_fails_a_unit_test_at_once_and_naming_it(tiered):
    tiered.makepyfile(test_throwaway=throwaway_unit_tests())
    reprec = tiered.inline_run("-p", "no:randomly")
    failed = failures(reprec)
    assert set(failed) == set(FORBIDDEN), failed
    for name, (_, said) in FORBIDDEN.items():
        assert re.search(said, failed[name]), (name, failed[name])
        assert "not allowed in the unit tier" in failed[name]
        assert f"Mark test_throwaway.py::{name} process, engine or system" in failed[name]
    passed = [r.nodeid for r in reprec.getreports("pytest_runtest_logreport") if r.passed]
    assert "test_throwaway.py::test_allowed" in passed


@pytest.mark.unit
def test_the_guard_is_on_for_unit_tests_and_raises_what_no_except_exception_catches(request):
    guard = request.node.stash[UNIT_GUARD]
    assert isinstance(guard, UnitGuard)
    assert not issubclass(UnitTierViolation, Exception)

    def code_under_test() -> None:
        with contextlib.suppress(Exception):  # cannot swallow the violation
            time.sleep(1)

    with pytest.raises(UnitTierViolation, match=r"time\.sleep\(1\)"):
        code_under_test()
    guard.violations.clear()  # shown; this test itself passes


# --- the other tiers are not guarded; a connection opened before is still caught ----------------


@pytest.mark.process
def test_a_unit_test_fails_on_a_connection_a_fixture_opened_before_it(tiered):
    """A module fixture set up by a process test, its connection reused by a unit test: the
    unit test fails on the traffic; a unit test that sets up such a fixture fails at setup."""
    tiered.makepyfile(
        test_throwaway="""
        import socket, subprocess, time

        import pytest


        @pytest.fixture(scope="module")
        def connection():
            with socket.create_server(("127.0.0.1", 0)) as server:
                client = socket.create_connection(server.getsockname())
                peer, _ = server.accept()
                with client, peer:
                    yield client, peer


        @pytest.fixture(scope="module")
        def other():
            with socket.create_server(("127.0.0.1", 0)):
                yield


        @pytest.mark.process
        def test_process_tier_may(connection):
            subprocess.run(["true"], check=True)
            time.sleep(0.01)
            client, peer = connection
            client.sendall(b"x")
            assert peer.recv(1) == b"x"


        @pytest.mark.unit
        def test_unit_reusing_it(connection):
            client, _ = connection
            client.sendall(b"y")


        @pytest.mark.unit
        def test_unit_setting_one_up(other):
            pass
        """
    )
    reprec = tiered.inline_run("-p", "no:randomly")
    failed = failures(reprec)
    assert set(failed) == {"test_unit_reusing_it", "test_unit_setting_one_up"}, failed
    assert "socket.sendall on a network socket with ('127.0.0.1'," in failed["test_unit_reusing_it"]
    assert "socket.bind(('127.0.0.1', 0))" in failed["test_unit_setting_one_up"]


# --- the real configuration, and no residue -------------------------------------------------------


def run_pytest(tmp_path: Path, test_file: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m pytest`` on one throwaway file, with the suite's configuration and hooks; its
    temporary directory is ``tmp_path`` unless ``env`` says otherwise."""
    path = tmp_path / "throwaway" / "test_throwaway.py"
    path.parent.mkdir()
    path.write_text(test_file)
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    argv += ["--rootdir", str(path.parent), "-p", "tests.conftest", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*argv, "-p", "no:randomly", str(path)],
        env=base_env() | {"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)} | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process
def test_the_real_run_refuses_a_test_without_a_tier(tmp_path):
    done = run_pytest(tmp_path, "def test_without_a_tier():\n    pass\n", {})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "test_throwaway.py::test_without_a_tier: no tier" in done.stderr, done.stderr


LEAVES_RESIDUE = """
import os, pathlib, socket, subprocess, sys

import pytest

pytestmark = pytest.mark.process


def test_leaves_a_file():
    pathlib.Path(os.environ["LEAVE_IN"], "left-behind.txt").write_text("x")


def test_leaves_a_socket_and_a_child_leaves_a_directory():
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(os.path.join(os.environ["LEAVE_IN"], "left-socket"))
    made = "import os; os.mkdir(os.path.join(os.environ['LEAVE_IN'], 'left-by-a-child'))"
    subprocess.run([sys.executable, "-c", made], check=True)


def test_leaves_a_child_running():
    subprocess.Popen(["sleep", "301"], start_new_session=True)


def test_leaves_a_daemon_that_left_its_parent():
    subprocess.run(["sh", "-c", "sleep 302 > /dev/null 2>&1 &"], check=True)


def test_writes_in_the_temporary_directory(tmp_path):
    import tempfile

    assert pathlib.Path(tempfile.gettempdir()).parent == tmp_path.parent
    assert os.environ["TMPDIR"] == tempfile.gettempdir()
    tempfile.mkdtemp(prefix="left-in-the-sessions-own-")  # removed with pytest's basetemp
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def ended() -> Iterator[list[int]]:
    """Pids to end after the test, should the check under test leave any running."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_run_that_leaves_files_or_processes_fails_naming_them(tmp_path, ended):
    """The temporary directory of the throwaway run is ``root`` (its TMPDIR); it must end with
    what it had, besides pytest's own basetemp; and no process of the run may outlive it, even
    one that left its parent (found by the marker variable every process of the run inherits)."""
    root = tmp_path / "root"
    root.mkdir()
    done = run_pytest(tmp_path, LEAVES_RESIDUE, {"TMPDIR": str(root), "LEAVE_IN": str(root)})
    out = done.stdout
    found = [int(pid) for pid in re.findall(r"process (\d+) still running", out)]
    ended += found
    assert done.returncode == 1, out + done.stderr
    assert "5 passed" in out, out
    assert "residue: the run fails (exit status 1)" in out, out
    assert f"file left in {root}: {root / 'left-behind.txt'}" in out, out
    assert f"file left in {root}: {root / 'left-socket'}" in out, out
    assert f"directory left in {root}: {root / 'left-by-a-child'}" in out, out
    assert re.search(r"process \d+ still running: sleep 301 \(killed\)", out), out
    assert re.search(r"process \d+ still running: sleep 302 \(killed\)", out), out
    assert len(found) == 2, out
    assert "left-in-the-sessions-own" not in out
    left = {"left-behind.txt", "left-socket", "left-by-a-child", f"pytest-of-{getpass.getuser()}"}
    assert {p.name for p in root.iterdir()} <= left
    assert not [pid for pid in found if alive(pid)]


@pytest.mark.process
def test_a_clean_run_passes_and_its_processes_carry_the_marker(tmp_path):
    clean = (
        "import os, subprocess\n\nimport pytest\n\n\n@pytest.mark.process\ndef test_clean():\n"
        "    out = subprocess.run(['env'], capture_output=True, text=True, check=True).stdout\n"
        f"    assert '{SESSION_MARKER}=' in out\n"
    )
    done = run_pytest(tmp_path, clean, {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "residue" not in done.stdout
    assert "1 passed" in done.stdout
    assert os.environ[SESSION_MARKER]  # this session's, inherited by the throwaway run's


OTHERS_WRITE_MEANWHILE = """
import os, pathlib, time

import pytest


@pytest.mark.process
def test_while_another_program_writes_in_the_temporary_directory():
    trigger, done = pathlib.Path(os.environ["TRIGGER"]), pathlib.Path(os.environ["DONE"])
    trigger.write_text("go")
    deadline = time.monotonic() + 10
    while not done.exists():
        assert time.monotonic() < deadline, "the other program wrote nothing"
        time.sleep(0.05)
"""

# A program outside the test session: it waits for the trigger, then makes a file, a directory
# and a unix socket in the temporary directory of the run, as other programs on a busy machine do.
OTHER_PROGRAM = """
import os, pathlib, socket, sys, time
root, trigger, done = sys.argv[1:4]
deadline = time.monotonic() + 60
while not os.path.exists(trigger) and time.monotonic() < deadline:
    time.sleep(0.05)
pathlib.Path(root, "tmpabc123").write_text("theirs")
os.mkdir(os.path.join(root, "their-directory"))
socket.socket(socket.AF_UNIX).bind(os.path.join(root, "their.sock"))
pathlib.Path(done).write_text("done")
"""


@pytest.mark.process
def test_a_clean_run_passes_while_other_programs_write_in_the_temporary_directory(tmp_path):
    """What other programs make in the temporary directory meanwhile is not the run's residue:
    the run passes, and says what it passed over."""
    root, trigger, done = tmp_path / "root", tmp_path / "trigger", tmp_path / "done"
    root.mkdir()
    other = subprocess.Popen(  # not a process of the run below: it is started outside it
        [sys.executable, "-c", OTHER_PROGRAM, str(root), str(trigger), str(done)],
        env=base_env(),
    )
    try:
        env = {"TMPDIR": str(root), "TRIGGER": str(trigger), "DONE": str(done)}
        ran = run_pytest(tmp_path, OTHERS_WRITE_MEANWHILE, env)
        assert other.wait(timeout=10) == 0
    finally:
        other.kill()
        other.wait()
    out = ran.stdout
    assert ran.returncode == pytest.ExitCode.OK, out + ran.stderr
    assert "1 passed" in out, out
    assert "residue: the run fails" not in out, out
    assert f"passed over 3 new entries in {root} that no process of the tests made" in out, out
    assert sorted(p.name for p in root.iterdir()) == ["their-directory", "their.sock", "tmpabc123"]


@pytest.mark.process
def test_a_passing_run_leaves_its_temporary_directory_as_it_found_it(tmp_path):
    """Not even pytest's own root (pytest-of-USER), which pytest empties but never removes."""
    root = tmp_path / "root"
    root.mkdir()
    passing = "import pytest\n\n\n@pytest.mark.unit\ndef test_passes(tmp_path):\n    pass\n"
    done = run_pytest(tmp_path, passing, {"TMPDIR": str(root)})
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert sorted(p.name for p in root.iterdir()) == []
