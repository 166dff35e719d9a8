"""The sidecar's resident memory by configuration, side by side in one run, beside the bare app.

Each subject is a ``python -m sidecar`` process (or the bare app, ``bench/bare_app.py``: FastAPI
and uvicorn as the sidecar serves them, the floor):

- ``http``: the default HTTP transport against the fake vLLM engine;
- ``http+grpc``: the same with ``SIDECAR_GRPC_PORT`` set (the gRPC health service);
- ``dynamo``: ``SIDECAR_TRANSPORT=dynamo`` against a fake Dynamo worker (``fakeengine/dynamo.py``
  on the real runtime, as ``bench/dynamo_footprint.py`` sets it up);
- with ``--before REV``, ``http`` and ``http+grpc`` again from the code at ``REV`` (a git worktree
  run with this venv, ``bench/_versions.py``);
- ``bare``: the bare app.

Every round starts the subjects one after another (the order rotating from round to round),
reads each one's VmRSS at its first answer on ``/health`` (any status), waits for each
sidecar's first 200, then loads them all at once: canaries as fast as the schedule allows
(``DYN_CANARY_WAIT_TIME=0.01`` against an instant engine, canaries on and every other setting
its default) until every sidecar has sent ``--canaries`` since its first 200 (RSS sampled every
``--every``), then ``--requests`` ``GET /health`` on one keep-alive connection to each subject in
turn (the bare app too). Then VmRSS, threads, and whether grpcio's ``cygrpc`` and Dynamo's
runtime (``_core.abi3.so``) are mapped into the process (``/proc/PID/maps``). Ratios are to the
bare app of the same round.

The run enters a private network namespace (Dynamo's event plane listens on 0.0.0.0;
``tests/support/netns.py``; needs root) and writes only under ``--scratch``, removed at the end.

    .venv/bin/python -m bench.config_memory --before 17c7e1a          # about 10 minutes
    .venv/bin/python -m bench.config_memory --rounds 1 --canaries 200 --requests 200 --no-doc
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._shared import (
    BareApp,
    cpu_model,
    load_average,
    metric_sum,
    rss_mb,
    wait_for_quiet_machine,
)
from bench._versions import (
    CHECKOUT,
    DEFAULT_SCRATCH,
    Version,
    VersionedSidecar,
    scratch,
    short,
    versions,
)
from bench.dynamo_canary import code_line, code_state
from tests.support.dynamo_worker import FakeDynamoWorker, dynamo_env
from tests.support.harness import ROOT, FakeEngine, base_env, free_port, wait_until
from tests.support.netns import private_network, unavailable

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- config-memory:begin -->", "<!-- config-memory:end -->"
CANARY_ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "0.01",
    "SIDECAR_BACKEND": "vllm",
    "SIDECAR_LOG_LEVEL": "WARNING",
}
COUNT_EVERY = 2.0  # seconds between two reads of each sidecar's canary count
PHASE_CAP = 900.0  # seconds for the canary phase at most
BARE = "bare"


def now() -> float:
    return time.monotonic()


@dataclass
class Subject:
    key: str  # e.g. "http/after"
    config: str  # http, http+grpc, dynamo, bare
    version: str  # after, before, or "" for the bare app
    revision: str
    process: Any = None  # VersionedSidecar or BareApp
    grpc_port: int | None = None
    first_answer_s: float | None = None
    rss_first: float | None = None
    threads_first: int | None = None
    canaries_at_200: int = 0
    samples: list[dict[str, float]] = field(default_factory=list)
    rss_after: float | None = None
    threads_after: int | None = None
    canaries_total: int = 0
    grpc_mapped: bool | None = None
    dynamo_mapped: bool | None = None
    grpc_serving: str | None = None

    @property
    def pid(self) -> int:
        return self.process.proc.pid if self.config != BARE else self.process.pid

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def is_sidecar(self) -> bool:
        return self.config != BARE

    def canaries(self) -> int:
        text = self.process.get("/metrics").text
        return int(metric_sum(text, "health_sidecar_canary_total", endpoint="generate"))

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "process"}
        return out


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def mapped(pid: int) -> tuple[bool, bool]:
    """Whether grpcio's cygrpc and Dynamo's runtime extension are mapped into ``pid``."""
    text = Path(f"/proc/{pid}/maps").read_text()
    grpc = "cygrpc" in text
    dynamo = any("_core.abi3.so" in line and "dynamo" in line for line in text.splitlines())
    return grpc, dynamo


def grpc_check(port: int) -> str:
    """One grpc.health.v1 Check of the readiness service: its status's name, or the error's."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


