"""Engine misbehaviour: every way an engine can break HTTP gives a notready verdict with a precise
reason, never a crash; and a thousand of them leak no socket, file descriptor or task.

The engine is ``tests/support/misbehaving.py``, a raw asyncio HTTP server whose mode is switched
at runtime. Each misbehaviour is shown in-process on a virtual clock (the unit tier): the whole
sidecar (``tests/support/inprocess.py``) against the same engine's modes served over an in-memory
network, so that the sidecar's engine client parses the very bytes the engine sends, with httpx's
own HTTP/1.1 parser, and every deadline is exact.

What only real sockets show stays in the process tier, with the engine run as a real process and
the sidecar as users run it (``python -m sidecar``): a FIN before the promised body ends, a FIN
before any byte, a RST mid-body (SO_LINGER 0), a slowloris that keeps one TCP connection
trickling; and the leak test, which reads from outside, from Linux's /proc, what the sidecar
holds: its file descriptors, its TCP sockets and their states, its threads and its resident
memory. Its asyncio tasks cannot be read from outside (it has no debug route); a leaked task that
holds a connection shows as a socket, and one that holds buffers as memory, which is what the
leak test bounds.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Sidecar, wait_until
from tests.support.inprocess import InProcessSidecar, run_virtually, running, until
from tests.support.misbehaving import MODES, InProcessMisbehaving, MisbehavingEngine

QUIET_DRAIN = {"SIDECAR_DRAIN_TIMEOUT": "0.1"}  # stop promptly at teardown (SIGTERM drains)
CANARY_ON = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
    "SIDECAR_CANARY_RETRY_INTERVAL": "0.25",
}
MISBEHAVIOURS = tuple(mode for mode in MODES if mode != "ok")
SLOW = ("trickle", "headers_then_silence", "silence")  # each canary costs the whole timeout
# Shown on real sockets too (the process tier): what the kernel does to a connection.
ON_SOCKETS = ("short_body", "reset_mid_body", "close_without_answer", "trickle")
# In the sidecar's log: a traceback, or asyncio reporting a task lost or failed unobserved.
TROUBLE = re.compile(
    r"Traceback|Task was destroyed but it is pending|exception was never retrieved|"
    r"Unclosed (client session|connection)|ResourceWarning"
)


@pytest.fixture
def misbehaving() -> Iterator[Callable[[str], MisbehavingEngine]]:
    """Start misbehaving engines; every one is ended by its process group when the test ends."""
    started: list[MisbehavingEngine] = []

    def start(mode: str = "ok") -> MisbehavingEngine:
        engine = MisbehavingEngine(mode)
        started.append(engine)
        return engine

    yield start
    for engine in reversed(started):
        engine.close()


def canary_totals(metrics: str) -> Counter[str]:
    """health_sidecar_canary_total by outcome, from /metrics."""
    pattern = r'^health_sidecar_canary_total\{endpoint="generate",outcome="(\w+)"\} (\S+)$'
    return Counter({m[1]: int(float(m[2])) for m in re.finditer(pattern, metrics, re.M)})


def trouble(caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder) -> list[str]:
    """What the in-process sidecar's log and warnings say of trouble (TROUBLE, as in its
    process's output): a record with a traceback, asyncio's reports, a ResourceWarning."""
    gc.collect()  # a task destroyed while pending is reported when it is collected
    found = [r.getMessage() for r in caplog.records if r.exc_info]
    found += TROUBLE.findall(caplog.text)
    found += [str(w.message) for w in recwarn if issubclass(w.category, ResourceWarning)]
    return found


# --- each misbehaviour: notready with a precise reason, still serving ----------------------------


def case(mode: str, backend: str, outcome: str, *fragments: str, bug: str = "") -> Any:
    """One misbehaviour: the outcome it must give, and fragments its reason must contain."""
    marks = [pytest.mark.xfail(strict=True, reason=f"bug: {bug}")] if bug else []
    return pytest.param(mode, backend, outcome, fragments, id=mode, marks=marks)


TIMED_OUT = "no complete answer within 0.5 s"
CASES = [
    case("invalid_json", "vllm", "invalid", "not valid JSON"),
    case("html", "openai", "error", "HTTP 502", "502 Bad Gateway"),
    case("html_200", "vllm", "invalid", "content-type text/html", "expected JSON"),
    case("empty", "openai", "invalid", "not valid JSON (0 bytes)"),
    case("truncated", "vllm", "invalid", "not valid JSON"),
    case("short_body", "openai", "error", "connection broke"),
    case("huge", "vllm", "invalid", "too large", "more than 1048576 bytes"),
    case("huge_declared", "openai", "invalid", "too large", "Content-Length 52428800"),
    case("trickle", "vllm", "timeout", TIMED_OUT),
    case("headers_then_silence", "openai", "timeout", TIMED_OUT),
    case("silence", "vllm", "timeout", TIMED_OUT),
    case("redirect", "openai", "error", "HTTP 302 redirect", "not followed"),
    case("reset_mid_body", "vllm", "error", "connection broke"),
    case("wrong_content_type", "openai", "invalid", "content-type text/plain", "expected JSON"),
    case("close_without_answer", "vllm", "error", "connection broke"),
    case("not_http", "openai", "error", "connection broke"),
]
SOCKET_CASES = [param for param in CASES if param.values[0] in ON_SOCKETS]


@pytest.mark.unit
def test_every_misbehaviour_has_a_case() -> None:
    assert {param.values[0] for param in CASES} == set(MISBEHAVIOURS)
    assert {param.values[0] for param in SOCKET_CASES} == set(ON_SOCKETS)


@pytest.mark.unit
@pytest.mark.parametrize(("mode", "backend", "outcome", "fragments"), CASES)
def test_misbehaviour_is_notready_with_a_precise_reason(
    caplog, recwarn, mode: str, backend: str, outcome: str, fragments: tuple[str, ...]
) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        engine = InProcessMisbehaving(mode)
        env = CANARY_ON | {"SIDECAR_BACKEND": backend, "SIDECAR_ENGINE_URL": engine.url}
        async with running(env, {engine.url: engine}) as side:

            async def failed_twice() -> bool:
                check = (await side.health_body())[1]["checks"]["generate"]
                return check["consecutive_failures"] >= 2

            await until(failed_twice, 3, what=f"two failed canaries ({mode})")
            status, body = await side.health_body()
            check = body["checks"]["generate"]
            assert status == 503
            assert body["status"] == "notready"
            assert check["registered"] is True, check  # the canary decided, not registration
            last = check["last_canary"]
            assert last["outcome"] == outcome, last
            for fragment in fragments:
                assert fragment in last["reason"], last
            assert last["reason"] in body["reason"]
            assert (await side.get("/live")).status_code == 200  # no reason to restart yet
            assert (await side.get("/sidecar/live")).status_code == 200  # its monitor runs on
            assert canary_totals(await side.metrics())[outcome] >= 2
            if mode == "redirect":
                assert engine.stats()["redirect_target_connections"] == 0  # not followed

            # The sidecar recovers as soon as the engine answers well: nothing was left stuck.
            engine.set_mode("ok")
            await side.wait_status(200, 3)
            assert (await side.get("/sidecar/live")).status_code == 200
            await _no_connection_left_open(side, engine)

    run_virtually(main)  # and no task outlives the sidecar
    assert not trouble(caplog, recwarn)


async def _no_connection_left_open(side: InProcessSidecar, engine: InProcessMisbehaving) -> None:
    """Between canaries, the engine holds no connection from the sidecar open (the registration
    checks and metrics reads come and go within the same instant)."""
    opened = engine.stats()["total_connections"]
    await until(lambda: engine.stats()["total_connections"] > opened, 2, what="a new exchange")
    await until(lambda: engine.stats()["open_connections"] == 0, 1, 0.01, "no connection open")


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["vllm", "openai"])
def test_negative_control_a_well_behaved_engine_is_ready(backend) -> None:
    """The same engine in its "ok" mode passes: the cases above fail for their misbehaviour."""

    async def main() -> None:
        engine = InProcessMisbehaving("ok")
        env = CANARY_ON | {"SIDECAR_BACKEND": backend, "SIDECAR_ENGINE_URL": engine.url}
        async with running(env, {engine.url: engine}) as side:
            await side.wait_status(200, 3)
            _, body = await side.health_body()
            assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

    run_virtually(main)


@pytest.mark.process
@pytest.mark.parametrize(("mode", "backend", "outcome", "fragments"), SOCKET_CASES)
def test_on_real_sockets_misbehaviour_is_notready_with_a_precise_reason(
    misbehaving, sidecar, mode: str, backend: str, outcome: str, fragments: tuple[str, ...]
) -> None:
    """What the kernel does to a connection (FIN mid-body, FIN before a byte, RST mid-body, a
    trickle on one TCP connection) reaches the sidecar as users run it with the same reason."""
    engine = misbehaving(mode)
    side = sidecar(
        QUIET_DRAIN | CANARY_ON | {"SIDECAR_BACKEND": backend, "SIDECAR_ENGINE_URL": engine.url}
    )

    def failed_twice() -> dict[str, Any] | None:
        check = side.health()[1]["checks"]["generate"]
        return check if check["consecutive_failures"] >= 2 else None

    check = wait_until(failed_twice, 3, what=f"two failed canaries ({mode})")
    status, body = side.health()
    assert status == 503
    assert body["status"] == "notready"
    assert check["registered"] is True, check  # the canary decided, not registration
    last = check["last_canary"]
    assert last["outcome"] == outcome, last
    for fragment in fragments:
        assert fragment in last["reason"], last
    assert last["reason"] in body["reason"]
    assert side.get("/live").status_code == 200  # none of these is a reason to restart yet
    assert side.proc.popen.poll() is None
    assert canary_totals(side.metrics())[outcome] >= 2

    # The sidecar recovers as soon as the engine answers well: nothing was left stuck.
    engine.set_mode("ok")
    side.wait_status(200, 3)
    assert side.proc.popen.poll() is None
    assert not TROUBLE.findall(side.proc.output()), side.proc.output()[-3000:]


# --- a thousand misbehaving canaries leak nothing ------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What a process holds, read from /proc."""

    fds: int
    sockets: int
    tcp_states: Counter[str]
    threads: int
    rss_kib: int


TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def socket_table(pid: int) -> dict[str, tuple[str, str, str]]:
    """inode -> (state, local, remote) for every TCP socket of the process' network namespace."""
    table: dict[str, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            table[inode] = (TCP_STATES.get(state, state), local, remote)
    return table


def socket_inodes(pid: int) -> list[str]:
    inodes = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink()
        except FileNotFoundError:  # closed while listing
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", str(target))
        if found:
            inodes.append(found[1])
    return inodes


def held(pid: int) -> Held:
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    inodes = socket_inodes(pid)
    table = socket_table(pid)
    states = Counter(table[i][0] for i in inodes if i in table)
    threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1])
    return Held(fds, len(inodes), states, threads, rss)


def settled_tasks(side: Sidecar, samples: int = 10) -> int:
    """The fewest asyncio tasks the sidecar reports over a short window (its own gauge)."""
    pattern = r"^health_sidecar_asyncio_tasks (\S+)$"
    seen = []
    for _ in range(samples):
        seen.append(int(float(re.search(pattern, side.metrics(), re.M)[1])))
        time.sleep(0.03)
    return min(seen)


def settled_held(pid: int, samples: int = 10) -> Held:
    """The least the process holds over a short window: a canary in flight is not a leak."""
    seen = []
    for _ in range(samples):
        seen.append(held(pid))
        time.sleep(0.03)
    return min(seen, key=lambda h: (h.fds, h.sockets))


