"""Benchmark 3: the load the sidecar puts on the engine, idle and while the engine serves traffic.

The sidecar runs with canaries on and every other setting at its default (``DYN_CANARY_WAIT_TIME``
10 s, registration and engine-metrics reads every 1 s) against the fake vLLM engine (generation
latency ``--engine-latency``, 0.05 s). Three windows:

1. **Engine alone** (``--control-seconds``, 60): the engine's CPU time with no sidecar, the
   baseline for what the sidecar's reads cost it.
2. **Idle engine** (``--seconds``, 180): the sidecar's canaries per minute, counted in the
   engine's request log (``x-request-id: canary-...``), and the engine's CPU.
3. **Engine serving traffic** (``--seconds``): ``--clients`` (2) threads send completions back to
   back (``max_tokens`` 16); canaries per minute again. The engine's counters advance every
   second, which proves health: the sidecar sends no canary to an engine with work in flight and
   puts the next one off by ``DYN_CANARY_WAIT_TIME`` after each advance.

The registration check (``GET /health``) and the metrics read (``GET /metrics``) are not in the
fake engine's request log (it records generations only); they are one each per second by
configuration, and their cost shows in the engine CPU of window 2 against window 1.

    .venv/bin/python -m bench.engine_load                  # about 7.5 minutes
    .venv/bin/python -m bench.engine_load --seconds 30 --control-seconds 10 --no-wait
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench._shared import cpu_seconds, load_average, wait_for_quiet_machine
from tests.support.harness import FakeEngine, Sidecar, running


def is_canary(request: dict[str, Any]) -> bool:
    return str(request["headers"].get("x-request-id", "")).startswith("canary-")


def window(engine: FakeEngine, start: float, end: float) -> dict[str, Any]:
    inside = [r for r in engine.requests() if start <= r["time"] <= end]
    canaries = sorted(r["time"] for r in inside if is_canary(r))
    minutes = (end - start) / 60
    per_minute = [
        sum(start + 60 * m <= t < start + 60 * (m + 1) for t in canaries)
        for m in range(int(minutes))
    ]
    return {
        "seconds": round(end - start, 1),
        "canaries": len(canaries),
        "canaries_per_minute": round(len(canaries) / minutes, 2),
        "canaries_in_each_full_minute": per_minute,
        "other_generations": len(inside) - len(canaries),
        "other_generations_per_minute": round((len(inside) - len(canaries)) / minutes, 1),
    }


class Traffic:
    """Client threads sending completions back to back until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.errors = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        body = {"model": "tiny", "prompt": "a steady stream of work", "max_tokens": 16}
        with httpx.Client(timeout=10, trust_env=False) as client:
            while not self.stop.is_set():
                try:
                    ok = client.post(f"{self.url}/v1/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                with self.lock:
                    self.sent += 1
                    self.errors += not ok

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)


def run(args: argparse.Namespace) -> dict[str, Any]:
    note = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {note}", file=sys.stderr)
    engine = FakeEngine("vllm", "aggregated", "--latency", str(args.engine_latency))
    with running(engine):
        engine.start()
        assert engine.proc is not None
        engine_pid = engine.proc.pid
        before = cpu_seconds(engine_pid)
        time.sleep(args.control_seconds)
        control = {
            "seconds": args.control_seconds,
            "engine_cpu_percent": round(
                100 * (cpu_seconds(engine_pid) - before) / args.control_seconds, 3
            ),
        }
        print(f"engine alone: {control}", file=sys.stderr)
        side = Sidecar(
            {
                "DYN_HEALTH_CHECK_ENABLED": "true",
                "SIDECAR_ENGINE_URL": engine.url,
                "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
            }
        )
        with running(side):
            side.wait_serving()
            side.wait_status(200, 15)
            before, start = cpu_seconds(engine_pid), time.time()
            time.sleep(args.seconds)
            end = time.time()
            idle = window(engine, start, end)
            idle["engine_cpu_percent"] = round(
                100 * (cpu_seconds(engine_pid) - before) / (end - start), 3
            )
            idle["sidecar_status_at_end"] = side.health()[0]
            print(f"idle engine: {idle}", file=sys.stderr)
            with Traffic(engine.url, args.clients) as traffic:
                time.sleep(2)  # the traffic is steady before the window opens
                start = time.time()
                statuses: list[int] = []
                while time.time() - start < args.seconds:
                    statuses.append(side.health()[0])
                    time.sleep(1)
                end = time.time()
            busy = window(engine, start, end)
            busy["traffic_errors"] = traffic.errors
            busy["sidecar_503_seconds"] = sum(code != 200 for code in statuses)
            print(f"busy engine: {busy}", file=sys.stderr)
    return {
        "machine": note,
        "load_average_at_end": load_average(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine_alone": control,
        "idle_engine": idle,
        "busy_engine": busy,
    }


def markdown(result: dict[str, Any]) -> str:
    i, b, c = result["idle_engine"], result["busy_engine"], result["engine_alone"]
    return "\n".join(
        [
            "| engine | canaries / min | each full minute | other generations / min | "
            "engine CPU % |",
            "|---|---|---|---|---|",
            f"| alone, no sidecar ({c['seconds']:.0f} s) | | | | {c['engine_cpu_percent']:.2f} |",
            f"| idle ({i['seconds']:.0f} s) | {i['canaries_per_minute']:.2f} | "
            f"{i['canaries_in_each_full_minute']} | {i['other_generations_per_minute']} | "
            f"{i['engine_cpu_percent']:.2f} |",
            f"| serving traffic ({b['seconds']:.0f} s) | {b['canaries_per_minute']:.2f} | "
            f"{b['canaries_in_each_full_minute']} | {b['other_generations_per_minute']} | |",
            "",
            f"Sidecar /health not 200 during traffic: {b['sidecar_503_seconds']} s of "
            f"{b['seconds']:.0f}; traffic errors {b['traffic_errors']}. "
            f"Machine: {result['machine']}; load average at end {result['load_average_at_end']}.",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_load", description=__doc__)
    parser.add_argument("--seconds", type=float, default=180, help="each measured window")
    parser.add_argument("--control-seconds", type=float, default=60)
    parser.add_argument("--engine-latency", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=2)
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
