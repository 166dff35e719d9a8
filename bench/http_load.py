"""Benchmark 1: /health under load while canaries run against a slow engine, beside the ceiling.

Starts the fake vLLM engine with a generation latency (default 0.3 s: a slow engine), the
sidecar with canaries on (``DYN_CANARY_WAIT_TIME`` 0.5 s, so a canary is always due or in
flight during a run; ``DYN_HEALTH_CHECK_REQUEST_TIMEOUT`` 2 s) and the bare app
(``bench/bare_app.py``: the same FastAPI, uvicorn options, uvloop and httptools, one async route
returning a constant body of the same size). Then, for each round and each concurrency, wrk
loads the bare app and the sidecar one after the other (the order alternates), each after a
short warm-up, with the same threads and duration. Reported: medians over rounds of requests/s,
p50 and p99 latency (wrk ``--latency``), non-2xx answers, the server's CPU time per request,
and the ratio sidecar / bare.

Canary schedule: with ``SIDECAR_PROGRESS_ENABLED=false`` (the default here; ``--progress`` turns
it on) a passing canary's successor starts exactly ``wait`` after it ends, so consecutive
canary arrivals at the engine are ``latency + wait`` apart (0.8 s by default). The engine's
request log gives each canary's arrival; lateness is ``interval - (latency + wait)``. A canary
is *late* when its lateness exceeds ``--late-ms`` (default 100 ms) and *skipped* when an
interval exceeds 1.5 times the expected one. Measured during every wrk run and in idle windows
(no wrk) before and after the rounds, so load and idle compare side by side.

    .venv/bin/python -m bench.http_load                 # the full run (about 7 minutes)
    .venv/bin/python -m bench.http_load --seconds 2 --warmup 1 --rounds 1 --no-wait  # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._shared import (
    BareApp,
    WrkResult,
    cpus,
    load_average,
    median,
    metric_sum,
    parse_cpus,
    pin,
    run_wrk,
    wait_for_quiet_machine,
)
from tests.support.harness import FakeEngine, Sidecar

OUTCOMES = ("success", "timeout", "error", "refused", "invalid")


@dataclass(frozen=True)
class CanaryWindow:
    """Canary arrivals at the engine during one window (a wrk run or an idle pause)."""

    label: str
    seconds: float
    count: int
    expected_count: float
    intervals: list[float]
    expected_interval: float
    late_threshold: float

    @property
    def max_lateness_ms(self) -> float:
        if not self.intervals:
            return float("nan")
        return (max(self.intervals) - self.expected_interval) * 1e3

    @property
    def median_lateness_ms(self) -> float:
        return (median(self.intervals) - self.expected_interval) * 1e3

    @property
    def late(self) -> int:
        return sum(i - self.expected_interval > self.late_threshold for i in self.intervals)

    @property
    def skipped(self) -> int:
        return sum(i > 1.5 * self.expected_interval for i in self.intervals)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "seconds": round(self.seconds, 3),
            "count": self.count,
            "expected_count": round(self.expected_count, 1),
            "median_lateness_ms": round(self.median_lateness_ms, 2),
            "max_lateness_ms": round(self.max_lateness_ms, 2),
            "late": self.late,
            "skipped": self.skipped,
        }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.expected_interval = args.engine_latency + args.wait
        self.server_cpus = parse_cpus(args.server_cpus)
        self.client_cpus = parse_cpus(args.client_cpus)

    def canaries(self, engine: FakeEngine, label: str, start: float, end: float) -> CanaryWindow:
        times = sorted(
            r["time"]
            for r in engine.requests()
            if str(r["headers"].get("x-request-id", "")).startswith("canary-")
            and start <= r["time"] <= end
        )
        intervals = [b - a for a, b in itertools.pairwise(times)]
        if times:  # a gap at either edge of the window counts as well
            intervals += [
                g for g in (times[0] - start, end - times[-1]) if g > self.expected_interval
            ]
        else:
            intervals.append(end - start)
        return CanaryWindow(
            label,
            end - start,
            len(times),
            (end - start) / self.expected_interval,
            intervals,
            self.expected_interval,
            self.args.late_ms / 1e3,
        )

    def outcomes(self, side: Sidecar) -> dict[str, float]:
        text = side.metrics()
        return {
            o: metric_sum(text, "health_sidecar_canary_total", endpoint="generate", outcome=o)
            for o in OUTCOMES
        }

    def wrk(self, url: str, connections: int, seconds: float, pid: int) -> WrkResult:
        return run_wrk(url, connections, seconds, self.args.threads, pid, self.client_cpus)


def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    note = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {note}", file=sys.stderr)
    engine = FakeEngine("vllm", "aggregated", "--latency", str(args.engine_latency))
    side: Sidecar | None = None
    bare: BareApp | None = None
    runs: list[dict[str, Any]] = []
    windows: list[CanaryWindow] = []
    try:
        engine.start()
        env = {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_ENGINE_URL": engine.url,
            "DYN_CANARY_WAIT_TIME": str(args.wait),
            "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(args.timeout),
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
            "SIDECAR_PROGRESS_ENABLED": "true" if args.progress else "false",
            "SIDECAR_LOG_LEVEL": "INFO",  # one line per change of verdict: why a 503
        }
        side = Sidecar(env)
        bare = BareApp()
        side.wait_serving()
        bare.wait_serving()
        side.wait_status(200, 15)
        pin(side.proc.pid, bench.server_cpus)
        pin(bare.pid, bench.server_cpus)
        if engine.proc is not None:
            pin(engine.proc.pid, bench.client_cpus)
        targets = {
            "bare": (f"{bare.url}/health", bare.pid),
            "sidecar": (f"{side.url}/health", side.proc.pid),
        }

        def idle(label: str) -> None:
            start = time.time()
            time.sleep(args.seconds)
            windows.append(bench.canaries(engine, label, start, time.time()))

        log_seen = len(side.proc.output())

        def new_log_lines() -> list[str]:
            """What the sidecar logged since the last call (its changes of verdict)."""
            nonlocal log_seen
            assert side is not None
            text = side.proc.output()
            lines, log_seen = text[log_seen:].splitlines(), len(text)
            return lines

        idle("idle before")
        for round_no in range(args.rounds):
            for index, connections in enumerate(args.connections):
                order = ["bare", "sidecar"]
                if (round_no + index) % 2:
                    order.reverse()
                for name in order:
                    url, pid = targets[name]
                    if args.warmup > 0:
                        bench.wrk(url, connections, args.warmup, pid)
                    before = bench.outcomes(side)
                    start = time.time()
                    result = bench.wrk(url, connections, args.seconds, pid)
                    end = time.time()
                    after = bench.outcomes(side)
                    window = bench.canaries(engine, f"{name} c={connections}", start, end)
                    failed = sum(after[o] - before[o] for o in OUTCOMES if o != "success")
                    status, _ = side.health()
                    logged = new_log_lines()
                    row = {
                        "round": round_no,
                        "target": name,
                        **result.as_dict(),
                        "canaries": window.as_dict(),
                        "canary_failures": failed,
                        "sidecar_status_after": status,
                        "sidecar_log": logged,
                        "load_average": load_average(),
                    }
                    runs.append(row)
                    print(
                        f"round {round_no} c={connections:<3} {name:<7} {result.rps:8.0f} req/s "
                        f"p50 {result.p50_ms:6.2f} ms p99 {result.p99_ms:7.2f} ms "
                        f"non-2xx {result.non_2xx} cpu {result.cpu_us_per_request:5.0f} us/req "
                        f"canaries {window.count} max late {window.max_lateness_ms:.0f} ms",
                        file=sys.stderr,
                    )
                    for line in logged:
                        print(f"    sidecar log: {line}", file=sys.stderr)
        idle("idle after")
    finally:
        for thing in (bare, side, engine):
            if thing is not None:
                thing.close()
    return {
        "machine": note,
        "cpus": cpus(),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "expected_canary_interval_s": bench.expected_interval,
        "runs": runs,
        "idle_windows": [w.as_dict() for w in windows],
        "summary": summarize(runs, windows, args.connections),
    }


def summarize(
    runs: list[dict[str, Any]], windows: list[CanaryWindow], connections: Sequence[int]
) -> list[dict[str, Any]]:
    rows = []
    for c in connections:
        bare = [r for r in runs if r["target"] == "bare" and r["connections"] == c]
        side = [r for r in runs if r["target"] == "sidecar" and r["connections"] == c]
        if not bare or not side:
            continue

        def med(group: list[dict[str, Any]], key: str) -> float:
            return median([r[key] for r in group])

        ratios = [s["rps"] / b["rps"] for b, s in zip(bare, side, strict=True)]
        rows.append(
            {
                "connections": c,
                "bare_rps": med(bare, "rps"),
                "sidecar_rps": med(side, "rps"),
                "rps_ratio_of_medians": med(side, "rps") / med(bare, "rps"),
                "rps_ratio": median(ratios),
                "rps_ratio_per_round": [round(x, 3) for x in ratios],
                "bare_p50_ms": med(bare, "p50_ms"),
                "sidecar_p50_ms": med(side, "p50_ms"),
                "bare_p99_ms": med(bare, "p99_ms"),
                "sidecar_p99_ms": med(side, "p99_ms"),
                "p99_ratio_of_medians": med(side, "p99_ms") / med(bare, "p99_ms"),
                "p99_ratio": median(
                    [s["p99_ms"] / b["p99_ms"] for b, s in zip(bare, side, strict=True)]
                ),
                "bare_cpu_us_per_request": med(bare, "cpu_us_per_request"),
                "sidecar_cpu_us_per_request": med(side, "cpu_us_per_request"),
                "sidecar_non_2xx": sum(r["non_2xx"] for r in side),
                "sidecar_socket_errors": sum(r["socket_errors"] for r in side),
                "canaries_under_sidecar_load": sum(r["canaries"]["count"] for r in side),
                "canaries_expected": round(sum(r["canaries"]["expected_count"] for r in side), 1),
                "max_lateness_ms_sidecar_load": max(r["canaries"]["max_lateness_ms"] for r in side),
                "max_lateness_ms_bare_load": max(r["canaries"]["max_lateness_ms"] for r in bare),
                "late_sidecar_load": sum(r["canaries"]["late"] for r in side),
                "skipped_sidecar_load": sum(r["canaries"]["skipped"] for r in side),
                "late_bare_load": sum(r["canaries"]["late"] for r in bare),
                "canary_failures_sidecar_load": sum(r["canary_failures"] for r in side),
            }
        )
    idle = [w.max_lateness_ms for w in windows]
    rows.append({"idle_max_lateness_ms": max(idle) if idle else None})
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| connections | bare req/s | sidecar req/s | ratio | bare p50 / p99 ms | "
        "sidecar p50 / p99 ms | p99 ratio | CPU us/req bare / sidecar | non-2xx | "
        "canaries seen / expected | max lateness ms (sidecar load / bare load) | "
        "late / skipped (sidecar load) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        if "connections" not in row:
            continue
        lines.append(
            f"| {row['connections']} | {row['bare_rps']:.0f} | {row['sidecar_rps']:.0f} | "
            f"{row['rps_ratio']:.2f} ({min(row['rps_ratio_per_round']):.2f}-"
            f"{max(row['rps_ratio_per_round']):.2f}) | "
            f"{row['bare_p50_ms']:.2f} / {row['bare_p99_ms']:.2f} | "
            f"{row['sidecar_p50_ms']:.2f} / {row['sidecar_p99_ms']:.2f} | "
            f"{row['p99_ratio']:.2f} | {row['bare_cpu_us_per_request']:.0f} / "
            f"{row['sidecar_cpu_us_per_request']:.0f} | {row['sidecar_non_2xx']} | "
            f"{row['canaries_under_sidecar_load']} / {row['canaries_expected']} | "
            f"{row['max_lateness_ms_sidecar_load']:.0f} / {row['max_lateness_ms_bare_load']:.0f} | "
            f"{row['late_sidecar_load']} / {row['skipped_sidecar_load']} |"
        )
    idle = ", ".join(
        f"{w['label']}: {w['count']} canaries, max lateness {w['max_lateness_ms']:.0f} ms"
        for w in result["idle_windows"]
    )
    lines.append("")
    lines.append(f"Idle windows: {idle}. Machine: {result['machine']}.")
    logged = [
        f"round {r['round']} c={r['connections']} ({r['target']} run): {line}"
        for r in result["runs"]
        for line in r.get("sidecar_log", [])
    ]
    if logged:
        lines += ["", "Sidecar log lines during the runs (changes of verdict):", ""]
        lines += [f"    {line}" for line in logged[:40]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.http_load", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10, help="measured seconds per wrk run")
    parser.add_argument("--warmup", type=float, default=2, help="wrk warm-up seconds per run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--connections", type=lambda s: [int(x) for x in s.split(",")], default=[10, 50, 200]
    )
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--engine-latency", type=float, default=0.3)
    parser.add_argument("--wait", type=float, default=0.5, help="DYN_CANARY_WAIT_TIME")
    parser.add_argument("--timeout", type=float, default=2, help="DYN_HEALTH_CHECK_REQUEST_TIMEOUT")
    parser.add_argument("--progress", action="store_true", help="SIDECAR_PROGRESS_ENABLED=true")
    parser.add_argument("--late-ms", type=float, default=100)
    parser.add_argument("--server-cpus", help="pin both servers to these CPUs, e.g. 0")
    parser.add_argument("--client-cpus", help="pin wrk and the fake engine to these CPUs, e.g. 1")
    parser.add_argument("--no-wait", action="store_true", help="don't wait for other benchmarks")
    parser.add_argument("--json", type=Path, help="also write the full results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