# --- the subjects --------------------------------------------------------------------------------
def subjects_for(trees: list[Version]) -> list[Subject]:
    """After: http, http+grpc, dynamo; before (if any): http, http+grpc; the bare app."""
    found = []
    for version in reversed(trees):  # after first
        after = version.label == "after"
        configs = ("http", "http+grpc", "dynamo") if after else ("http", "http+grpc")
        for config in configs:
            key = f"{config}/{version.label}"
            found.append(Subject(key, config, version.label, version.revision))
    found.append(Subject(BARE, BARE, "", ""))
    return found


def sidecar_env(subject: Subject, engine: FakeEngine, worker: FakeDynamoWorker) -> dict[str, str]:
    if subject.config == "dynamo":
        return (
            dynamo_env(worker.kv_dir)
            | CANARY_ENV
            | {
                "SIDECAR_TRANSPORT": "dynamo",
                "SIDECAR_ENGINE_URL": worker.system_url,
                "DYN_DISCOVERY_BACKEND": "file",
                "SIDECAR_DISAGGREGATION_MODE": worker.mode,
            }
        )
    env = CANARY_ENV | {"SIDECAR_TRANSPORT": "http", "SIDECAR_ENGINE_URL": engine.url}
    if subject.config == "http+grpc":
        assert subject.grpc_port is not None
        env["SIDECAR_GRPC_PORT"] = str(subject.grpc_port)
    return env


def start(
    subject: Subject, trees: dict[str, Version], engine: FakeEngine, worker: FakeDynamoWorker
) -> None:
    """Start one subject and read its RSS at its first answer on /health."""
    began = now()
    if subject.is_sidecar:
        if subject.config == "http+grpc":
            subject.grpc_port = free_port()
        env = sidecar_env(subject, engine, worker)
        subject.process = VersionedSidecar(
            trees[subject.version], env, f"sidecar-{subject.key.replace('/', '-')}"
        )
        popen = subject.process.proc.popen
    else:
        subject.process = BareApp()
        popen = subject.process.proc.popen
    with httpx.Client(timeout=0.5, trust_env=False) as client:
        while True:
            try:
                client.get(f"{subject.url}/health")
            except httpx.HTTPError:
                if popen.poll() is not None:
                    raise RuntimeError(f"{subject.key} exited") from None
                if now() - began > 30:
                    raise RuntimeError(f"{subject.key}: no answer within 30 s") from None
                time.sleep(0.005)
                continue
            break
    subject.first_answer_s = round(now() - began, 3)
    subject.rss_first = round(rss_mb(subject.pid), 2)
    subject.threads_first = threads(subject.pid)


def canary_phase(sidecars: list[Subject], canaries: int, every: int) -> float:
    """Until every sidecar has sent ``canaries`` since its first 200; RSS every ``every``."""
    for s in sidecars:
        wait_until(lambda s=s: s.process.get("/health").status_code == 200, 60, what=f"{s.key} 200")
        s.canaries_at_200 = s.canaries()
        s.samples.append({"canaries": 0, "rss_mb": round(rss_mb(s.pid), 2)})
    began = now()
    pending = {s.key: s for s in sidecars}
    while pending:
        for s in list(pending.values()):
            sent = s.canaries() - s.canaries_at_200
            if sent >= s.samples[-1]["canaries"] + every or sent >= canaries:
                s.samples.append({"canaries": sent, "rss_mb": round(rss_mb(s.pid), 2)})
            if sent >= canaries:
                del pending[s.key]
        if now() - began > PHASE_CAP:
            raise RuntimeError(f"fewer than {canaries} canaries in {PHASE_CAP:g} s: {pending}")
        if pending:
            time.sleep(COUNT_EVERY)
    return now() - began


def request_phase(subjects: list[Subject], requests: int) -> None:
    for s in subjects:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for _ in range(requests):
                client.get(f"{s.url}/health")


def finish(subjects: list[Subject]) -> None:
    for s in subjects:  # all read at the same moment, before anything else is asked of them
        s.rss_after = round(rss_mb(s.pid), 2)
        s.threads_after = threads(s.pid)
        s.grpc_mapped, s.dynamo_mapped = mapped(s.pid)
    for s in subjects:
        if s.is_sidecar:
            s.canaries_total = s.canaries()
        if s.grpc_port is not None:
            s.grpc_serving = grpc_check(s.grpc_port)


