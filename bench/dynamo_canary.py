"""Dynamo's own in-process canary beside the sidecar's request-plane canary, on one worker.

    .venv/bin/python -m bench.dynamo_canary [--reps 3] [--seed S] [--only SCENARIO ...] [--out F]

The script enters a private network namespace of its own first (Dynamo's event plane listens on
0.0.0.0: ``tests/support/netns.py``; needs root), so every process it starts lives there. Each
repetition then starts a fresh fake Dynamo worker (``fakeengine/dynamo.py`` on the real
runtime: file discovery in a private directory, TCP request plane, loopback only) with its
canary payload registered and Dynamo's own canary on (``DYN_HEALTH_CHECK_ENABLED=true``,
``DYN_CANARY_WAIT_TIME=1``, ``DYN_HEALTH_CHECK_REQUEST_TIMEOUT=1``: integers, the runtime refuses
"1.0"), and a fresh sidecar (``python -m sidecar``, ``SIDECAR_TRANSPORT=dynamo``, the same two
timings, otherwise its defaults) against that worker. Both ``/health`` routes are polled every
50 ms: the worker's system server (what Dynamo's canary feeds) and the sidecar's. Once both say
200, after a seeded random wait, one fault hits the worker, and both are timed from the same
moment. The worker's control server tells which requests run on it: the sidecar's canaries
(context ids ``canary-...``) and Dynamo's own (bare uuids).

The two probers interfere on one worker (a stopped canary's stream completes, which Dynamo's
loop takes as proof of health), so the hang scenarios also run two controls at the same time,
each on a worker of its own under the same fault: Dynamo's canary with no sidecar, and the
sidecar on a worker whose own canary is off; and scenario 1b repeats the hang on a handler that
ignores ``stop_generating()``.

Figures are ratios measured side by side in one run on a shared machine, never assertions.
The full run writes ``docs/fault-benchmark-dynamo.md``; a run with ``--only`` writes only when
``--out`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._shared import code_version, counts, cpu_model, load_average, seconds
from tests.support.dynamo_worker import FakeDynamoWorker, dynamo_env
from tests.support.dynamo_worker import sidecar_env as dynamo_sidecar_env
from tests.support.harness import LOOPBACK, ROOT, Sidecar, base_env, wait_until
from tests.support.netns import private_network, unavailable

POLL = 0.05  # seconds between two reads of each /health
POLL_TIMEOUT = 1.0  # a read that gets no answer within this is "no answer"
STATE_EVERY = 0.1  # seconds between two reads of the worker's in-flight requests
SPREAD = 2.0  # the fault comes 0-2 s (seeded) after both said 200: two canary cycles
WINDOW = 10.0  # a hang or a stall lasts this long, then is cleared
RECOVER_CAP = 30.0  # longest wait for a prober to be back at 200 after the fault is cleared
START_CAP = 30.0  # longest wait for both probers' first 200
LEASE_CAP = 60.0  # longest SIGSTOP while waiting for the worker's record to expire
ORPHAN_OBSERVE = 20.0  # watch this long after SIGCONT of a worker gone from discovery
KILL_OBSERVE = 10.0  # watch this long after SIGKILL
LIVENESS_WINDOW = "5"  # SIDECAR_LIVENESS_WINDOW in the orphan scenario
BACKEND = "vllm"
DEFAULT_OUT = ROOT / "docs" / "fault-benchmark-dynamo.md"

#: Dynamo's own canary, on in the worker (the runtime parses these as integers).
DYNAMO_CANARY = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
}
#: The sidecar's timings, the same as Dynamo's here; everything else is its default.
SIDECAR_TIMINGS = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1"}

DYNAMO = "Dynamo's own canary (worker /health)"
SIDECAR = "sidecar /health"
SIDECAR_LIVE = "sidecar /live"
DYNAMO_ALONE = "control: Dynamo's own canary, no sidecar on its worker"
SIDECAR_ALONE = "control: sidecar /health, Dynamo's canary off on its worker"


def now() -> float:
    return time.monotonic()


# --- reading a route every 50 ms -----------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    at: float  # monotonic time the answer (or its absence) was known
    code: int | None  # None: no answer (refused, timed out)
    detail: str  # the body's reason or status, or the error's name

    @property
    def ok(self) -> bool:
        return self.code == 200

    def shown(self) -> str:
        if self.code is not None:
            return f"{self.code}"
        return f"no answer ({NO_ANSWER.get(self.detail, self.detail)})"


#: httpx's error names, as a reader of the table knows them.
NO_ANSWER = {
    "ConnectError": "connection refused",
    "ReadError": "connection reset",
    "RemoteProtocolError": "connection closed",
    "ReadTimeout": f"read timed out after {POLL_TIMEOUT:g} s",
    "ConnectTimeout": f"connect timed out after {POLL_TIMEOUT:g} s",
}


class Poller:
    """GET ``url`` every :data:`POLL` seconds on a thread of its own (started in the caller's
    network namespace); every answer is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poll {url}", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(POLL_TIMEOUT + 2)

    def _run(self) -> None:
        with httpx.Client(timeout=POLL_TIMEOUT, trust_env=False) as http:
            while not self._stop.is_set():
                started = now()
                code, detail = self._read(http)
                self.samples.append(Sample(now(), code, detail))
                self._stop.wait(max(0.0, started + POLL - now()))

    def _read(self, http: httpx.Client) -> tuple[int | None, str]:
        try:
            answer = http.get(self.url)
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        try:
            body = answer.json()
            detail = str(body.get("reason") or body.get("status") or "")
        except (ValueError, AttributeError):
            detail = answer.text[:160]
        return answer.status_code, detail

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def between(self, start: float, end: float = float("inf")) -> list[Sample]:
        return [s for s in list(self.samples) if start <= s.at <= end]

    def first(self, ok: bool, start: float, end: float = float("inf")) -> Sample | None:
        return next((s for s in self.between(start, end) if s.ok is ok), None)

    def ok_since(self, start: float) -> bool:
        """Has a 200 arrived at or after ``start``, and is the latest answer a 200?"""
        latest = self.latest
        return latest is not None and latest.ok and latest.at >= start

    def settled_down(self, start: float, end: float) -> Sample | None:
        """The first sample of the run of non-200 answers that lasts until ``end`` (None: the
        last answer in [start, end] was a 200)."""
        found = None
        for sample in reversed(self.between(0.0, end)):
            if sample.ok:
                break
            found = sample
        if found is None or not self.between(start, end):
            return None
        return found


