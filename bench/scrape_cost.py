"""Benchmark: what an endpoint picker's scrape of the sidecar's ``/metrics`` costs the sidecar.

llm-d's endpoint picker, configured as ``deploy/llm-d/epp-config.yaml``, scrapes the sidecar's
``/metrics`` every 200 ms (the llm-d resiliency operator's interval); its base tick is 50 ms. This
measures, side by side in one run, what that costs the sidecar: its CPU, and the latency of the
``/health`` its readiness probe asks meanwhile.

One fake vLLM engine with ``--dp-size 8`` (``python -m fakeengine``) and one sidecar with
``SIDECAR_DP_RANKS=auto`` and canaries on (``DYN_HEALTH_CHECK_ENABLED=true``), defaults otherwise,
both started once. Then, per rep, each arm for ``--seconds`` (the order alternates: forward, then
reversed): no scrape, and a scraper every ``--intervals`` seconds. The scraper is a process of its
own (``python -m bench.scrape_cost --scraper URL --interval S``) that GETs ``/metrics`` over one
kept-alive connection at a fixed period, dropping ticks it is late for (as the EPP's Go client
and ticker do); this process probes ``/health`` ``--probe-rate`` times a second, each on a new
connection (as the kubelet does). Per window: the sidecar's CPU (``utime + stime`` from
``/proc`` over the wall time), ``/health`` latency (p50, p99, max) and non-200 answers, the
scrapes made, their size and latency. Ratios are taken against the no-scrape window of the same
rep, then their median over reps.

Writes docs/scrape-cost.md (``--out``; ``--no-doc`` does not) with the command that reproduces it
(``--from-json`` writes it again from a run's ``--json`` figures):

    .venv/bin/python -m bench.scrape_cost                       # 3 arms x 2 reps x 60 s: ~7 min
    .venv/bin/python -m bench.scrape_cost --seconds 5 --reps 1 --warmup 1 --no-wait --no-doc
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._shared import (
    code_version,
    cpu_model,
    cpu_seconds,
    cpus,
    load_average,
    median,
    wait_for_quiet_machine,
)
from bench._versions import DEFAULT_SCRATCH, scratch
from tests.support.harness import ROOT, FakeEngine, Sidecar, base_env, wait_until

RANKS = 8
DOC = ROOT / "docs" / "scrape-cost.md"
READY_TIMEOUT = 120.0  # the ranks are counted from the engine's metrics, then each canary passes


# --- the scraper (a process of its own) --------------------------------------------------------
def scrape(url: str, interval: float) -> int:
    """GET ``url`` every ``interval`` s until stdin closes; print "ready" after the first answer,
    then one JSON line of what was measured."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    latencies: list[float] = []
    sizes: list[int] = []
    failures = 0
    dropped = 0
    # Go's http.Transport asks for gzip unless told not to; the sidecar answers plain text anyway.
    with httpx.Client(timeout=10, trust_env=False, headers={"Accept-Encoding": "gzip"}) as http:
        began = time.monotonic()
        tick = 0
        while not stop.is_set():
            sent = time.perf_counter()
            try:
                answer = http.get(url)
                ok = answer.status_code == 200
                size = len(answer.content)
            except httpx.HTTPError:
                ok, size = False, 0
            latencies.append((time.perf_counter() - sent) * 1e3)
            if ok:
                sizes.append(size)
            else:
                failures += 1
            if tick == 0:
                print("ready", flush=True)
            tick += 1
            due = began + tick * interval
            late = time.monotonic() - due
            if late > 0:  # a ticker drops the ticks it missed
                skipped = math.floor(late / interval) + 1
                dropped += skipped
                tick += skipped
                due = began + tick * interval
            stop.wait(max(0.0, due - time.monotonic()))
        took = time.monotonic() - began
    print(
        json.dumps(
            {
                "seconds": took,
                "scrapes": len(latencies),
                "failures": failures,
                "dropped_ticks": dropped,
                "latencies_ms": latencies,
                "bytes": sizes,
            }
        ),
        flush=True,
    )
    return 0


