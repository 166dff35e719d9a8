"""Soak: the engine killed and restarted every minute for half an hour; verdicts and memory.

A benchmark, not a CI test. The sidecar runs with canaries on and every other setting at its
default against llama.cpp's ``llama-server`` (``tests.support.engines.LlamaServer``, the tiny GGUF;
the
binary cached by ``scripts/prepare_engines.sh``) when it is available, else against the fake
vLLM engine. Every ``--restart-every`` seconds (60) the engine gets SIGKILL; it starts again on
the same port ``--down-seconds`` (10) later, without restarting the sidecar.

Once per ``--interval`` (1 s) the script asks the engine's own ``/health`` (200 is *up*) and the
sidecar's ``/health`` (200 is *ready*), and reads the sidecar's VmRSS and open descriptors. A
sample where ready differs from up more than ``--grace`` (5 s) after the engine's last change
is a mismatch. Also reported: per kill, the delay until the sidecar answers 503; per restart,
from the engine's first 200 to the sidecar's. Memory is flat when the mean RSS of the last
``--window`` minutes (5) is within ``--flat-percent`` (3 %) of the mean of the first window
after ``--warmup`` minutes (1).

    .venv/bin/python -m bench.soak                               # 30 minutes
    .venv/bin/python -m bench.soak --minutes 3 --restart-every 30 --window 1 --no-wait
    .venv/bin/python -m bench.soak --write-doc                   # also update docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from bench._shared import load_average, median, metric_sum, open_fds, rss_mb, wait_for_quiet_machine
from tests.support.engines import LlamaServer, engine_paths
from tests.support.harness import ROOT, FakeEngine, Sidecar

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"


class Engine(Protocol):
    name: str
    url: str
    backend: str

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


class Llama:
    name = "llama-server (tiny GGUF)"
    backend = "openai"

    def __init__(self) -> None:
        self.server = LlamaServer("TINY_GGUF")
        self.url = self.server.url

    def start(self) -> None:
        self.server.start(wait=False)

    def kill(self) -> None:
        self.server.kill()

    def close(self) -> None:
        self.server.close()


class Fake:
    name = "fake vLLM engine"
    backend = "vllm"

    def __init__(self) -> None:
        self.engine = FakeEngine("vllm")
        self.engine.start()
        self.url = self.engine.url

    def start(self) -> None:
        if self.engine.proc is None or self.engine.proc.popen.poll() is not None:
            self.engine.start()

    def kill(self) -> None:
        assert self.engine.proc is not None
        self.engine.proc.kill()

    def close(self) -> None:
        self.engine.close()


def llama_available() -> bool:
    paths = engine_paths()
    keys = ("LLAMA_SERVER_BIN", "TINY_GGUF", "BIG_GGUF")
    return all(paths.get(k) and Path(paths[k]).exists() for k in keys)


@dataclass
class Sample:
    t: float  # seconds since the start of the soak
    engine_up: bool
    ready: bool | None  # None: the sidecar did not answer
    rss_mb: float
    fds: int


def status(client: httpx.Client, url: str) -> int | None:
    try:
        return client.get(url).status_code
    except httpx.HTTPError:
        return None


def soak(args: argparse.Namespace, engine: Engine) -> dict[str, Any]:
    side = Sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": engine.backend,
            "SIDECAR_ENGINE_URL": engine.url,
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        }
    )
    samples: list[Sample] = []
    kills: list[float] = []
    restarts: list[float] = []
    try:
        side.wait_serving()
        side.wait_status(200, 30)
        pid = side.proc.pid
        began = time.monotonic()
        duration = args.minutes * 60
        next_kill, restart_at = args.restart_every, None
        with httpx.Client(timeout=min(1.0, args.interval), trust_env=False) as client:
            tick = 0
            while (now := time.monotonic() - began) < duration:
                if restart_at is None and now >= next_kill:
                    engine.kill()
                    kills.append(time.monotonic() - began)
                    restart_at = now + args.down_seconds
                    next_kill += args.restart_every
                elif restart_at is not None and now >= restart_at:
                    restarts.append(time.monotonic() - began)
                    engine.start()
                    restart_at = None
                if side.proc.popen.poll() is not None:
                    raise RuntimeError(f"the sidecar exited: {side.proc.output()[-2000:]}")
                up = status(client, f"{engine.url}/health") == 200
                code = status(client, f"{side.url}/health")
                ready = None if code is None else code == 200
                samples.append(
                    Sample(
                        round(time.monotonic() - began, 3), up, ready, rss_mb(pid), open_fds(pid)
                    )
                )
                tick += 1
                time.sleep(max(0.0, began + tick * args.interval - time.monotonic()))
        metrics = side.metrics()
    finally:
        side.close()
    return analyse(args, engine, samples, kills, restarts, metrics)


def analyse(
    args: argparse.Namespace,
    engine: Engine,
    samples: list[Sample],
    kills: list[float],
    restarts: list[float],
    metrics: str,
) -> dict[str, Any]:
    mismatches = []
    changed_at = 0.0
    previous_up = True
    for s in samples:
        if s.engine_up != previous_up:
            previous_up, changed_at = s.engine_up, s.t
        if s.ready != s.engine_up and s.t - changed_at > args.grace:
            mismatches.append({"t": s.t, "engine_up": s.engine_up, "ready": s.ready})
    to_notready = []
    for k in kills:
        after = [s.t for s in samples if s.t >= k and s.ready is False]
        to_notready.append(round(after[0] - k, 2) if after else None)
    to_ready = []
    for r in restarts:
        up = next((s.t for s in samples if s.t >= r and s.engine_up), None)
        ready = next((s.t for s in samples if up is not None and s.t >= up and s.ready), None)
        to_ready.append(round(ready - up, 2) if up is not None and ready is not None else None)
    engine_start = [
        round(up - r, 2)
        for r in restarts
        if (up := next((s.t for s in samples if s.t >= r and s.engine_up), None)) is not None
    ]
    warm, window = args.warmup * 60, args.window * 60
    end = samples[-1].t if samples else 0.0
    first = [s.rss_mb for s in samples if warm <= s.t < warm + window]
    last = [s.rss_mb for s in samples if s.t >= end - window]
    first_mean = sum(first) / len(first) if first else float("nan")
    last_mean = sum(last) / len(last) if last else float("nan")
    drift = 100 * (last_mean - first_mean) / first_mean
    per_minute = []
    for m in range(int(end // 60) + 1):
        rss = [s.rss_mb for s in samples if m * 60 <= s.t < (m + 1) * 60]
        fds = [s.fds for s in samples if m * 60 <= s.t < (m + 1) * 60]
        if rss:
            per_minute.append({"minute": m, "rss_mb": round(max(rss), 2), "fds_max": max(fds)})
    outcomes = {
        o: metric_sum(metrics, "health_sidecar_canary_total", endpoint="generate", outcome=o)
        for o in ("success", "timeout", "error", "refused", "invalid")
    }
    transitions = {
        to: metric_sum(
            metrics, "health_sidecar_endpoint_transitions_total", endpoint="generate", to=to
        )
        for to in ("ready", "notready")
    }
    known = [x for x in to_notready if x is not None]
    known_ready = [x for x in to_ready if x is not None]
    return {
        "engine": engine.name,
        "minutes": args.minutes,
        "restart_every_s": args.restart_every,
        "down_seconds": args.down_seconds,
        "interval_s": args.interval,
        "grace_s": args.grace,
        "samples": len(samples),
        "kills": len(kills),
        "restarts": len(restarts),
        "mismatches_beyond_grace": len(mismatches),
        "mismatch_detail": mismatches[:50],
        "sidecar_unanswered_samples": sum(s.ready is None for s in samples),
        "kill_to_503_s": {"median": median(known), "max": max(known, default=None)},
        "kill_to_503_missed": sum(x is None for x in to_notready),
        "engine_start_to_200_s": {
            "median": median(engine_start),
            "max": max(engine_start, default=None),
        },
        "engine_200_to_sidecar_200_s": {
            "median": median(known_ready),
            "max": max(known_ready, default=None),
        },
        "engine_200_to_sidecar_200_missed": sum(x is None for x in to_ready),
        "rss_first_window_mean_mb": round(first_mean, 2),
        "rss_last_window_mean_mb": round(last_mean, 2),
        "rss_drift_percent": round(drift, 2),
        "rss_flat": abs(drift) <= args.flat_percent,
        "rss_min_mb": round(min(s.rss_mb for s in samples), 2) if samples else None,
        "rss_max_mb": round(max(s.rss_mb for s in samples), 2) if samples else None,
        "fds_first": samples[0].fds if samples else None,
        "fds_last": samples[-1].fds if samples else None,
        "fds_max": max((s.fds for s in samples), default=None),
        "per_minute": per_minute,
        "canary_outcomes": outcomes,
        "endpoint_transitions": transitions,
    }


def markdown(result: dict[str, Any], command: str) -> str:
    r = result
    rss = ", ".join(f"{m['rss_mb']:.1f}" for m in r["per_minute"])
    outcomes = ", ".join(f"{k} {v:g}" for k, v in r["canary_outcomes"].items())
    return "\n".join(
        [
            f"`{command}`: {r['minutes']:g} minutes against {r['engine']}, killed (SIGKILL) every "
            f"{r['restart_every_s']:g} s and started again {r['down_seconds']:g} s later; "
            f"sampled every {r['interval_s']:g} s ({r['samples']} samples). {r['machine']}.",
            "",
            "| measure | result |",
            "|---|---|",
            f"| kills / restarts | {r['kills']} / {r['restarts']} |",
            f"| samples where /health disagreed with the engine > {r['grace_s']:g} s after its "
            f"last change | {r['mismatches_beyond_grace']} |",
            f"| kill to /health 503 (median / max, s; 1 s resolution) | "
            f"{r['kill_to_503_s']['median']:.2f} / {r['kill_to_503_s']['max']:.2f} "
            f"(missed: {r['kill_to_503_missed']}) |",
            f"| engine restart to its own 200 (median / max, s) | "
            f"{r['engine_start_to_200_s']['median']:.2f} / "
            f"{r['engine_start_to_200_s']['max']:.2f} |",
            f"| engine 200 to /health 200 (median / max, s) | "
            f"{r['engine_200_to_sidecar_200_s']['median']:.2f} / "
            f"{r['engine_200_to_sidecar_200_s']['max']:.2f} "
            f"(missed: {r['engine_200_to_sidecar_200_missed']}) |",
            f"| sidecar RSS, mean of minutes {r['warmup']:g}-{r['warmup'] + r['window']:g} / last "
            f"{r['window']:g} (MiB) | {r['rss_first_window_mean_mb']:.2f} / "
            f"{r['rss_last_window_mean_mb']:.2f} ({r['rss_drift_percent']:+.2f} %, "
            f"{'flat' if r['rss_flat'] else 'NOT flat'}) |",
            f"| open descriptors first / last / max | {r['fds_first']} / {r['fds_last']} / "
            f"{r['fds_max']} |",
            f"| canary outcomes | {outcomes} |",
            f"| endpoint transitions | "
            f"{', '.join(f'to {k} {v:g}' for k, v in r['endpoint_transitions'].items())} |",
            "",
            f"Sidecar RSS (MiB), highest sample of each minute: {rss}.",
        ]
    )


def write_doc(text: str) -> None:
    doc = DOC.read_text() if DOC.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        head, _, rest = doc.partition(BEGIN)
        _, _, tail = rest.partition(END)
        doc = head + block + tail
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(doc)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--restart-every", type=float, default=60, help="seconds between kills")
    parser.add_argument("--down-seconds", type=float, default=10, help="from a kill to the start")
    parser.add_argument("--interval", type=float, default=1.0, help="sampling period, seconds")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0, help="minutes before the first window")
    parser.add_argument("--window", type=float, default=5.0, help="RSS window, minutes")
    parser.add_argument("--flat-percent", type=float, default=3.0)
    parser.add_argument("--engine", choices=["auto", "llama", "fake"], default="auto")
    parser.add_argument("--no-wait", action="store_true", help="don't wait for other benchmarks")
    parser.add_argument("--json", type=Path, help="also write the full results here")
    parser.add_argument("--write-doc", action="store_true", help=f"update the soak part of {DOC}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.down_seconds >= args.restart_every:
        raise SystemExit("--down-seconds must be shorter than --restart-every")
    note = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {note}", file=sys.stderr)
    use_llama = args.engine == "llama" or (args.engine == "auto" and llama_available())
    engine: Engine = Llama() if use_llama else Fake()
    try:
        if isinstance(engine, Llama):
            engine.start()
            engine.server.wait_ready()
        result = soak(args, engine)
    finally:
        engine.close()
    result |= {"machine": f"Machine: {note}", "warmup": args.warmup, "window": args.window}
    result["load_average_at_end"] = load_average()
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    command = ".venv/bin/python -m bench.soak " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-doc"
    )
    text = markdown(result, command.strip())
    print(text)
    if args.write_doc:
        write_doc(text)
    return 0 if result["mismatches_beyond_grace"] == 0 and result["rss_flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