# --- results -------------------------------------------------------------------------------------
@dataclass
class Run:
    """One prober in one repetition. Seconds; None: did not happen within the window."""

    to_503: float | None = None
    to_200: float | None = None
    went_down: bool = False
    shown_503: str | None = None  # shown instead of to_503 (a fact, not a time)
    sent: int | None = None  # its canaries that reached the worker during the window
    left: int | None = None  # its canaries still running on the worker at the window's end
    peak: int | None = None  # most of its canaries running on the worker at once
    recovers: bool = False  # the fault is cleared in this scenario (time back to 200 applies)
    note: str = ""  # words, the same in every run that has them
    # Timed notes: a template with one "{}" and this run's seconds; the table shows the median
    # (min-max) over the runs that have the template.
    timed: list[tuple[str, float]] = field(default_factory=list)
    shares: list[tuple[str, float]] = field(default_factory=list)  # the same, for fractions


@dataclass
class Rep:
    probers: dict[str, Run] = field(default_factory=dict)
    facts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Scenario:
    title: str
    what: str
    run: Callable[[random.Random], Rep]


# --- workers, sidecars and who reads what ------------------------------------------------------
def sidecar_env(worker: FakeDynamoWorker, **extra: str) -> dict[str, str]:
    """The sidecar as a user starts it beside this worker (tests/test_dynamo_transport.py)."""
    return dynamo_sidecar_env(
        worker.system_url, worker.kv_dir, worker.backend, worker.mode, **(SIDECAR_TIMINGS | extra)
    )


@dataclass(frozen=True)
class Setup:
    """One worker, in a discovery directory of its own, and who probes it (row names)."""

    dynamo: str | None  # Dynamo's own canary on, read on the worker's /health; None: off
    sidecar: str | None  # a sidecar beside it, its /health read; None: no sidecar
    live: str | None = None  # the sidecar's /live read too
    sidecar_extra: tuple[tuple[str, str], ...] = ()
    idle_worker: bool = False  # a second worker in the directory, never canaried


SHARED = Setup(DYNAMO, SIDECAR)
#: The controls of 1 and 2: each prober alone on a worker of its own, same fault, same moment.
CONTROLS = (Setup(DYNAMO_ALONE, None), Setup(None, SIDECAR_ALONE))


@dataclass
class Stand:
    """One worker of a repetition, its sidecar and its pollers."""

    setup: Setup
    kv_dir: Path
    worker: FakeDynamoWorker
    idle: FakeDynamoWorker | None = None
    sidecar: Sidecar | None = None
    pollers: dict[str, Poller] = field(default_factory=dict)

    @classmethod
    def make(cls, setup: Setup) -> Stand:
        kv_dir = Path(tempfile.mkdtemp(prefix="dynbench-kv-"))
        worker = FakeDynamoWorker(
            BACKEND,
            kv_dir=kv_dir,
            health_check_payload=True,
            env_extra=DYNAMO_CANARY if setup.dynamo else {},
        )
        idle = None
        if setup.idle_worker:
            idle = FakeDynamoWorker(BACKEND, kv_dir=kv_dir, namespace="idle")
        return cls(setup, kv_dir, worker, idle)

    def workers(self) -> list[FakeDynamoWorker]:
        return [w for w in (self.worker, self.idle) if w is not None]

    def start_sidecar(self) -> None:
        if self.setup.sidecar:
            extra = dict(self.setup.sidecar_extra)
            self.sidecar = Sidecar(sidecar_env(self.worker, **extra))

    def start_polling(self) -> None:
        assert self.sidecar is not None or not self.setup.sidecar
        if self.setup.dynamo:
            self.pollers[self.setup.dynamo] = Poller(f"{self.worker.system_url}/health").start()
        if self.sidecar is not None and self.setup.sidecar:
            self.pollers[self.setup.sidecar] = Poller(f"{self.sidecar.url}/health").start()
            if self.setup.live:
                self.pollers[self.setup.live] = Poller(f"{self.sidecar.url}/live").start()

    def counter(self, name: str) -> int:
        """Which of :meth:`in_flight`'s counts is the prober's: 0 the sidecar's, 1 Dynamo's."""
        return 1 if name == self.setup.dynamo else 0

    def in_flight(self) -> tuple[int, int]:
        """(the sidecar's canaries, Dynamo's own) running on the worker now."""
        state = self.worker.state()
        return int(state["in_flight_canaries"]), int(state["in_flight_others"])

    def sent_since(self, wall: float) -> tuple[int, int]:
        """(the sidecar's, Dynamo's own) canaries that reached the worker since ``wall``."""
        records = [r for r in self.worker.state()["requests"] if r["started"] >= wall]
        ours = sum(r["id"].startswith("canary-") for r in records)
        return ours, len(records) - ours

    def reason(self, path: str = "/health") -> str:
        assert self.sidecar is not None
        try:
            answer = self.sidecar.get(path)
            return f"{answer.status_code} {answer.json().get('reason', '')}"
        except (httpx.HTTPError, ValueError):
            return "(no answer)"

    def close(self, failed: bool) -> None:
        for poller in self.pollers.values():
            poller.stop()
        if self.sidecar is not None:
            self.sidecar.close()
        for worker in self.workers():
            worker.close()
            shutil.rmtree(worker.workdir, ignore_errors=True)
        shutil.rmtree(self.kv_dir, ignore_errors=True)
        procs = [self.sidecar.proc if self.sidecar else None, *(w.proc for w in self.workers())]
        for proc in procs:
            if proc is None:
                continue
            if failed:
                print(f"    log kept: {proc.log.name}", file=sys.stderr)
            else:
                Path(proc.log.name).unlink(missing_ok=True)


