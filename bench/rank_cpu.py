"""Benchmark: the sidecar's CPU beside an engine with data-parallel ranks, two versions at once.

Two sidecars watch the same engine at the same time, with canaries on and ``SIDECAR_DP_RANKS=auto``
and every other setting at its default: one from ``--before`` (a git revision, checked out into a
temporary worktree and run from there with this venv), one from ``--after`` (HEAD). Once both
count the ranks and say 200, each one's CPU seconds (``utime + stime``) over the same
``--seconds`` window are divided by the wall time. The engines:

- ``vllm``: a real vLLM on this CPU with ``--data-parallel-size 2`` (``tests/support/vllm_engine``,
  prepared by ``scripts/prepare_engines.sh``);
- ``fake``: the fake vLLM engine with ``--dp-size 8`` (``python -m fakeengine``), to show how the
  cost grows with the rank count.

Writes docs/rank-cpu.md (``--out``) with the command that reproduces it:

    .venv/bin/python -m bench.rank_cpu --before 4dca140 --after 5231de5   # about 10 minutes
    .venv/bin/python -m bench.rank_cpu --before 4dca140 --engines fake --seconds 10 --reps 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from bench._shared import cpu_seconds, load_average
from tests.support.harness import LOOPBACK, ROOT, FakeEngine, base_env, free_port, wait_until
from tests.support.vllm_engine import aggregated_vllm

FAKE_RANKS = 8


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="rank-cpu-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(where), revision],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, capture_output=True
        )


class Sidecar:
    """``python -m sidecar`` run from ``tree`` (so that its code is the one imported)."""

    def __init__(self, tree: Path, engine_url: str, label: str) -> None:
        self.label = label
        self.port = free_port()
        env = base_env() | {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": "vllm",
            "SIDECAR_ENGINE_URL": engine_url,
            "SIDECAR_DP_RANKS": "auto",
            "DYN_SYSTEM_HOST": LOOPBACK,
            "DYN_SYSTEM_PORT": str(self.port),
            "SIDECAR_LOG_LEVEL": "WARNING",
        }
        env.pop("PYTHONPATH", None)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "sidecar"],
            cwd=tree,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def ready_with_ranks(self) -> bool:
        assert self.popen.poll() is None, f"the {self.label} sidecar exited"
        try:
            answer = httpx.get(f"http://{LOOPBACK}:{self.port}/health", timeout=1, trust_env=False)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and "ranks" in answer.json()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def measure(trees: dict[str, Path], engine_url: str, seconds: float) -> dict[str, float]:
    """CPU % of a core per version, both sidecars running over the same window."""
    sidecars = [Sidecar(tree, engine_url, label) for label, tree in trees.items()]
    try:
        for side in sidecars:
            wait_until(side.ready_with_ranks, 120, interval=0.5, what=f"{side.label} ready")
        time.sleep(2.0)  # past the first reads after the ranks were counted
        start = {s.label: cpu_seconds(s.popen.pid) for s in sidecars}
        began = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - began
        return {s.label: 100 * (cpu_seconds(s.popen.pid) - start[s.label]) / wall for s in sidecars}
    finally:
        for side in sidecars:
            side.stop()


@contextlib.contextmanager
def engine(kind: str) -> Iterator[str]:
    if kind == "vllm":
        with aggregated_vllm("--data-parallel-size", "2", "--data-parallel-backend", "mp") as s:
            yield s.url
        return
    fake = FakeEngine("vllm", "aggregated", "--dp-size", str(FAKE_RANKS))
    fake.start()
    try:
        yield fake.url
    finally:
        fake.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rank_cpu")
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--after", default="HEAD", help="the git revision measured against it")
    parser.add_argument("--engines", default="vllm,fake", help="comma-separated: vllm, fake")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "rank-cpu.md")
    args = parser.parse_args(argv)

    def short(revision: str) -> str:
        done = subprocess.run(
            ["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True
        )
        return done.stdout.strip()

    # SIGTERM unwinds like Ctrl-C, so that the engine and the worktrees are ended and removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    revision, after = short(args.before), short(args.after)
    rows = []
    with worktree(revision) as tree, worktree(after) as later:
        trees = {"before": tree, "after": later}
        for kind in args.engines.split(","):
            ranks = 2 if kind == "vllm" else FAKE_RANKS
            with engine(kind) as url:
                for rep in range(args.reps):
                    got = measure(trees, url, args.seconds)
                    print(f"{kind} rep {rep + 1}: {got}", flush=True)
                    rows.append((kind, ranks, rep + 1, got["before"], got["after"]))
    lines = [
        "# The sidecar's CPU beside an engine with data-parallel ranks",
        "",
        "Generated by `bench/rank_cpu.py`; reproduce with:",
        "",
        "```",
        f".venv/bin/python -m bench.rank_cpu --before {revision} --after {after} "
        f"--engines {args.engines} "
        f"--seconds {args.seconds:g} --reps {args.reps}",
        "```",
        "",
        f"Two sidecars watch the same engine at the same time (`SIDECAR_DP_RANKS=auto`, canaries "
        f"on, defaults otherwise): before = `{revision}` (each rank read the engine's "
        f"registration route and `/metrics` itself), after = `{after}` (one read per engine, "
        f"fanned out to the ranks). CPU is utime + stime over a {args.seconds:g} s window, as a "
        f"percentage of one core; load average at the end: {load_average()}.",
        "",
        "| engine | ranks | rep | before | after | after / before |",
        "|---|---|---|---|---|---|",
    ]
    for kind, ranks, rep, before, after_cpu in rows:
        name = "real vLLM (`--data-parallel-size 2`)" if kind == "vllm" else "fake vLLM"
        ratio = after_cpu / before if before else float("nan")
        lines.append(
            f"| {name} | {ranks} | {rep} | {before:.2f} % | {after_cpu:.2f} % | {ratio:.2f} |"
        )
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
