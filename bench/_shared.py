"""Helpers shared by the benchmark scripts: /proc readings, wrk, the bare app, machine etiquette.

Processes come from ``tests.support.harness`` (their own process group each, ended by it, 127.0.0.1
only). Nothing here needs psutil: resident memory is ``VmRSS`` from ``/proc/PID/status`` and CPU
time is ``utime + stime`` from ``/proc/PID/stat``.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.harness import LOOPBACK, ROOT, Proc, base_env, free_port, wait_until

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
OTHER_BENCHMARKS = ("bench.fault_matrix", "bench/fault_matrix")


# --- /proc -------------------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    """Resident set size of one process in MiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    # After the command: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def load_average() -> str:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"{one} {five} {fifteen}"


def other_benchmarks() -> list[str]:
    """Command lines of other benchmark processes (not this process or its ancestors)."""
    mine = {os.getpid()}
    pid = os.getppid()
    while pid > 1:
        mine.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(name in argv for name in OTHER_BENCHMARKS):
            found.append(f"{entry.name}: {argv.strip()}")
    return found


def wait_for_quiet_machine(skip: bool = False, cap: float = 40 * 60, poll: float = 30) -> str:
    """Wait (at most ``cap`` s) until no other benchmark runs; return a note for the record."""
    if skip:
        return f"not checked (--no-wait); load average {load_average()}; code {code_version()}"
    start = time.monotonic()
    waited = False
    while others := other_benchmarks():
        if time.monotonic() - start >= cap:
            note = f"ran anyway after waiting {cap:.0f} s; still running: {others}"
            return note + f"; load average {load_average()}; code {code_version()}"
        if not waited:
            print(f"waiting for other benchmarks to finish: {others}", file=sys.stderr)
            waited = True
        time.sleep(poll)
    note = f"no other benchmark running (waited {time.monotonic() - start:.0f} s)"
    return note + f"; load average {load_average()}; code {code_version()}"


def code_version() -> str:
    """The commit measured, and whether ``sidecar/`` had uncommitted changes at the start."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "?"

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "sidecar")
    return f"{head} + uncommitted changes in sidecar/" if dirty else head


def cpus() -> int:
    return os.cpu_count() or 1


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0"``, ``"0,1"`` or ``"0-1"`` as a set of CPU numbers (None: not pinned)."""
    if text is None:
        return None
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def pin(pid: int, cpu_set: set[int] | None) -> None:
    """Pin every thread of a running process to ``cpu_set`` (None: leave it alone)."""
    if cpu_set is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpu_set)


def pinned(argv: list[str], cpu_set: set[int] | None) -> list[str]:
    """Prefix ``argv`` with ``taskset -c CPUS`` when CPUs are given (for a child started here)."""
    if cpu_set is None:
        return argv
    taskset = shutil.which("taskset")
    if taskset is None:
        raise SystemExit("taskset not found (util-linux)")
    return [taskset, "-c", ",".join(map(str, sorted(cpu_set))), *argv]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- the bare app --------------------------------------------------------------------------------
class BareApp:
    """``python -m bench.bare_app`` on a free loopback port: the ceiling of the stack."""

    def __init__(self) -> None:
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "bench.bare_app",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
        ]
        self.proc = Proc(argv, base_env(), "bare-app")
        self.started = time.monotonic()
        self.http = httpx.Client(timeout=1.0, trust_env=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_serving(self, timeout: float = 10) -> BareApp:
        def serving() -> bool:
            if self.proc.popen.poll() is not None:
                raise AssertionError(f"bare app exited: {self.proc.output()}")
            return self.http.get(f"{self.url}/health").status_code == 200

        wait_until(serving, timeout, interval=0.005, what="bare app to serve")
        return self

    def close(self) -> None:
        self.http.close()
        self.proc.stop()


# --- wrk ---------------------------------------------------------------------------------------
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class WrkResult:
    connections: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    server_cpu_seconds: float  # CPU time the server process used during the run

    @property
    def cpu_us_per_request(self) -> float:
        return self.server_cpu_seconds / max(1, self.requests) * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "cpu_us_per_request": self.cpu_us_per_request}


def run_wrk(
    url: str,
    connections: int,
    seconds: float,
    threads: int,
    server_pid: int,
    cpu_set: set[int] | None = None,
) -> WrkResult:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    argv = [wrk, f"-t{min(threads, connections)}", f"-c{connections}", f"-d{seconds:g}s"]
    argv += ["--latency", "--timeout", "5s", url]
    before = cpu_seconds(server_pid)
    out = subprocess.run(pinned(argv, cpu_set), capture_output=True, text=True, check=True).stdout
    used = cpu_seconds(server_pid) - before
    percentiles = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", out, re.MULTILINE))
    total = re.search(r"(\d+) requests in ([\d.]+\w+),", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if total is None or rps is None or len(percentiles) != 4:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkResult(
        connections=connections,
        requests=int(total.group(1)),
        seconds=_ms(total.group(2)) / 1e3,
        rps=float(rps.group(1)),
        p50_ms=_ms(percentiles["50"]),
        p75_ms=_ms(percentiles["75"]),
        p90_ms=_ms(percentiles["90"]),
        p99_ms=_ms(percentiles["99"]),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(g) for g in errors.groups()) if errors else 0,
        server_cpu_seconds=used,
    )


# --- the sidecar's own metrics -------------------------------------------------------------------
def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


# --- the reports' cells --------------------------------------------------------------------
def seconds(values: Sequence[float | None], never: str = "never") -> str:
    """Median (min-max) in seconds; runs where it did not happen count as +infinity."""
    if not values:
        return "n/a"
    ordered = sorted(float("inf") if v is None else v for v in values)
    middle = statistics.median(ordered)

    def show(value: float) -> str:
        if value == float("inf"):
            return never
        return f"{value:.2f}" if value < 1 else f"{value:.1f}"

    text = f"{show(middle)} s" if middle != float("inf") else never
    if show(ordered[0]) != show(ordered[-1]):
        text += f" ({show(ordered[0])}-{show(ordered[-1])})"
    return text


def counts(values: Sequence[int | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "—"
    middle = statistics.median(known)
    text = f"{middle:g}"
    if min(known) != max(known):
        text += f" ({min(known)}-{max(known)})"
    return text


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"