@contextlib.contextmanager
def rig(rng: random.Random, setups: Sequence[Setup]) -> Iterator[tuple[list[Stand], float]]:
    """A fresh worker per setup (with Dynamo's canary on where it is read) and its sidecar,
    every route polled and 200, then the seeded wait; everything ended on exit."""
    stands = [Stand.make(setup) for setup in setups]
    failed = True
    try:
        for stand in stands:
            for worker in stand.workers():
                worker.launch()
        for stand in stands:
            for worker in stand.workers():
                worker.wait_started()
        for stand in stands:
            stand.start_sidecar()
        for stand in stands:
            if stand.sidecar is not None:
                stand.sidecar.wait_serving()
            stand.start_polling()
        pollers = [p for stand in stands for p in stand.pollers.values()]
        began = now()
        wait_until(
            lambda: all(p.ok_since(began) for p in pollers),
            START_CAP,
            interval=POLL,
            what="every route to say 200",
        )
        offset = rng.uniform(0.0, SPREAD)
        time.sleep(offset)
        yield stands, offset
        failed = False
    finally:
        for stand in stands:
            stand.close(failed)


# --- 1, 2: a hang or a stall, then cleared -------------------------------------------------------
def window_run(poller: Poller, fault: float, cleared: float, name: str) -> Run:
    """Time to the first non-200 within the window, how it held, time back to 200."""
    run = Run(recovers=True)
    down = poller.first(False, fault, cleared)
    if down is None:
        run.note = "200 throughout"
        return run
    run.went_down, run.to_503 = True, down.at - fault
    after = poller.between(down.at, cleared)
    share = sum(s.ok for s in after) / len(after)
    if share:
        run.shares.append(("flaps: 200 in {} of the reads after its first 503", share))
    elif name in (DYNAMO, DYNAMO_ALONE):
        run.note = "503 from its first timed-out probe to the end"
    up = poller.first(True, cleared)
    run.to_200 = None if up is None else up.at - cleared
    return run


def fault_window(
    faults: dict[str, Any], rng: random.Random, setups: Sequence[Setup] = (SHARED, *CONTROLS)
) -> Rep:
    """Set ``faults`` on every worker at once for :data:`WINDOW` seconds, reading the workers'
    in-flight canaries throughout; clear them; wait for every prober to be back at 200."""
    with rig(rng, setups) as (stands, offset):
        rep = Rep()
        faulted: list[tuple[float, float]] = []
        for stand in stands:
            faulted.append((now(), time.time()))
            stand.worker.fault(**faults)
        peaks = [[0, 0] for _ in stands]

        def read_in_flight() -> list[tuple[int, int]]:
            counts = [stand.in_flight() for stand in stands]
            for peak, running in zip(peaks, counts, strict=True):
                peak[:] = [max(p, n) for p, n in zip(peak, running, strict=True)]
            return counts

        while now() < faulted[0][0] + WINDOW:
            read_in_flight()
            time.sleep(STATE_EVERY)
        left = read_in_flight()
        sent = [stand.sent_since(wall) for stand, (_, wall) in zip(stands, faulted, strict=True)]
        reasons = [stand.reason() if stand.sidecar else "" for stand in stands]
        cleared: list[float] = []
        for stand in stands:
            cleared.append(now())
            stand.worker.fault()
        everyone = [
            (poller, at)
            for stand, at in zip(stands, cleared, strict=True)
            for poller in stand.pollers.values()
        ]
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: all(p.ok_since(at) for p, at in everyone),
                RECOVER_CAP,
                interval=POLL,
                what="every prober back at 200",
            )
        time.sleep(1.0)
        after = [stand.in_flight() for stand in stands]
        for index, stand in enumerate(stands):
            for name, poller in stand.pollers.items():
                run = window_run(poller, faulted[index][0], cleared[index], name)
                which = stand.counter(name)
                run.sent, run.left = sent[index][which], left[index][which]
                run.peak = peaks[index][which]
                if name in (SIDECAR, SIDECAR_ALONE) and run.went_down:
                    run.note = "; ".join(x for x in (shorten(reasons[index]), run.note) if x)
                rep.probers[name] = run
        rep.facts.append(f"fault after {offset:.2f} s at 200")
        for index, stand in enumerate(stands):
            who = " + ".join(x for x in (stand.setup.sidecar, stand.setup.dynamo) if x)
            fact = (
                f"{who}: most running on the worker at once {peaks[index][0]} of the sidecar's "
                f"canaries, {peaks[index][1]} of Dynamo's own; 1 s after every prober was back "
                f"{after[index][0]} and {after[index][1]}"
            )
            if stand.sidecar is not None:
                fact += f"; the sidecar at the window's end: {reasons[index]}"
            rep.facts.append(fact)
        return rep


