"""Benchmark 2: footprint. Resident memory, idle CPU and start time, beside the bare app.

Three measurements, each beside ``bench/bare_app.py`` (the same stack without the sidecar):

- **Start**: from ``exec`` to the first answer on ``/health`` (any status: the sidecar answers
  503 until a canary passed), median of ``--starts`` (5) alternating starts; for the sidecar
  also the time to its first 200 (registration plus one canary against an instant engine).
- **Memory**: VmRSS after start; then the sidecar sends ``--canaries`` (10,000) canaries as fast
  as its schedule allows (``DYN_CANARY_WAIT_TIME=0.001`` against a fake engine with no latency)
  with a sample every 1,000 (counted by ``health_sidecar_canary_total``), then serves as many
  ``/health`` requests; the bare app serves the same number of requests. "Flat" is judged from
  the 1,000th to the last sample (the first thousand includes one-off warm-up allocations).
- **Idle CPU**: a sidecar with canaries on and every other setting at its default (a canary
  every 10 s, registration and engine metrics every second), a sidecar with canaries off and the
  bare app, all idle beside an idle fake engine over the same ``--idle-seconds`` (60) window:
  CPU seconds (``utime + stime``) over wall seconds.

    .venv/bin/python -m bench.footprint                     # about 3 minutes
    .venv/bin/python -m bench.footprint --canaries 2000 --idle-seconds 5 --starts 2 --no-wait
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench._shared import (
    BareApp,
    cpu_seconds,
    load_average,
    median,
    metric_sum,
    rss_mb,
    wait_for_quiet_machine,
)
from tests.support.harness import FakeEngine, Sidecar, running

LISTED = '["generate"]'


def canary_env(engine: FakeEngine, **extra: str) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_ENGINE_URL": engine.url,
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": LISTED,
        **extra,
    }


def first_answer(
    url: str, started: float, popen: subprocess.Popen[bytes], timeout: float = 20
) -> float:
    """Seconds from ``started`` to the first HTTP answer (any status) from ``url``."""
    with httpx.Client(timeout=0.5, trust_env=False) as client:
        while time.monotonic() - started < timeout:
            try:
                client.get(url)
            except httpx.HTTPError:
                if popen.poll() is not None:
                    raise RuntimeError(f"{url}: the process exited") from None
                time.sleep(0.002)
                continue
            return time.monotonic() - started
    raise RuntimeError(f"{url}: no answer within {timeout} s")


def start_times(engine: FakeEngine, starts: int) -> dict[str, Any]:
    sidecar_serving, sidecar_ready, bare_serving = [], [], []
    for _ in range(starts):
        began = time.monotonic()
        side = Sidecar(canary_env(engine, SIDECAR_LOG_LEVEL="WARNING"))
        try:
            health = f"{side.url}/health"
            sidecar_serving.append(first_answer(health, began, side.proc.popen))
            side.wait_status(200, 15)
            sidecar_ready.append(time.monotonic() - began)
        finally:
            side.close()
        began = time.monotonic()
        bare = BareApp()
        try:
            bare_serving.append(first_answer(f"{bare.url}/health", began, bare.proc.popen))
        finally:
            bare.close()
    return {
        "sidecar_first_answer_s": [round(x, 3) for x in sidecar_serving],
        "sidecar_first_200_s": [round(x, 3) for x in sidecar_ready],
        "bare_first_answer_s": [round(x, 3) for x in bare_serving],
        "sidecar_first_answer_median_s": round(median(sidecar_serving), 3),
        "sidecar_first_200_median_s": round(median(sidecar_ready), 3),
        "bare_first_answer_median_s": round(median(bare_serving), 3),
    }


def canaries_sent(side: Sidecar) -> int:
    text = side.metrics()
    return int(metric_sum(text, "health_sidecar_canary_total", endpoint="generate"))


def serve_requests(url: str, pid: int, count: int, every: int) -> list[dict[str, float]]:
    """GET ``url`` ``count`` times on one keep-alive connection, sampling RSS every ``every``."""
    samples = []
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        for n in range(1, count + 1):
            client.get(url)
            if n % every == 0:
                samples.append({"requests": n, "rss_mb": round(rss_mb(pid), 2)})
    return samples


def memory(engine: FakeEngine, canaries: int, every: int) -> dict[str, Any]:
    env = canary_env(engine, DYN_CANARY_WAIT_TIME="0.001", SIDECAR_LOG_LEVEL="WARNING")
    side = Sidecar(env)
    with running(side):
        side.wait_serving()
        after_start = rss_mb(side.proc.pid)
        side.wait_status(200, 15)
        samples = [{"canaries": canaries_sent(side), "rss_mb": round(rss_mb(side.proc.pid), 2)}]
        began = time.monotonic()
        next_mark = every
        while next_mark <= canaries:
            sent = canaries_sent(side)
            if sent >= next_mark:
                samples.append({"canaries": sent, "rss_mb": round(rss_mb(side.proc.pid), 2)})
                next_mark += every
                continue
            if time.monotonic() - began > 600:
                raise RuntimeError(f"only {sent} canaries in 600 s")
            time.sleep(0.05)
        canary_seconds = time.monotonic() - began
        # Canaries keep running while /health is served: the request count is what varies.
        served = serve_requests(f"{side.url}/health", side.proc.pid, canaries, every)
        side_end = rss_mb(side.proc.pid)
        side_total = canaries_sent(side)
    bare = BareApp()
    with running(bare):
        bare.wait_serving()
        bare_start = rss_mb(bare.pid)
        bare_samples = serve_requests(f"{bare.url}/health", bare.pid, canaries, every)
        bare_end = rss_mb(bare.pid)
    steady = [s["rss_mb"] for s in samples if s["canaries"] >= every]
    return {
        "sidecar_rss_after_start_mb": round(after_start, 2),
        "sidecar_rss_per_canaries": samples,
        "canary_phase_seconds": round(canary_seconds, 1),
        "sidecar_rss_per_health_requests": served,
        "sidecar_rss_end_mb": round(side_end, 2),
        "sidecar_canaries_total_at_end": side_total,
        "sidecar_growth_after_first_1000_mb": round(max(steady) - steady[0], 2) if steady else None,
        "bare_rss_after_start_mb": round(bare_start, 2),
        "bare_rss_per_requests": bare_samples,
        "bare_rss_end_mb": round(bare_end, 2),
        "ratio_after_start": round(after_start / bare_start, 3),
        "ratio_end": round(side_end / bare_end, 3),
    }


def idle_cpu(engine: FakeEngine, seconds: float) -> dict[str, Any]:
    on = Sidecar(canary_env(engine, SIDECAR_LOG_LEVEL="WARNING"))
    off = Sidecar({"SIDECAR_ENGINE_URL": engine.url, "SIDECAR_LOG_LEVEL": "WARNING"})
    bare = BareApp()
    with running(on, off, bare):
        on.wait_serving()
        off.wait_serving()
        bare.wait_serving()
        on.wait_status(200, 15)
        off.wait_status(200, 15)
        time.sleep(2)
        pids = {"sidecar_canary_on": on.proc.pid, "sidecar_canary_off": off.proc.pid}
        pids["bare"] = bare.pid
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        began = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - began
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        rss = {name: round(rss_mb(pid), 2) for name, pid in pids.items()}
    return {
        "seconds": round(wall, 1),
        "cpu_seconds": {k: round(v, 3) for k, v in used.items()},
        "cpu_percent": {k: round(100 * v / wall, 3) for k, v in used.items()},
        "rss_mb_at_end": rss,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    note = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {note}", file=sys.stderr)
    engine = FakeEngine("vllm")
    with running(engine):
        engine.start()
        print("start times ...", file=sys.stderr)
        starts = start_times(engine, args.starts)
        print(json.dumps(starts), file=sys.stderr)
        print("memory ...", file=sys.stderr)
        mem = memory(engine, args.canaries, args.every)
        print(json.dumps(mem), file=sys.stderr)
        print("idle CPU ...", file=sys.stderr)
        cpu = idle_cpu(engine, args.idle_seconds)
        print(json.dumps(cpu), file=sys.stderr)
    return {
        "machine": note,
        "load_average_at_end": load_average(),
        "start": starts,
        "memory": mem,
        "idle_cpu": cpu,
    }


def markdown(result: dict[str, Any]) -> str:
    s, m, c = result["start"], result["memory"], result["idle_cpu"]
    canary_rss = ", ".join(
        f"{x['canaries']}: {x['rss_mb']:.1f}" for x in m["sidecar_rss_per_canaries"]
    )
    served = ", ".join(
        f"{x['requests']}: {x['rss_mb']:.1f}" for x in m["sidecar_rss_per_health_requests"]
    )
    bare = ", ".join(f"{x['requests']}: {x['rss_mb']:.1f}" for x in m["bare_rss_per_requests"])
    pct = c["cpu_percent"]
    return "\n".join(
        [
            "| measure | sidecar | bare app | ratio |",
            "|---|---|---|---|",
            f"| RSS after start (MiB) | {m['sidecar_rss_after_start_mb']:.1f} | "
            f"{m['bare_rss_after_start_mb']:.1f} | {m['ratio_after_start']:.2f} |",
            f"| RSS at end (MiB) | {m['sidecar_rss_end_mb']:.1f} | {m['bare_rss_end_mb']:.1f} | "
            f"{m['ratio_end']:.2f} |",
            f"| idle CPU, canaries on / off (% of a core over {c['seconds']:.0f} s) | "
            f"{pct['sidecar_canary_on']:.2f} / {pct['sidecar_canary_off']:.2f} | "
            f"{pct['bare']:.2f} | |",
            f"| exec to first /health answer, median (s) | "
            f"{s['sidecar_first_answer_median_s']:.3f} | {s['bare_first_answer_median_s']:.3f} | "
            f"{s['sidecar_first_answer_median_s'] / s['bare_first_answer_median_s']:.2f} |",
            f"| exec to first 200 (s) | {s['sidecar_first_200_median_s']:.3f} | | |",
            "",
            f"Sidecar RSS (MiB) by canaries sent: {canary_rss} "
            f"({m['canary_phase_seconds']:.0f} s); growth after the first 1,000: "
            f"{m['sidecar_growth_after_first_1000_mb']} MiB.",
            f"Then by /health requests served: {served}.",
            f"Bare app RSS (MiB) by requests served: {bare}.",
            f"Machine: {result['machine']}; load average at end {result['load_average_at_end']}.",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__)
    parser.add_argument("--canaries", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1_000, help="RSS sample every N canaries")
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--starts", type=int, default=5)
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