def one_round(
    index: int,
    trees: dict[str, Version],
    engine: FakeEngine,
    worker: FakeDynamoWorker,
    args: argparse.Namespace,
) -> dict[str, Any]:
    subjects = subjects_for(list(trees.values()))
    shift = index % len(subjects)
    order = subjects[shift:] + subjects[:shift]
    try:
        for s in order:
            start(s, trees, engine, worker)
            print(f"round {index + 1}: {s.key} first answer, {s.rss_first} MiB", file=sys.stderr)
        sidecars = [s for s in subjects if s.is_sidecar]
        took = canary_phase(sidecars, args.canaries, args.every)
        print(f"round {index + 1}: canaries done in {took:.0f} s", file=sys.stderr)
        request_phase(order, args.requests)
        finish(subjects)
    finally:
        for s in subjects:
            if s.process is not None:
                s.process.close()
    for s in subjects:
        print(f"round {index + 1}: {s.key}: {s.rss_first} -> {s.rss_after} MiB", file=sys.stderr)
    return {
        "order": [s.key for s in order],
        "canary_phase_s": round(took, 1),
        "subjects": [s.as_dict() for s in subjects],
    }


# --- the report ----------------------------------------------------------------------------------
TITLES = {
    "http": "(a) HTTP transport (default)",
    "http+grpc": "(b) HTTP transport, `SIDECAR_GRPC_PORT` set",
    "dynamo": "(c) `SIDECAR_TRANSPORT=dynamo`",
    BARE: "(d) bare app",
}


def cell(values: Sequence[float], digits: int = 1) -> str:
    if not values:
        return "—"
    middle = statistics.median(values)
    text = f"{middle:.{digits}f}"
    if f"{min(values):.{digits}f}" != f"{max(values):.{digits}f}":
        text += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return text