def idle_hang(rng: random.Random) -> Rep:
    return fault_window({"hang": True}, rng)


def stall_after_first(rng: random.Random) -> Rep:
    return fault_window({"stall_after_first": True}, rng)


def idle_hang_stops_ignored(rng: random.Random) -> Rep:
    """The control of the interaction: the sidecar's stopped canaries never end either."""
    return fault_window({"hang": True, "ignore_stop": True}, rng, [SHARED])


def shorten(reason: str) -> str:
    """The cause of the sidecar's 503 in a few words."""
    text = reason.removeprefix("503 ").removeprefix("200 ").removeprefix("generate: ")
    rules = (
        ("canary failing hard for", "", "clock: canary failing hard"),
        ("not discoverable for", "", "clock: not discoverable"),
        ("stalled", "", "stall rule (work in flight, no progress)"),
        ("canary timed out behind other work", "", "a timeout excused: counters moved"),
        ("canary timeout", "(0 chunk(s) arrived)", "canary timeouts, no chunk"),
        ("canary timeout", "(1 chunk(s) arrived)", "canary timeouts after 1 chunk"),
        ("canary timeout", "", "canary timeouts"),
        ("not discoverable", "", "not discoverable"),
        ("engine not registered", "no complete answer", "registration timed out"),
        ("engine not registered", "cannot connect", "registration refused"),
        ("engine not registered", "", "not registered"),
        ("canary refused", "not in discovery", "canary: not in discovery"),
        ("canary refused", "", "canaries refused"),
    )
    for first, second, short in rules:
        if text.startswith(first) and second in text:
            return short
    return text[:60]


# --- 3: orphaned worker --------------------------------------------------------------------------
def record_file(worker: FakeDynamoWorker) -> Path:
    """The worker's generate record in file discovery (``ns%2Fcomp%2Fep%2F<hex id>``)."""
    namespace, component, endpoint = worker.endpoint_path.split(".")
    name = f"{namespace}%2F{component}%2F{endpoint}%2F{worker.instance_id:x}"
    return worker.kv_dir / "v1" / "instances" / name


ORPHAN = Setup(
    DYNAMO,
    SIDECAR,
    live=SIDECAR_LIVE,
    sidecar_extra=(("SIDECAR_LIVENESS_WINDOW", LIVENESS_WINDOW),),
    idle_worker=True,
)


def orphaned(rng: random.Random) -> Rep:
    """SIGSTOP until the worker's record is expired and deleted, then SIGCONT and watch."""
    with rig(rng, [ORPHAN]) as (stands, offset):
        (stand,) = stands
        rep = Rep()
        record = record_file(stand.worker)
        assert record.exists(), f"no record at {record}"
        stop = now()
        stand.worker.freeze()
        try:
            wait_until(lambda: not record.exists(), LEASE_CAP, interval=0.05, what="expiry")
        finally:
            resumed, resumed_wall = now(), time.time()
            stand.worker.thaw()
        time.sleep(ORPHAN_OBSERVE)
        end = now()
        reasons = {SIDECAR: stand.reason(), SIDECAR_LIVE: stand.reason("/live")}
        _, own_body = stand.worker.health()
        rep.facts.append(
            f"fault after {offset:.2f} s at 200; record deleted {resumed - stop:.1f} s after "
            f"SIGSTOP, then SIGCONT; {ORPHAN_OBSERVE:g} s later: worker /health {own_body}"
        )
        sent = stand.sent_since(resumed_wall)
        for name, poller in stand.pollers.items():
            during = poller.first(False, stop, resumed)
            settled = poller.settled_down(resumed, end)
            run = Run()
            if settled is not None:
                run.went_down, run.to_503 = True, max(0.0, settled.at - resumed)
            if name != SIDECAR_LIVE:
                run.sent = sent[stand.counter(name)]
            words = []
            if during is None:
                words.append("200 throughout the pause")
            else:
                what = during.shown()
                if during.code is not None and name != DYNAMO:
                    what += f" ({shorten(during.detail)})"
                what = what.replace("{", "{{").replace("}", "}}")
                run.timed.append((f"pause: {what} from {{}}", during.at - stop))
            flicker = [s for s in poller.between(resumed, settled.at if settled else end) if s.ok]
            if settled is not None and flicker:
                run.timed.append(("200 for {} after SIGCONT", flicker[-1].at - resumed))
            back = poller.first(True, resumed)
            if back is not None and settled is None:
                run.timed.append(("200 again {} after SIGCONT, to the end", back.at - resumed))
            if name in reasons and settled is not None:
                words.append(shorten(reasons[name]))
            run.note = "; ".join(words)
            rep.probers[name] = run
            if name in reasons:
                rep.facts.append(f"{ORPHAN_OBSERVE:g} s after SIGCONT, {name}: {reasons[name]}")
        return rep


