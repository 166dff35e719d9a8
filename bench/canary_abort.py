"""Timed-out canaries on each real engine: how many it computes once it resumes.

    .venv/bin/python -m bench.canary_abort [--count 5] [--only ENGINE ...] [--out F] [--json F]

For each engine (llama-server, vLLM, SGLang, the Dynamo mocker; prepared by
``scripts/prepare_engines.sh``), one at a time on the shared machine and each ended by its
process group: freeze what computes (SIGSTOP: llama-server whole, vLLM's EngineCore, SGLang's
scheduler, the mocker whole), let ``--count`` canaries time out, stop the client, resume the
engine (SIGCONT) and read the engine's own counters once they stand still
(``tests/support/abandoned.py``). Two clients where the engine has an HTTP API:

- a closing client: plain HTTP canaries (the sidecar's own body) with a 1 s deadline, the
  connection closed on it, nothing else: what any prober that only closes does;
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
from sidecar.probes.base import PROMPT_TOKEN_IDS
from tests.support.abandoned import (
    SGLANG_NOTICE,
    Engine,
    Figures,
    by_closing_client,
    by_sidecar,
    prometheus_reader,
)
from tests.support.dynamo_worker import sidecar_env as dynamo_sidecar_env
from tests.support.engines import LlamaServer, MockerWorker
from tests.support.harness import ROOT, Sidecar
from tests.support.netns import private_network, unavailable
from tests.support.sglang_engine import SglangServer, sglang_env
from tests.support.vllm_engine import VllmServer, pause, resume

DEFAULT_OUT = ROOT / "docs" / "fault-benchmark-abort.md"
BEGIN, END = "<!-- canary-abort:begin -->", "<!-- canary-abort:end -->"
ENGINES = ("llama-server", "vllm", "sglang", "dynamo-mocker")
FAST = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5"}


def start_sidecar(env: dict[str, str]) -> Sidecar:
    return Sidecar(FAST | env).wait_serving()


@contextlib.contextmanager
def llama() -> Iterator[Engine]:
    server = LlamaServer("TINY_GGUF").start()
    try:
        yield Engine(
            name="llama-server",
            url=server.url,
            sidecar_env={
                "DYN_HEALTH_CHECK_ENABLED": "true",
                "SIDECAR_BACKEND": "openai",
                "SIDECAR_ENGINE_URL": server.url,
            },
            freeze=server.freeze,
            thaw=server.thaw,
            read=prometheus_reader(
                f"{server.url}/metrics",
                {"tokens_predicted": ("llamacpp:tokens_predicted_total", {})},
            ),
            computed_keys=("tokens_predicted",),
            aborted_key=None,
            plain=lambda i: (
                "/v1/completions",
                {"prompt": "Say OK.", "max_tokens": 1, "temperature": 0, "stream": False},
            ),
        )
    finally:
        server.close()


@contextlib.contextmanager
def vllm() -> Iterator[Engine]:
    server = VllmServer().start()
    pid: list[int] = []

    def freeze() -> None:
        pid[:] = [server.engine_core_pid()]
        pause(pid[0])

    try:
        yield Engine(
            name="vLLM",
            url=server.url,
            sidecar_env={
                "DYN_HEALTH_CHECK_ENABLED": "true",
                "SIDECAR_BACKEND": "vllm",
                "SIDECAR_ENGINE_URL": server.url,
            },
            freeze=freeze,
            thaw=lambda: resume(pid[0]),
            read=prometheus_reader(
                f"{server.url}/metrics",
                {
                    "finished": ("vllm:request_success_total", {}),
                    "finished_abort": ("vllm:request_success_total", {"finished_reason": "abort"}),
                    "generation_tokens": ("vllm:generation_tokens_total", {}),
                },
            ),
            computed_keys=("finished",),
            aborted_key="finished_abort",
            plain=lambda i: (
                "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": list(PROMPT_TOKEN_IDS),
                    "max_tokens": 1,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            ),
        )
    finally:
        server.stop()


@contextlib.contextmanager
def sglang() -> Iterator[Engine]:
    server = SglangServer().start()
    pid: list[int] = []

    def freeze() -> None:
        pid[:] = [server.scheduler_pids()[0]]
        server.freeze(pid[0])

    try:
        yield Engine(
            name="SGLang",
            url=server.url,
            sidecar_env=sglang_env(server),
            freeze=freeze,
            thaw=lambda: server.thaw(pid[0]),
            read=prometheus_reader(
                f"{server.url}/metrics",
                {
                    "requests": ("sglang:num_requests_total", {}),
                    "aborted": ("sglang:num_aborted_requests_total", {}),
                },
            ),
            computed_keys=("requests",),
            aborted_key="aborted",
            settle=SGLANG_NOTICE,
            plain=lambda i: (
                "/generate",
                {
                    "input_ids": list(PROMPT_TOKEN_IDS),
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
                    "rid": f"bench-{i}-{datetime.datetime.now().timestamp()}",
                },
            ),
        )
    finally:
        server.close()


@contextlib.contextmanager
def mocker() -> Iterator[Engine]:
    kv_dir = tempfile.mkdtemp(prefix="bench-abort-dynamo-")
    worker = MockerWorker(kv_dir).start()
    labels = {"dynamo_endpoint": "generate"}
    try:
        yield Engine(
            name="Dynamo mocker (request plane)",
            url=worker.system_url,
            sidecar_env=dynamo_sidecar_env(worker.system_url, kv_dir),
            freeze=worker.freeze,
            thaw=worker.thaw,
            read=prometheus_reader(
                f"{worker.system_url}/metrics",
                {
                    "requests": ("dynamo_component_requests_total", labels),
                    "cancelled": ("dynamo_component_cancellation_total", labels),
                },
            ),
            computed_keys=("requests",),
            aborted_key="cancelled",
        )
    finally:
        worker.close()


STARTERS: dict[str, Callable[[], contextlib.AbstractContextManager[Engine]]] = {
    "llama-server": llama,
    "vllm": vllm,
    "sglang": sglang,
    "dynamo-mocker": mocker,
}
FROZEN = {
    "llama-server": "the whole server",
    "vllm": "`VLLM::EngineCore`",
    "sglang": "`sglang::scheduler`",
    "dynamo-mocker": "the whole worker",
}
COUNTERS = {
    "llama-server": "`llamacpp:tokens_predicted_total` (1 per canary); no abort counter",
    "vllm": "`vllm:request_success_total` (every `finished_reason`; an aborted request is in "
    "none, `abort` included)",
    "sglang": "`sglang:num_requests_total`, aborted: `sglang:num_aborted_requests_total`",
    "dynamo-mocker": "requests reaching the worker: `dynamo_component_requests_total`, "
    "cancelled: `dynamo_component_cancellation_total` (its simulated engine counts no tokens)",
}


def run(names: list[str], count: int) -> list[tuple[str, Figures]]:
    found: list[tuple[str, Figures]] = []
    for name in names:
        print(f"{name}: starting", file=sys.stderr)
        with STARTERS[name]() as engine:
            if engine.plain is not None:
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


def markdown(figures: list[tuple[str, Figures]], names: list[str], count: int, note: str) -> str:
    command = ".venv/bin/python -m bench.canary_abort" + (f" --count {count}" if count != 5 else "")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"`{command}` ({when}; {note})",
        "",
        "| engine | frozen | client | canaries timed out | computed after SIGCONT | aborted "
        "(engine's count) |",
        "|---|---|---|---|---|---|",
    ]
    for key, f in figures:
        aborted = "not counted" if f.aborted is None else str(f.aborted)
        lines.append(
            f"| {f.engine} | {FROZEN[key]} | {f.client} | {f.timed_out} | {f.computed} | "
            f"{aborted} |"
        )
    lines += ["", "Counters read:", ""]
    lines += [f"- {name}: {COUNTERS[name]}" for name in names]
    return "\n".join(lines) + "\n"


def write(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_abort")
    parser.add_argument("--count", type=int, default=5, help="canaries timed out per run")
    parser.add_argument("--only", nargs="+", choices=ENGINES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    names = list(args.only or ENGINES)
    note = f"load average {load_average()} at the start; code {code_version()}"
    with private_network():
        figures = run(names, args.count)
    section = markdown(figures, names, args.count, note)
    print(section)
    if args.json is not None:
        args.json.write_text(json.dumps([f.row() for _, f in figures], indent=2))
    out = args.out or (None if args.only else DEFAULT_OUT)
    if out is not None:
        write(out, section)
        print(f"wrote {shlex.quote(str(out))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