LEAK_ENV = QUIET_DRAIN | {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "0.01",
    "SIDECAR_CANARY_RETRY_INTERVAL": "0.01",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.2",
    "SIDECAR_LOG_LEVEL": "WARNING",
}
TARGET_CANARIES = 1000
FD_SLACK = 5
RSS_SLACK_KIB = 40 * 1024


def run_segment(engine: MisbehavingEngine, mode: str, count: int, timeout: float) -> None:
    """Switch the engine's mode and wait until it has served ``count`` canaries in it."""
    engine.set_mode(mode)
    start = engine.stats()["generations"].get(mode, 0)
    wait_until(
        lambda: engine.stats()["generations"].get(mode, 0) >= start + count,
        timeout,
        interval=0.02,
        what=f"{count} canaries in mode {mode}",
    )


def run_round(engine: MisbehavingEngine, fast: int, slow: int) -> None:
    for mode in MODES:
        run_segment(engine, mode, slow if mode in SLOW else fast, timeout=10)


@pytest.mark.process
def test_a_thousand_misbehaving_canaries_leak_nothing(misbehaving, sidecar) -> None:
    engine = misbehaving("ok")
    side = sidecar(LEAK_ENV | {"SIDECAR_ENGINE_URL": engine.url})
    pid = side.proc.pid
    side.wait_status(200, 5)

    # Warm-up: every code path once (imports, pools, buffers), then the baseline, at rest in "ok".
    run_round(engine, fast=3, slow=1)
    engine.set_mode("ok")
    side.wait_status(200, 3)
    baseline = settled_held(pid)
    baseline_tasks = settled_tasks(side)
    warm = sum(canary_totals(side.metrics()).values())

    started = time.monotonic()
    rounds: list[Held] = []
    while sum(canary_totals(side.metrics()).values()) - warm < TARGET_CANARIES:
        assert time.monotonic() - started < 90, "1,000 canaries took too long"
        run_round(engine, fast=20, slow=3)
        rounds.append(held(pid))
        assert side.proc.popen.poll() is None, side.proc.output()[-3000:]
    elapsed = time.monotonic() - started

    engine.set_mode("ok")
    side.wait_status(200, 3)  # recovers at once: no connection slot was left stuck
    after = settled_held(pid)
    after_tasks = settled_tasks(side)
    totals = canary_totals(side.metrics())
    report = (
        f"{sum(totals.values()) - warm} canaries in {elapsed:.1f} s {dict(totals)}; "
        f"baseline {baseline}; after {after}; per round {[(r.fds, r.sockets) for r in rounds]}; "
        f"asyncio tasks {baseline_tasks} -> {after_tasks}"
    )
    print(report)

    # Every kind of failure was exercised, and by the engine's own count every mode served.
    assert all(totals[o] > 0 for o in ("success", "invalid", "error", "timeout")), report
    served = engine.stats()["generations"]
    assert all(served.get(mode, 0) > 0 for mode in MODES), served

    # Nothing leaked: back to the baseline, give or take a canary or probe in flight.
    assert after_tasks <= baseline_tasks + 1, report
    assert after.fds <= baseline.fds + FD_SLACK, report
    assert after.sockets <= baseline.sockets + FD_SLACK, report
    assert after.tcp_states["CLOSE_WAIT"] == 0, report  # a peer closed, the sidecar never did
    assert after.threads <= baseline.threads + 2, report
    assert after.rss_kib <= baseline.rss_kib + RSS_SLACK_KIB, report
    # No growth trend while it ran: the last round holds no more than the first, plus slack.
    assert max(r.fds for r in rounds) <= baseline.fds + 2 * FD_SLACK, report
    assert rounds[-1].fds <= rounds[0].fds + FD_SLACK, report
    # The engine agrees: no connection from the sidecar is left open but the ones in flight.
    assert engine.stats()["open_connections"] <= 3, engine.stats()
    assert side.get("/live").status_code == 200
    # What asyncio says of tasks lost or failed unobserved, and any traceback at all.
    assert not TROUBLE.findall(side.proc.output()), side.proc.output()[-3000:]