# --- 4: killed worker ----------------------------------------------------------------------------
def killed(rng: random.Random) -> Rep:
    with rig(rng, [Setup(DYNAMO, SIDECAR, live=SIDECAR_LIVE)]) as (stands, offset):
        (stand,) = stands
        rep = Rep()
        kill = now()
        stand.worker.kill()
        time.sleep(KILL_OBSERVE)
        reason = stand.reason()
        for name, poller in stand.pollers.items():
            down = poller.first(False, kill)
            run = Run()
            if down is not None:
                run.went_down, run.to_503 = True, down.at - kill
            if name == DYNAMO:
                if down is not None:
                    run.shown_503 = f"dies with the worker: {down.shown()}"
                run.note = "its canary ran in the worker's process"
            elif name == SIDECAR:
                run.note = shorten(reason)
            else:
                run.note = "a gone engine stops every liveness clock"
            rep.probers[name] = run
        rep.facts.append(
            f"fault after {offset:.2f} s at 200; {KILL_OBSERVE:g} s after SIGKILL the sidecar "
            f"said: {reason}; /live: {stand.reason('/live')}"
        )
        return rep


SCENARIOS: dict[str, Scenario] = {
    "idle-hang": Scenario(
        "1. idle hang",
        "the worker's handler yields nothing (fault `hang`) for "
        f"{WINDOW:g} s, its system server and runtime alive; then cleared",
        idle_hang,
    ),
    "idle-hang-stops-ignored": Scenario(
        "1b. idle hang, stops ignored",
        "as 1, but the handler also ignores `stop_generating()` (fault `hang` + `ignore_stop`): "
        "the sidecar's timed-out canaries keep running like Dynamo's (the shared worker only)",
        idle_hang_stops_ignored,
    ),
    "stall-after-first": Scenario(
        "2. hang after the first chunk",
        "every request gets its first token chunk, then nothing (fault `stall_after_first`) for "
        f"{WINDOW:g} s; then cleared",
        stall_after_first,
    ),
    "orphaned": Scenario(
        "3. orphaned worker (SIGSTOP past its lease, SIGCONT)",
        "SIGSTOP until its record under the discovery directory is expired and deleted (10 s "
        "lease; a second idle worker in the same directory, and the sidecar's runtime client, "
        f"expire it), then SIGCONT, watched {ORPHAN_OBSERVE:g} s; "
        f"`SIDECAR_LIVENESS_WINDOW={LIVENESS_WINDOW}`",
        orphaned,
    ),
    "killed": Scenario(
        "4. killed worker (SIGKILL)",
        f"SIGKILL of the worker's process group, watched {KILL_OBSERVE:g} s; no restart",
        killed,
    ),
}


# --- aggregation and the report ------------------------------------------------------------------
def row(scenario: str, prober: str, runs: Sequence[Run]) -> list[str]:
    shown = {r.shown_503 for r in runs}
    down = seconds([r.to_503 for r in runs])
    if None not in shown:  # a fact in every run ("dies with the worker: ..."), then the time
        down = f"{' / '.join(sorted(str(s) for s in shown))} after {down}"
    back_runs = [r.to_200 for r in runs if r.went_down]
    if not any(r.recovers for r in runs):
        back = "—"
    elif not back_runs:
        back = "n/a (never 503)"
    else:
        back = seconds(back_runs)
        if len(back_runs) < len(runs):
            back += f" [{len(back_runs)} of {len(runs)} runs went 503]"
    templates: dict[str, list[float]] = {}
    for r in runs:
        for template, value in r.timed:
            templates.setdefault(template, []).append(value)
    timed = [t.format(seconds(v)) + many(len(v), len(runs)) for t, v in templates.items()]
    fractions: dict[str, list[float]] = {}
    for r in runs:
        for template, value in r.shares:
            fractions.setdefault(template, []).append(value)
    timed += [t.format(percent(v)) + many(len(v), len(runs)) for t, v in fractions.items()]
    notes = "; ".join([*timed, *dict.fromkeys(r.note for r in runs if r.note)])
    return [
        scenario,
        prober,
        down,
        back,
        counts([r.sent for r in runs]),
        counts([r.left for r in runs]),
        counts([r.peak for r in runs]),
        notes,
    ]


def percent(values: Sequence[float]) -> str:
    text = f"{statistics.median(values):.0%}"
    if len(values) > 1 and f"{min(values):.0%}" != f"{max(values):.0%}":
        text += f" ({min(values):.0%}-{max(values):.0%})"
    return text


def many(some: int, every: int) -> str:
    return "" if some == every else f" [{some} of {every} runs]"


HEADER = [
    "scenario",
    "prober",
    "time to 503",
    "time back to 200",
    "its canaries sent",
    "running on the worker at the end",
    "peak running",
    "notes",
]


def table(all_reps: dict[str, list[Rep]]) -> list[list[str]]:
    rows = []
    for name, reps in all_reps.items():
        seen: dict[str, None] = {}
        for rep in reps:
            seen |= dict.fromkeys(rep.probers)
        for prober in seen:
            runs = [rep.probers[prober] for rep in reps if prober in rep.probers]
            rows.append(row(SCENARIOS[name].title, prober, runs))
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    return "\n".join(lines)


