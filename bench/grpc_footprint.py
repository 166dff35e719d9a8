"""The gRPC transports' footprint: the sidecar's resident memory with SIDECAR_TRANSPORT=grpc and
=openengine beside the same sidecar over HTTP, in one run: against one fake vLLM that serves both
its HTTP API and ``--grpc-port``, and a fake TensorRT-LLM serving the OpenEngine contract
(``--grpc-service openengine``; its canaries are TensorRT-LLM's, over HTTP for the baseline too).

Each sidecar (canaries on, ``DYN_CANARY_WAIT_TIME=0.001``) is started alone; its VmRSS is read
once it serves, once its first canary passed, and after ``--canaries`` (2,000) canaries. The
modules each one loaded are read from the running process (``/proc/PID/maps`` names the shared
objects: grpcio's ``cygrpc`` and protobuf's ``_message``). Figures are ratios measured side by
side on a shared machine, never assertions.

    .venv/bin/python -m bench.grpc_footprint [--canaries 2000] [--out docs/grpc-footprint.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench._shared import code_version, load_average, metric_sum, rss_mb
from bench._versions import DEFAULT_SCRATCH, scratch
from tests.support.harness import LOOPBACK, FakeEngine, Sidecar, running
from tests.support.processes import free_port

OUT = Path("docs/grpc-footprint.md")
SHARED_OBJECTS = {"grpcio": "cygrpc", "protobuf (upb)": "google/_upb/_message"}


def loaded(pid: int) -> dict[str, bool]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name: marker in maps for name, marker in SHARED_OBJECTS.items()}


def measure(env: dict[str, str], canaries: int) -> dict[str, Any]:
    side = Sidecar(env | {"DYN_CANARY_WAIT_TIME": "0.001", "SIDECAR_LOG_LEVEL": "WARNING"})
    with running(side):
        side.wait_serving()
        serving = rss_mb(side.proc.pid)
        side.wait_status(200, 15)
        ready = rss_mb(side.proc.pid)
        began = time.monotonic()
        sent = 0
        while sent < canaries:
            sent = int(metric_sum(side.metrics(), "health_sidecar_canary_total"))
            if time.monotonic() - began > 600:
                raise RuntimeError(f"only {sent} canaries in 600 s")
            time.sleep(0.1)
        took = time.monotonic() - began
        return {
            "serving_mb": round(serving, 1),
            "ready_mb": round(ready, 1),
            "after_mb": round(rss_mb(side.proc.pid), 1),
            "canaries": sent,
            "canaries_per_s": round(sent / took, 1),
            "loaded": loaded(side.proc.pid),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    args = parser.parse_args(argv)
    with scratch(args.scratch, "grpc-footprint"):  # logs and TMPDIR: nothing lands in /tmp
        return run(args, argv)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    port, openengine_port = free_port(), free_port()
    engine = FakeEngine("vllm", "aggregated", "--grpc-port", str(port))
    trtllm = FakeEngine(
        "trtllm", "aggregated", "--grpc-port", str(openengine_port), "--grpc-service", "openengine"
    )
    on = {"DYN_HEALTH_CHECK_ENABLED": "true"}
    with running(engine), running(trtllm):
        engine.start()
        trtllm.start()
        vllm = on | {"SIDECAR_BACKEND": "vllm"}
        http = measure(vllm | {"SIDECAR_ENGINE_URL": engine.url}, args.canaries)
        grpc = measure(
            vllm | {"SIDECAR_TRANSPORT": "grpc", "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{port}"},
            args.canaries,
        )
        trt = on | {"SIDECAR_BACKEND": "trtllm"}
        trt_http = measure(trt | {"SIDECAR_ENGINE_URL": trtllm.url}, args.canaries)
        openengine = measure(
            trt
            | {
                "SIDECAR_TRANSPORT": "openengine",
                "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{openengine_port}",
            },
            args.canaries,
        )
    command = " ".join(["python -m bench.grpc_footprint", *map(shlex.quote, argv or sys.argv[1:])])
    rows = [
        ("RSS once serving (MB)", "serving_mb"),
        ("RSS after the first passed canary (MB)", "ready_mb"),
        (f"RSS after {args.canaries:,} canaries (MB)", "after_mb"),
        ("canaries per second (DYN_CANARY_WAIT_TIME=0.001)", "canaries_per_s"),
    ]
    lines = [
        "# The gRPC transports' footprint",
        "",
        f"Written by `{command}` on {datetime.date.today()} ({platform.machine()}, "
        f"Python {platform.python_version()}, load average {load_average()}, code "
        f"{code_version()}). A fake vLLM serving HTTP and gRPC, and a fake TensorRT-LLM serving "
        "HTTP and the OpenEngine contract; each sidecar alone, canaries on, one after the other.",
        "",
        "| | vLLM over HTTP | over gRPC | gRPC / HTTP | TensorRT-LLM over HTTP | over OpenEngine "
        "| OpenEngine / HTTP |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, key in rows:
        cells = [label]
        for base, other in ((http, grpc), (trt_http, openengine)):
            ratio = other[key] / base[key] if base[key] else float("nan")
            cells += [str(base[key]), str(other[key]), f"{ratio:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for name in SHARED_OBJECTS:
        said = [
            "loaded" if side["loaded"][name] else "not loaded"
            for side in (http, grpc, trt_http, openengine)
        ]
        lines.append(f"| {name} | {said[0]} | {said[1]} | | {said[2]} | {said[3]} | |")
    lines += [
        "",
        "grpcio, protobuf and the engines' stubs (or the OpenEngine declarations) are imported "
        "only with SIDECAR_TRANSPORT=grpc or =openengine (or SIDECAR_GRPC_PORT, a grpc:// "
        "registration): `tests/test_footprint.py`.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