def by_key(rounds: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        for s in r["subjects"]:
            found.setdefault(s["key"], []).append(s)
    return found


def ratios(rounds: list[dict[str, Any]], key: str, field_name: str, base: str) -> list[float]:
    out = []
    for r in rounds:
        subjects = {s["key"]: s for s in r["subjects"]}
        if key in subjects and base in subjects:
            out.append(subjects[key][field_name] / subjects[base][field_name])
    return out


def yes_no(values: list[bool | None]) -> str:
    seen = {v for v in values if v is not None}
    if seen == {True}:
        return "yes"
    if seen == {False}:
        return "no"
    return "mixed"


def table(rounds: list[dict[str, Any]], trees: list[Version]) -> str:
    revisions = {v.label: v.revision for v in trees}
    lines = [
        "| configuration | code | RSS at the first answer (MiB) | ÷ bare app | RSS after the "
        "load (MiB) | ÷ bare app | grpcio mapped | Dynamo runtime mapped | threads after | "
        "canaries (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keyed = by_key(rounds)
    for key, found in keyed.items():
        s0 = found[0]
        code = f"{s0['version']} `{revisions[s0['version']]}`" if s0["version"] else "—"
        first = [s["rss_first"] for s in found]
        after = [s["rss_after"] for s in found]
        canaries = [s["canaries_total"] - s["canaries_at_200"] for s in found]
        lines.append(
            f"| {TITLES[s0['config']]} | {code} | {cell(first)} | "
            f"**{cell(ratios(rounds, key, 'rss_first', BARE), 2)}** | {cell(after)} | "
            f"**{cell(ratios(rounds, key, 'rss_after', BARE), 2)}** | "
            f"{yes_no([s['grpc_mapped'] for s in found])} | "
            f"{yes_no([s['dynamo_mapped'] for s in found])} | "
            f"{cell([s['threads_after'] for s in found], 0)} | "
            f"{statistics.median(canaries):.0f} |"
            if s0["config"] != BARE
            else f"| {TITLES[BARE]} | — | {cell(first)} | 1 | {cell(after)} | 1 | "
            f"{yes_no([s['grpc_mapped'] for s in found])} | "
            f"{yes_no([s['dynamo_mapped'] for s in found])} | "
            f"{cell([s['threads_after'] for s in found], 0)} | — |"
        )
    return "\n".join(lines)


def before_after(rounds: list[dict[str, Any]]) -> str:
    keyed = by_key(rounds)
    lines = []
    for config in ("http", "http+grpc"):
        before, after = f"{config}/before", f"{config}/after"
        if before not in keyed or after not in keyed:
            continue
        first = ratios(rounds, after, "rss_first", before)
        last = ratios(rounds, after, "rss_after", before)
        lines.append(
            f"| {TITLES[config]} | {cell([s['rss_after'] for s in keyed[before]])} | "
            f"{cell([s['rss_after'] for s in keyed[after]])} | {cell(first, 2)} | "
            f"**{cell(last, 2)}** |"
        )
    if not lines:
        return ""
    head = [
        "| configuration | before, after the load (MiB) | after, after the load (MiB) | "
        "after ÷ before, first answer | after ÷ before, after the load |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + lines)


def growth(rounds: list[dict[str, Any]]) -> str:
    cells = []
    for key, found in by_key(rounds).items():
        if key == BARE:
            continue
        grew = [
            s["samples"][-1]["rss_mb"] - s["samples"][1]["rss_mb"]
            for s in found
            if len(s["samples"]) > 2
        ]
        if grew:
            cells.append(f"{key} {cell(grew, 2)}")
    return "; ".join(cells)


def document(result: dict[str, Any], trees: list[Version], command: str) -> str:
    rounds = result["rounds"]
    args = result["args"]
    codes = "; ".join(
        f"{v.label} = `{v.revision}`" + (" (a git worktree, run with this venv)" if v.tree else "")
        for v in trees
    )
    parts = [
        "```bash",
        command,
        "```",
        "",
        f"Run of {result['started']}, {result['took_min']:.0f} min; {result['machine']}; shared "
        f"with other engineers' tests ({result['quiet']}; load average {result['loads'][0]} at the "
        "start, "
        f"{result['loads'][1]} at the end); code: {codes}; the checkout: {result['code']}; "
        f"{'in a private network namespace' if result['isolated'] else 'no private namespace'}.",
        "",
        f"{len(rounds)} rounds; in each, every sidecar sent at least {args['canaries']} canaries "
        f"after its first 200 (all at once, as fast as `DYN_CANARY_WAIT_TIME=0.01` allows), then "
        f"each subject served {args['requests']} `GET /health` in turn. Medians over the rounds "
        "(range); ratios per round, to that round's bare app.",
        "",
        table(rounds, trees),
    ]
    compared = before_after(rounds)
    if compared:
        parts += ["", "Before and after, side by side in the same rounds:", "", compared]
    parts += [
        "",
        f"RSS growth from the first {args['every']} canaries to the end of the canary phase "
        f"(MiB): {growth(rounds)}. Canary phase: "
        + ", ".join(f"{r['canary_phase_s']:.0f} s" for r in rounds)
        + ". gRPC Check of `readiness` after the load: "
        + ", ".join(
            f"{s['key']} {s['grpc_serving']}"
            for r in rounds[:1]
            for s in r["subjects"]
            if s["grpc_port"] is not None
        )
        + ".",
    ]
    return "\n".join(parts)


def write_doc(block: str) -> None:
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = f"{head}{BEGIN}\n{block}\n{END}{tail}"
    else:
        text = text.rstrip("\n") + f"\n\n## Memory by configuration\n\n{BEGIN}\n{block}\n{END}\n"
    DOC.write_text(text)


# --- main ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def engines(where: Path) -> Iterator[tuple[FakeEngine, FakeDynamoWorker]]:
    kv_dir = where / "dynamo-kv"
    kv_dir.mkdir()
    engine = FakeEngine("vllm")
    worker = FakeDynamoWorker("vllm", kv_dir=kv_dir)
    try:
        engine.start()
        worker.start()
        yield engine, worker
    finally:
        worker.close()
        engine.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.config_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--before", help="also measure http and http+grpc at this revision")
    parser.add_argument(
        "--after",
        default="HEAD",
        help=f"the revision measured (a worktree; default HEAD), or {CHECKOUT!r}",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--canaries", type=int, default=2000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--no-wait", action="store_true", help="don't wait for other benchmarks")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--no-doc", action="store_true", help=f"do not rewrite {DOC.name}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench.config_memory: {why} (the dynamo subject needs it)")
    after = args.after if args.after == CHECKOUT else short(args.after)
    shown = [f"--rounds={args.rounds}", f"--canaries={args.canaries}"]
    shown += [f"--requests={args.requests}", f"--after={after}"]
    if args.before:
        shown.append(f"--before={short(args.before)}")
    command = ".venv/bin/python -m bench.config_memory " + shlex.join(shown)
    quiet = wait_for_quiet_machine(skip=args.no_wait)
    print(f"machine: {quiet}", file=sys.stderr)
    started = datetime.datetime.now(datetime.UTC)
    clock, load_before, code_before = now(), load_average(), code_state()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rounds = []
    with (
        scratch(args.scratch, "config-memory", keep=args.keep) as where,
        versions(args.before, args.after, where) as trees,
    ):
        for version in trees:
            print(f"{version.label}: {version.verify(base_env())}", file=sys.stderr)
        named = {v.label: v for v in trees}
        with private_network(), engines(where) as (engine, worker):
            for index in range(args.rounds):
                rounds.append(one_round(index, named, engine, worker, args))
    result = {
        "args": vars(args) | {"scratch": str(args.scratch), "json": str(args.json)},
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "took_min": (now() - clock) / 60,
        "machine": f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        "loads": [load_before, load_average()],
        "code": code_line(code_before, code_state()),
        "isolated": True,
        "quiet": quiet.split("; load average")[0],
        "rounds": rounds,
    }
    block = document(result, trees, command)
    print(block)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if not args.no_doc:
        write_doc(block)
        print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