def facts(all_reps: dict[str, list[Rep]]) -> str:
    lines = []
    for name, reps in all_reps.items():
        for index, rep in enumerate(reps, 1):
            lines += [f"- `{name}` run {index}: {fact}" for fact in rep.facts]
    return "\n".join(lines) or "- none"


def failed_runs(all_reps: dict[str, list[Rep]]) -> int:
    return sum(not rep.probers for reps in all_reps.values() for rep in reps)


# --- the machine and the versions ----------------------------------------------------------------
def code_state() -> str:
    """The commit measured and, when ``sidecar/`` differs from it, a digest of that difference:
    other engineers edit the tree while benchmarks run, so the state is taken at the start and
    at the end of a run."""
    head = code_version().removesuffix(" + uncommitted changes in sidecar/")
    done = subprocess.run(
        ["git", "diff", "HEAD", "--", "sidecar"], cwd=ROOT, capture_output=True, check=False
    )
    if done.returncode != 0 or not done.stdout:
        return head
    digest = hashlib.sha256(done.stdout).hexdigest()[:12]
    return f"{head} + uncommitted changes in sidecar/ (diff sha256 {digest})"


def code_line(start: str, end: str) -> str:
    if start == end:
        return start
    return f"{start} at the start, {end} at the end (the tree changed during the run)"


def versions(code: str) -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "ai-dynamo-runtime (worker and the sidecar's client)": version("ai-dynamo-runtime"),
        "health-sidecar": f"{version('health-sidecar')}, code {code}",
        "Python": f"{platform.python_version()} ({sys.executable})",
        "worker": f"`fakeengine/dynamo.py` --backend {BACKEND} --mode aggregated "
        "--health-check-payload (the vLLM worker's canary payload registered)",
    }


def sidecar_plan() -> str:
    """``health-sidecar --check-config`` for the sidecar as this benchmark starts it."""
    env = base_env() | dynamo_env("/tmp/dynamo-kv") | SIDECAR_TIMINGS
    env |= {
        "SIDECAR_TRANSPORT": "dynamo",
        "SIDECAR_ENGINE_URL": f"http://{LOOPBACK}:9090",
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": BACKEND,
        "DYN_SYSTEM_PORT": "9091",
    }
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "--check-config"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return (done.stdout + done.stderr).strip()


# --- the document --------------------------------------------------------------------------------
READING = f"""\
How to read it: each cell is the median over the runs, the range (min-max) in parentheses;
"never" is "did not happen within the window" ({WINDOW:g} s of fault in 1, 1b and 2; in 3 the
{ORPHAN_OBSERVE:g} s after SIGCONT; in 4 the {KILL_OBSERVE:g} s after SIGKILL). Every `/health`
route is polled every 50 ms with a 1 s read timeout (resolution ±50 ms; a frozen server is read
once a second): a 503 and no answer both count as not 200.

- **rows**: "Dynamo's own canary (worker /health)" and "sidecar /health" are the two probers on
  the same worker. In 1 and 2, two controls ran beside them at the same time, each on a worker
  of its own that got the same fault at the same moment: Dynamo's own canary with no sidecar on
  its worker, and the sidecar on a worker whose own canary is off.
- **time to 503**: from the fault (`POST /fault`, SIGKILL) to the prober's first answer that is
  not 200. In 3 it is from **SIGCONT** to the start of the run of non-200 answers that lasts to
  the end of the watch: 0 when the prober was already failing at SIGCONT and never answered 200
  again; "never" when its last answer was 200. What it did during the pause is in the notes.
- **time back to 200**: from clearing the fault to its first 200 (1, 1b, 2; nothing recovers in
  3 and 4).
- **its canaries sent**: the prober's requests that reached the worker (the worker's own record:
  context ids `canary-...` are the sidecar's, bare uuids Dynamo's) from the fault to the end of
  the window (1, 1b, 2), or after SIGCONT (3; canaries the runtime held while the worker was
  frozen are delivered then).
- **running on the worker at the end / peak running**: the prober's requests still running in
  the worker's handler at the end of the {WINDOW:g} s window, and the most at once during it
  (read every {STATE_EVERY:g} s). A canary that timed out on the prober's side and still runs on
  the worker is a stalled probe the worker carries.
- **notes**: for the sidecar, the cause of its 503 (its `/health` reason, shortened); timed notes
  are medians (min-max) like the other cells.
"""


