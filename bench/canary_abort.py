"""Timed-out canaries on each real engine: how many it computes once it resumes.

    .venv/bin/python -m bench.canary_abort [--count 5] [--only ENGINE ...] [--out F] [--json F]

For each engine (llama-server, vLLM, SGLang, the Dynamo mocker, dynamo.vllm; prepared by
``scripts/prepare_engines.sh``), one at a time on the shared machine and each ended by its
process group: freeze what computes (SIGSTOP: llama-server whole, vLLM's EngineCore, SGLang's
scheduler, the mocker whole, dynamo.vllm's EngineCore), let ``--count`` canaries time out, stop
the client, resume the engine (SIGCONT) and read the engine's own counters once they stand still
(``tests/support/abandoned.py``, which also builds each engine). Two clients where the engine
has a client of its own:

- a closing client: plain HTTP canaries (the sidecar's own body) with a 1 s deadline, the
  connection closed on it, nothing else: what any prober that only closes does; for dynamo.vllm
  a Dynamo runtime client whose canaries (Dynamo's own vllm payload) drop their stream on the
  deadline, with no ``stop_generating()``, the client alive until the counters are read (as
  Dynamo's own in-process canary gives up);
- the sidecar, started as users start it (canaries on, wait 1 s, timeout 0.5 s), which stops
  each timed-out canary the backend's way (docs/concepts/backends.md).

The script enters a private network namespace first (SGLang and Dynamo listen on 0.0.0.0:
``tests/support/netns.py``; needs root). It writes its section of
``docs/fault-benchmark-abort.md`` (between markers) unless ``--only`` is given without
``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from bench._shared import code_version, load_average
from tests.support.abandoned import (
    Engine,
    Figures,
    by_closing_client,
    by_sidecar,
    dynamo_vllm_engine,
    llama_engine,
    mocker_engine,
    sglang_engine,
    vllm_engine,
)
from tests.support.dynamo_vllm import DynamoVllmWorker
from tests.support.engines import LlamaServer, MockerWorker
from tests.support.harness import ROOT, Sidecar
from tests.support.netns import private_network, unavailable
from tests.support.sglang_engine import SglangServer
from tests.support.vllm_engine import VllmServer

DEFAULT_OUT = ROOT / "docs" / "fault-benchmark-abort.md"
BEGIN, END = "<!-- canary-abort:begin -->", "<!-- canary-abort:end -->"
ENGINES = ("llama-server", "vllm", "sglang", "dynamo-mocker", "dynamo-vllm")
FAST = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5"}


def start_sidecar(env: dict[str, str]) -> Sidecar:
    return Sidecar(FAST | env).wait_serving()


@contextlib.contextmanager
def llama() -> Iterator[Engine]:
    server = LlamaServer("TINY_GGUF").start()
    try:
        yield llama_engine(server)
    finally:
        server.close()


@contextlib.contextmanager
def vllm() -> Iterator[Engine]:
    server = VllmServer().start()
    try:
        yield vllm_engine(server)
    finally:
        server.stop()


@contextlib.contextmanager
def sglang() -> Iterator[Engine]:
    server = SglangServer().start()
    try:
        yield sglang_engine(server)
    finally:
        server.close()


@contextlib.contextmanager
def mocker() -> Iterator[Engine]:
    worker = MockerWorker(tempfile.mkdtemp(prefix="bench-abort-dynamo-")).start()
    try:
        yield mocker_engine(worker)
    finally:
        worker.close()


@contextlib.contextmanager
def dynamo_vllm() -> Iterator[Engine]:
    worker = DynamoVllmWorker(kv_dir=tempfile.mkdtemp(prefix="bench-abort-dynamo-vllm-"))
    try:
        worker.start()
        yield dynamo_vllm_engine(worker)
    finally:
        worker.close()


STARTERS: dict[str, Callable[[], contextlib.AbstractContextManager[Engine]]] = {
    "llama-server": llama,
    "vllm": vllm,
    "sglang": sglang,
    "dynamo-mocker": mocker,
    "dynamo-vllm": dynamo_vllm,
}
FROZEN = {
    "llama-server": "the whole server",
    "vllm": "`VLLM::EngineCore`",
    "sglang": "`sglang::scheduler`",
    "dynamo-mocker": "the whole worker",
    "dynamo-vllm": "`VLLM::EngineCore`",
}
COUNTERS = {
    "llama-server": "`llamacpp:tokens_predicted_total` (1 per canary); no abort counter",
    "vllm": "`vllm:request_success_total` (every `finished_reason`; an aborted request is in "
    "none, `abort` included)",
    "sglang": "`sglang:num_requests_total`, aborted: `sglang:num_aborted_requests_total`",
    "dynamo-mocker": "requests reaching the worker: `dynamo_component_requests_total`, "
    "cancelled: `dynamo_component_cancellation_total` (its simulated engine counts no tokens)",
    "dynamo-vllm": "vLLM's own `vllm:request_success_total` (every `finished_reason`), as the "
    "worker's system server re-exports it with `vllm:generation_tokens_total`; aborted: the "
    "cancellations the worker received, `dynamo_component_cancellation_total`; the closing "
    "client drops its stream without `stop_generating()` and stays alive",
}


def run(names: list[str], count: int) -> list[tuple[str, Figures]]:
    found: list[tuple[str, Figures]] = []
    for name in names:
        print(f"{name}: starting", file=sys.stderr)
        with STARTERS[name]() as engine:
            if engine.closable:
                found.append((name, by_closing_client(engine, count)))
                print(f"  {found[-1][1].row()}", file=sys.stderr)
            side = None
            try:

                def started(env: dict[str, str]) -> Sidecar:
                    nonlocal side
                    side = start_sidecar(env)
                    return side

                found.append((name, by_sidecar(engine, started, count)))
                print(f"  {found[-1][1].row()}", file=sys.stderr)
            finally:
                if side is not None:
                    side.close()
    return found


TABLE_HEAD = [
    "| engine | frozen | client | canaries timed out | computed after SIGCONT | aborted "
    "(engine's count) |",
    "|---|---|---|---|---|---|",
]
ALONE = "Measured alone since (`--only ... --merge`), each replacing its engine's rows:"


def command(count: int, only: list[str] | None = None) -> str:
    line = ".venv/bin/python -m bench.canary_abort" + (f" --count {count}" if count != 5 else "")
    return line + (f" --only {' '.join(only)} --merge" if only else "")


def provenance(count: int, note: str, only: list[str] | None = None) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command(count, only)}` ({when}; {note})"


def rows(figures: list[tuple[str, Figures]]) -> list[str]:
    found = []
    for key, f in figures:
        aborted = "not counted" if f.aborted is None else str(f.aborted)
        found.append(
            f"| {f.engine} | {FROZEN[key]} | {f.client} | {f.timed_out} | {f.computed} | "
            f"{aborted} |"
        )
    return found


def render(head: str, table: list[str], counters: list[str], alone: list[str]) -> str:
    lines = [head, "", *TABLE_HEAD, *table, "", "Counters read:", "", *counters]
    if alone:
        lines += ["", ALONE, "", *alone]
    return "\n".join(lines) + "\n"


def markdown(figures: list[tuple[str, Figures]], names: list[str], count: int, note: str) -> str:
    counters = [f"- {name}: {COUNTERS[name]}" for name in names]
    return render(provenance(count, note), rows(figures), counters, [])


def merged(
    old: str, figures: list[tuple[str, Figures]], names: list[str], count: int, note: str
) -> str:
    """The section ``old`` with the rows and counters of ``names`` replaced by ``figures``, and
    a line saying when and how they were measured alone."""
    lines = old.splitlines()
    head = lines[0] if lines else provenance(count, note)
    table = [line for line in lines if line.startswith("| ") and line not in TABLE_HEAD[:1]]
    counters = [line for line in lines if line.startswith("- ") and ": " in line]
    alone_from = lines.index(ALONE) if ALONE in lines else len(lines)
    alone = [line for line in lines[alone_from:] if line.startswith("- ")]
    counters = [line for line in counters if line not in alone]
    engines = {f.engine for _, f in figures}
    table = [line for line in table if line.split(" | ")[0][2:] not in engines] + rows(figures)
    order = {name: i for i, name in enumerate(ENGINES)}

    def key(line: str) -> int:
        return order.get(line[2:].partition(":")[0], len(order))

    mine = {f"- {name}:" for name in names}
    counters = [line for line in counters if line.partition(" ")[2].partition(":")[0] not in names]
    counters = sorted(counters + [f"- {name}: {COUNTERS[name]}" for name in names], key=key)
    alone = [line for line in alone if not any(line.startswith(m) for m in mine)]
    alone += [f"- {name}: {provenance(count, note, names)}" for name in names]
    return render(head, table, counters, sorted(alone, key=key))


def section_of(path: Path) -> str:
    """The text between the markers of ``path`` (empty when there is none)."""
    text = path.read_text() if path.exists() else ""
    return text.partition(BEGIN)[2].partition(END)[0].strip("\n")


def write(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_abort")
    parser.add_argument("--count", type=int, default=5, help="canaries timed out per run")
    parser.add_argument("--only", nargs="+", choices=ENGINES, help="these engines alone")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: replace those engines' rows in the page (or --out), keep the others",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.merge and not args.only:
        parser.error("--merge needs --only")
    why = unavailable()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    names = list(args.only or ENGINES)
    note = f"load average {load_average()} at the start; code {code_version()}"
    with private_network():
        figures = run(names, args.count)
    out = args.out or (None if args.only and not args.merge else DEFAULT_OUT)
    if args.merge:
        section = merged(section_of(out), figures, names, args.count, note)
    else:
        section = markdown(figures, names, args.count, note)
    print(section)
    if args.json is not None:
        args.json.write_text(json.dumps([f.row() for _, f in figures], indent=2))
    if out is not None:
        write(out, section)
        print(f"wrote {shlex.quote(str(out))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