class Scraper:
    """``python -m bench.scrape_cost --scraper`` in its own process group, its log in ``where``."""

    def __init__(self, url: str, interval: float, where: Path) -> None:
        self.log = (where / f"scraper-{interval:g}.log").open("ab")
        argv = [sys.executable, "-m", "bench.scrape_cost", "--scraper", url]
        self.popen = subprocess.Popen(
            [*argv, "--interval", str(interval)],
            cwd=ROOT,
            env=base_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
            text=True,
        )

    def wait_ready(self, timeout: float = 10.0) -> None:
        assert self.popen.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise RuntimeError(f"the scraper did not answer within {timeout} s")
        line = self.popen.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the scraper said {line!r} (log: {self.log.name})")

    def finish(self, timeout: float = 15.0) -> dict[str, Any]:
        """Close its stdin (it stops after the scrape in flight) and read what it measured."""
        out, _ = self.popen.communicate(timeout=timeout)  # closes its stdin first
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        self.log.close()


# --- one window --------------------------------------------------------------------------------
@dataclass
class Window:
    arm: str
    interval: float | None
    rep: int
    seconds: float = 0.0
    cpu_percent: float = 0.0
    health_ms: list[float] = field(default_factory=list)
    health_non_200: int = 0
    health_errors: int = 0
    load_start: str = ""
    load_end: str = ""
    scraper: dict[str, Any] = field(default_factory=dict)

    @property
    def scrapes_per_second(self) -> float:
        if not self.scraper:
            return 0.0
        return float(self.scraper["scrapes"]) / float(self.scraper["seconds"])


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest rank: the smallest value with at least ``fraction`` of the values at or below it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def probe(url: str, seconds: float, rate: float, window: Window | None) -> None:
    """GET ``url`` ``rate`` times a second for ``seconds``, each on a new connection; record the
    latencies and answers in ``window`` (None: a warm-up, recorded nowhere)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=5, trust_env=False, limits=limits) as http:
        began = time.monotonic()
        tick = 0
        while (due := began + tick / rate) < began + seconds:
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # the probe rate, not a wait for a condition
            sent = time.perf_counter()
            try:
                status: int | None = http.get(url).status_code
            except httpx.HTTPError:
                status = None
            took = (time.perf_counter() - sent) * 1e3
            tick = max(tick + 1, math.floor((time.monotonic() - began) * rate) + 1)
            if window is None:
                continue
            window.health_ms.append(took)
            if status is None:
                window.health_errors += 1
            elif status != 200:
                window.health_non_200 += 1


def measure(side: Sidecar, window: Window, args: argparse.Namespace, where: Path) -> Window:
    scraper = (
        None if window.interval is None else Scraper(f"{side.url}/metrics", window.interval, where)
    )
    try:
        if scraper is not None:
            scraper.wait_ready()
        window.load_start = load_average()
        cpu_before, began = cpu_seconds(side.pid), time.monotonic()
        probe(f"{side.url}/health", args.seconds, args.probe_rate, window)
        window.seconds = time.monotonic() - began
        window.cpu_percent = 100 * (cpu_seconds(side.pid) - cpu_before) / window.seconds
        window.load_end = load_average()
        if scraper is not None:
            window.scraper = scraper.finish()
    finally:
        if scraper is not None:
            scraper.close()
    return window


@contextlib.contextmanager
def subjects() -> Iterator[Sidecar]:
    """The fake engine with 8 ranks and a sidecar that has counted them and says 200."""
    engine = FakeEngine("vllm", "aggregated", "--dp-size", str(RANKS))
    engine.start()
    side: Sidecar | None = None
    try:
        side = Sidecar(
            {
                "DYN_HEALTH_CHECK_ENABLED": "true",
                "SIDECAR_BACKEND": "vllm",
                "SIDECAR_ENGINE_URL": engine.url,
                "SIDECAR_DP_RANKS": "auto",
                "SIDECAR_LOG_LEVEL": "WARNING",
            }
        ).wait_serving()

        def ready_with_ranks() -> bool:
            answer = side.get("/health")
            ranks = answer.json().get("ranks", {}).get("generate", {})
            return answer.status_code == 200 and ranks.get("count") == RANKS

        wait_until(ready_with_ranks, READY_TIMEOUT, interval=0.5, what=f"{RANKS} ranks ready")
        yield side
    finally:
        if side is not None:
            side.close()
        engine.close()


def arms(intervals: Sequence[float]) -> list[tuple[str, float | None]]:
    return [("no scrape", None)] + [(f"every {i * 1e3:g} ms", i) for i in intervals]


def run(args: argparse.Namespace) -> dict[str, Any]:
    quiet = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {quiet}", file=sys.stderr)
    started = datetime.datetime.now(datetime.UTC)
    load_before, code = load_average(), code_version()  # the code the sidecar starts from
    windows: list[Window] = []
    with scratch(args.scratch, "scrape-cost") as where, subjects() as side:
        probe(f"{side.url}/health", args.warmup, args.probe_rate, None)
        metrics_bytes = len(side.get("/metrics").content)
        for rep in range(1, args.reps + 1):
            order = arms(args.intervals)
            if rep % 2 == 0:
                order.reverse()
            for arm, interval in order:
                window = measure(side, Window(arm, interval, rep), args, where)
                print(
                    f"rep {rep} {arm}: CPU {window.cpu_percent:.2f} %, /health p99 "
                    f"{percentile(window.health_ms, 0.99):.2f} ms, "
                    f"{window.scrapes_per_second:.1f} scrapes/s",
                    file=sys.stderr,
                )
                windows.append(window)
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpus()} CPUs ({cpu_model()})",
        "quiet": quiet,
        "code": code,
        "code_at_end": code_version(),
        "load_before": load_before,
        "load_after": load_average(),
        "metrics_bytes_at_start": metrics_bytes,
        "windows": [asdict(w) | {"scrapes_per_second": w.scrapes_per_second} for w in windows],
    }


# --- the report ------------------------------------------------------------------------------
def _range(values: Sequence[float], digits: int = 2) -> str:
    text = f"{median(values):.{digits}f}"
    if values and f"{min(values):.{digits}f}" != f"{max(values):.{digits}f}":
        text += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return text


def markdown(result: dict[str, Any], command: str) -> str:
    windows = result["windows"]
    reps = sorted({w["rep"] for w in windows})
    labels = list(dict.fromkeys(w["arm"] for w in windows if w["rep"] == reps[0]))
    labels.sort(key=lambda label: -1 if label == "no scrape" else 0)
    base = {w["rep"]: w for w in windows if w["interval"] is None}

    def of(label: str) -> list[dict[str, Any]]:
        return [w for w in windows if w["arm"] == label]

    def ratio(label: str, figure: str) -> str:
        values = []
        for w in of(label):
            mine, theirs = w[figure], base[w["rep"]][figure]
            values.append(mine / theirs if theirs else float("nan"))
        return _range(values)

    changed = ""
    if result["code_at_end"] != result["code"]:
        changed = f" (the checkout was {result['code_at_end']} at the end of the run)"
    for w in windows:
        w["health_p50"] = percentile(w["health_ms"], 0.5)
        w["health_p99"] = percentile(w["health_ms"], 0.99)
    lines = [
        "# What scraping the sidecar's `/metrics` costs it",
        "",
        "Generated by `bench/scrape_cost.py`; reproduce with:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Run {result['started']} on {result['machine']}; the sidecar started from code "
        f"{result['code']}{changed}. Load average "
        f"(1, 5, 15 min) at the start {result['load_before']}, at the end "
        f"{result['load_after']}; {result['quiet'].split('; load average')[0]}.",
        "",
        f"The subject: the fake vLLM engine with `--dp-size {RANKS}` and one sidecar "
        "(`SIDECAR_DP_RANKS=auto`, canaries on, defaults otherwise), so that `/metrics` carries "
        f"the per-rank series of {RANKS} ranks: {result['metrics_bytes_at_start']:,} bytes. "
        "Each arm ran for "
        f"{float(result['args']['seconds']):g} s per rep, {len(reps)} reps, the order reversed "
        "every other rep; `/health` probed "
        f"{float(result['args']['probe_rate']):g} times a second on a new connection each, "
        "`/metrics` scraped over one kept-alive connection by a process of its own. CPU is the "
        "sidecar's utime + stime over the window, in % of one core. Ratios are against the "
        "no-scrape window of the same rep (median over reps, range in brackets). Each "
        "window's load average is in the last table: this benchmark adds less than 1 to it, so "
        f"the rest is other work on the {result['machine'].split()[0]}-CPU machine, which is "
        "why every comparison is within a rep.",
        "",
        "| arm | scrapes/s | `/metrics` bytes | `/metrics` p50 / p99 ms | sidecar CPU % | "
        "CPU ÷ no scrape | CPU ms per scrape | `/health` p50 / p99 / max ms | "
        "`/health` p99 ÷ no scrape | `/health` non-200 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        group = of(label)
        health = [v for w in group for v in w["health_ms"]]
        if group[0]["interval"] is None:
            scrape_cells = ["0", "—", "—"]
            per_scrape = "—"
        else:
            latencies = [v for w in group for v in w["scraper"]["latencies_ms"]]
            sizes = [b for w in group for b in w["scraper"]["bytes"]]
            rate = [w["scrapes_per_second"] for w in group]
            scrape_cells = [
                _range(rate, 1),
                f"{min(sizes):,}-{max(sizes):,}" if sizes else "—",
                f"{percentile(latencies, 0.5):.2f} / {percentile(latencies, 0.99):.2f}",
            ]
            extra = [
                10 * (w["cpu_percent"] - base[w["rep"]]["cpu_percent"]) / w["scrapes_per_second"]
                for w in group
                if w["scrapes_per_second"]
            ]
            per_scrape = _range(extra)
        non_200 = sum(w["health_non_200"] + w["health_errors"] for w in group)
        lines.append(
            f"| {label} | {' | '.join(scrape_cells)} | "
            f"{_range([w['cpu_percent'] for w in group])} | {ratio(label, 'cpu_percent')} | "
            f"{per_scrape} | {percentile(health, 0.5):.2f} / {percentile(health, 0.99):.2f} / "
            f"{max(health):.2f} | {ratio(label, 'health_p99')} | {non_200} of {len(health)} |"
        )
    lines += [
        "",
        "CPU ms per scrape: the sidecar's CPU above the same rep's no-scrape window, divided by "
        "the scrapes made. `/health` latencies pool every rep's samples of the arm.",
        "",
        "Each window:",
        "",
        "| rep | arm | seconds | sidecar CPU % | `/health` p50 / p99 / max ms | scrapes "
        "(dropped ticks) | load average at start / end |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in windows:
        scraped = "—"
        if w["scraper"]:
            scraped = f"{w['scraper']['scrapes']} ({w['scraper']['dropped_ticks']})"
        lines.append(
            f"| {w['rep']} | {w['arm']} | {w['seconds']:.1f} | {w['cpu_percent']:.2f} | "
            f"{w['health_p50']:.2f} / {w['health_p99']:.2f} / {max(w['health_ms']):.2f} | "
            f"{scraped} | {w['load_start']} / {w['load_end']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scrape_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="each arm's window")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--intervals",
        type=lambda text: [float(i) for i in text.split(",")],
        default=[0.2, 0.05],
        help="the scrape arms' periods in seconds, comma-separated (default 0.2,0.05)",
    )
    parser.add_argument("--probe-rate", type=float, default=10.0, help="/health GETs per second")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds probed unrecorded")
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    parser.add_argument("--no-wait", action="store_true", help="don't wait for other benchmarks")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--no-doc", action="store_true", help="do not write --out")
    parser.add_argument("--from-json", type=Path, help="write the report from a --json file")
    parser.add_argument("--scraper", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scraper is not None:
        return scrape(args.scraper, args.interval)
    if args.from_json is not None:  # the report again, from a run's figures
        result = json.loads(args.from_json.read_text(encoding="utf-8"))
        text = markdown(result, result["command"])
        print(text)
        if not args.no_doc:
            args.out.write_text(text, encoding="utf-8")
        return 0
    shown = [f"--seconds={args.seconds:g}", f"--reps={args.reps}"]
    shown.append("--intervals=" + ",".join(f"{i:g}" for i in args.intervals))
    shown += [f"--probe-rate={args.probe_rate:g}", f"--warmup={args.warmup:g}"]
    command = ".venv/bin/python -m bench.scrape_cost " + shlex.join(shown)
    if niceness := os.getpriority(os.PRIO_PROCESS, 0):
        command = f"nice -n {niceness} {command}"
    # SIGTERM unwinds like Ctrl-C, so that the engine, the sidecar and the scraper are ended.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = run(args) | {"command": command}
    text = markdown(result, command)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_doc:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