def document(
    all_reps: dict[str, list[Rep]],
    command: str,
    started: datetime.datetime,
    took: float,
    loads: tuple[str, str],
    code: str,
) -> str:
    machine = f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}"
    version_lines = "\n".join(f"- {name}: {value}" for name, value in versions(code).items())
    reps = max((len(r) for r in all_reps.values()), default=0)
    broken = failed_runs(all_reps)
    broken_line = f"; {broken} run(s) failed (see the observations)" if broken else ""
    scenarios = "\n".join(
        f"- **{SCENARIOS[n].title}** (`{n}`): {SCENARIOS[n].what}" for n in all_reps
    )
    return f"""# Fault benchmark over Dynamo's request plane: Dynamo's own canary and the sidecar

Reproduce (from the repository root, as root: the script enters a private network namespace;
`.venv` with the `dynamo` extra, `pip install -e '.[dev]'`):

```bash
{command}
```

- date: {started.strftime("%Y-%m-%d %H:%M UTC")}; the run took {took / 60:.1f} min, {reps} run(s)
  per scenario, each on a fresh worker and sidecar{broken_line}
- machine: {machine}
- shared with other engineers' work (load average {loads[0]} at the start, {loads[1]} at the
  end), so single runs can be slower
- the code: `bench/dynamo_canary.py`; the worker `fakeengine/dynamo.py`; processes from
  `tests/support/harness.py` and `tests/support/dynamo_worker.py`, each in its own process group,
  ended by it

Versions:

{version_lines}

Both probers watch the **same worker under the same fault at the same time**: Dynamo's own
in-process canary (the worker runs with
{", ".join(f"`{k}={v}`" for k, v in DYNAMO_CANARY.items())}:
it probes an idle endpoint after 1 s and judges its answer within 1 s) and the sidecar with
`SIDECAR_TRANSPORT=dynamo` ({", ".join(f"`{k}={v}`" for k, v in SIDECAR_TIMINGS.items())},
everything else its default). The figures compare the two side by side in one run; they are not
targets, and no test asserts them.

## Results

{markdown_table(table(all_reps))}

{READING}
## Scenarios

Every repetition: a fresh discovery directory, worker and sidecar (in 1 and 2 also the two
control workers, each with its own directory); every `/health` route 200; then a seeded random
wait of 0-{SPREAD:g} s (two canary cycles), then the fault.

{scenarios}

## What the rows mean

{NOTES}
## The probers

Dynamo's own canary is the runtime's (ai-dynamo-runtime, in the worker's process): with
`DYN_HEALTH_CHECK_ENABLED=true` and a registered payload, an endpoint with no request for
`DYN_CANARY_WAIT_TIME` gets the payload in-process; the endpoint is ready when the **first
chunk** of the answer arrives within `DYN_HEALTH_CHECK_REQUEST_TIMEOUT`, notready when it does
not; the worker's system server `/health` answers 503 while any endpoint is notready. A probe
that timed out is not stopped. Any stream that completes on the endpoint, and any non-error
chunk, sets it ready too and restarts the wait, whoever sent the request.

The sidecar (`python -m sidecar`) finds the worker's instance on the worker's system server
(`SIDECAR_ENGINE_URL`) and sends its canary over the request plane straight to that instance
(`client.direct`), with a deadline over the whole stream and `Context.stop_generating()` when it
runs out. Its plan, from `health-sidecar --check-config` (ports and directory as in the run's
shape):

```text
{sidecar_plan()}
```

The two share the worker, as they would in a pod, and see each other's requests unevenly:
Dynamo's loop counts every canary of the sidecar's that ends (or yields a chunk) as activity;
the sidecar reads the worker's `dynamo_component_*` metrics, where its own canary counts as a
request in flight and, once ended, as a completed request, while Dynamo's in-process probes do
not count at all.

The sidecar's footprint with this transport, beside the HTTP transport, and the image with and
without the `dynamo` extra: [dynamo-footprint.md](dynamo-footprint.md) and
[image.md](image.md#the-dynamo-extra).

## Observations per run

{facts(all_reps)}
"""


NOTES = """\
(written from this run and two trial runs before it; rerun and reread before trusting it for
another version)

- **On one worker, the sidecar blinds Dynamo's own canary (1, 2, 1b).** On the shared worker,
  Dynamo's own `/health` said 200 through most or all of an idle hang (in some runs it never
  turned 503 at all, in others it turned 503 late and flapped back to 200 for most of the reads
  after that: see the row and the trial runs), while the same canary on a worker of its own (the
  control) turned 503 within about 1-2 s and stayed so. Dynamo's runtime takes any stream that
  completes on the endpoint, and any non-error chunk, as proof of health: the ingress notifies the
  canary loop, which sets the endpoint ready and restarts its wait
  (`../shared/reference/dynamo-health.md` §2.4, "Activity signal", runtime G2 and later). The
  sidecar stops each canary that runs out its deadline, and a stopped request's stream then ends
  normally (the fake worker's handler returns, as a handler that aborts its engine request does):
  one "activity" a second, as often as Dynamo's own probes time out. The restarted wait shows in
  the count too: usually fewer Dynamo probes in the window than the control's 10. Row 1b is the
  check: when the handler ignores `stop_generating()`, the sidecar's canaries never end either,
  and Dynamo's own canary turns 503 and stays so, as on its own worker. So with both on one
  worker, the worker's own `/health` is no second opinion on a hang: the sidecar's verdict is the
  one to use, and Dynamo's canary only adds stalled probes. (Whether a real engine's handler ends
  a stopped stream the same way was not measured here; the notification is the runtime's, not the
  fake's.)
- **Dynamo's own canary, alone (controls).** It turns 503 on its first timed-out probe, 1-2 s
  after an idle hang (its next probe, then its 1 s timeout), and never on a hang after the first
  chunk: it judges the first chunk only. It never stops a probe that timed out: one stalled probe
  more every second, 10 at the end of the 10 s window in every run, none ended before the fault
  was cleared (peak = end). On a real engine each holds a sequence slot and its KV blocks until
  the hang ends. (By hand, earlier: 503 in 1.5-2.6 s, 14-16 stalled probes over a longer
  window.)
- **The sidecar (1, 1b, 2).** 503 about 1-2 s after the fault, for both kinds of hang and with or
  without Dynamo's canary on its worker: its deadline covers the whole stream, so a stream stalled
  after its first chunk times out like a hang. It stops every canary on the worker at its
  deadline: one at a time, 10 in the window, never more than 1 or 2 running there for a moment (1b
  shows what ignoring the stop would cost: 10). Three things in its reasons to look at. It decides
  by the stall rule ("stalled: 1 requests in flight and no engine progress ... the canary sent to
  confirm timed out"), not by "canary timeout", and so flips on the first timed-out canary instead
  of after `SIDECAR_FAILURE_THRESHOLD` (2). The one request in flight that the worker's
  `dynamo_component_inflight_requests` shows is the sidecar's own canary: on the control worker
  nothing else ran, and on the shared worker Dynamo's stalled probes do not count (they run
  in-process, not through the request plane's ingress: 1 in flight with 9 of them on the worker; 9
  in 1b, the sidecar's own that ignored their stop). The sidecar reads its own canary as stalled
  work, which that canary then "confirms". And on the shared worker its reason can end the window
  as "canary timed out behind other work while the engine progressed (not counted)" (seen in a
  trial run): the completed-requests counter it reads as progress also counts its own stopped
  canaries. It stayed 503 throughout in every run all the same.
- **Back to 200 (1, 1b, 2).** Within 0.01-0.06 s of clearing the fault, for every prober: the
  held requests finish and the next canary passes; no stalled probe was left 1 s later.
- **Orphaned worker (3).** The record was deleted 8-10 s after SIGSTOP (a 10 s lease from its last
  keep-alive touch). While the worker is frozen its system server does not answer: its own
  `/health` gives no answer at all (a Kubernetes probe times out), the sidecar says 503 (its
  canaries time out). After SIGCONT the runtime never re-registers the expired record: the worker
  is alive, its own `/health` is 200 `ready` again at once and stays so (Dynamo's canary runs
  in-process and keeps passing, 20 probes in 20 s), although no request can reach it any more. The
  sidecar asks the same discovery as the router and stays 503 "not discoverable". Its `/live`
  (`SIDECAR_LIVENESS_WINDOW=5`) fails about 5 s into the pause on the "canary failing hard" clock
  (the canaries time out while the worker is frozen) and fails again, for good, after SIGCONT:
  either that clock runs on (seen in trial runs: the last canary's error, "Unavailable: Worker
  disconnected before response stream was established", counts as a hard failure), or it ends at
  SIGCONT (every run here), `/live` is 200 for the window, and the "not discoverable" clock,
  started when the worker answered again without its instance, fails it 5 s after SIGCONT. With a
  window shorter than the lease, `/live` fails in any pause longer than the window, orphaned or
  not; the default window is 120 s.
- **Killed worker (4).** Dynamo's canary lives in the worker's process: the worker's `/health`
  is gone with it (connection refused at the first read after the kill), which a Kubernetes probe
  counts as a failure. The sidecar's next registration check (every 1 s) is refused, and it says
  503 "engine not registered: cannot connect"; its `/live` stays 200, since a gone engine stops
  every liveness clock (a container that exited is restarted by the kubelet anyway).
"""


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dynamo_canary", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SCENARIOS),
        metavar="SCENARIO",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random fault offsets")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"write the Markdown here (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def summary(rep: Rep) -> str:
    def show(value: float | None) -> str:
        return "never" if value is None else f"{value:.2f}"

    if not rep.probers:
        return "; ".join(rep.facts)
    return "; ".join(
        f"{name}: 503 {show(r.to_503)}, 200 {show(r.to_200)}, left {r.left}, peak {r.peak}"
        for name, r in rep.probers.items()
    )


def run_all(names: Sequence[str], reps: int, rng: random.Random) -> dict[str, list[Rep]]:
    done: dict[str, list[Rep]] = {}
    for name in names:
        done[name] = []
        for index in range(1, reps + 1):
            started = now()
            print(f"[{name} {index}/{reps}] {SCENARIOS[name].title}", file=sys.stderr, flush=True)
            try:
                rep = SCENARIOS[name].run(rng)
            except Exception as exc:  # one broken run must not lose the others
                rep = Rep(facts=[f"run failed: {type(exc).__name__}: {exc}"])
            done[name].append(rep)
            print(f"    {now() - started:.0f} s: {summary(rep)}", file=sys.stderr, flush=True)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench.dynamo_canary: {why}")
    names = [n for n in SCENARIOS if n in (args.only or SCENARIOS)]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    options = [f"--reps={args.reps}", f"--seed={seed}", *(f"--only={n}" for n in args.only or ())]
    command = ".venv/bin/python -m bench.dynamo_canary " + shlex.join(options)
    started = datetime.datetime.now(datetime.UTC)
    clock, load_before, code_before = now(), load_average(), code_state()
    # SIGTERM ends the run through the finally blocks (every process stopped), as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with private_network():
        all_reps = run_all(names, args.reps, random.Random(seed))
    took = now() - clock
    print(markdown_table(table(all_reps)))
    print(facts(all_reps))
    out = args.out if args.out is not None else (DEFAULT_OUT if not args.only else None)
    if out is not None:
        code = code_line(code_before, code_state())
        text = document(all_reps, command, started, took, (load_before, load_average()), code)
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
