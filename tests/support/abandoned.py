"""What a real engine does with canaries whose client gave up, read from its own counters.

One run: the engine's computing process is frozen (SIGSTOP), canaries time out against it (sent
by the sidecar, started as users start it, or by a plain client that only gives up on the
deadline: an HTTP client that closes its connection, as the sidecar's engine client does, or a
Dynamo runtime client that drops its stream without ``stop_generating()``), the sidecar is
stopped (so that it sends nothing after the resume), the engine resumes (SIGCONT), and once its
counters stand still the difference says how many of those canaries it computed and, where it
counts them, aborted.

Each real engine's :class:`Engine` is built here, once (``llama_engine``, ``vllm_engine``,
``sglang_engine``, ``mocker_engine``, ``dynamo_vllm_engine``), for ``tests/test_canary_abort.py``
(the sidecar and, for dynamo.vllm, the dropping client, with assertions) and
``bench/canary_abort.py`` (both clients, as figures). Every process is started by the callers
through ``tests.support`` and ended by its process group; everything is on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import httpx

from sidecar.probes.base import PROMPT_TOKEN_IDS
from tests.support.dynamo_vllm import DynamoVllmWorker, dropping_canaries
from tests.support.dynamo_worker import sidecar_env as dynamo_sidecar_env
from tests.support.engines import LlamaServer, MockerWorker
from tests.support.harness import Sidecar, wait_until
from tests.support.sglang_engine import SglangServer, sglang_env
from tests.support.vllm_engine import VllmServer, pause, resume, samples, total

Counters = dict[str, float]
#: The sidecar's timings here: a canary times out after TIMEOUT, the next follows WAIT later.
WAIT, TIMEOUT = "1", "0.5"
#: The engine's counters must stand still this long after the resume to be read as final.
QUIET = 1.5
#: SGLang's tokenizer manager notices a closed connection at most this late (it wakes every 4 s):
#: a plain client's canaries are read after it.
SGLANG_NOTICE = 4.5


@dataclass(frozen=True)
class Engine:
    """One engine under test: how to freeze what computes, and how to read its counters."""

    name: str
    url: str  # SIDECAR_ENGINE_URL
    sidecar_env: dict[str, str]  # the sidecar's variables beside it (canaries on)
    freeze: Callable[[], None]
    thaw: Callable[[], None]
    read: Callable[[], Counters]  # the engine's own counters, by name
    computed_keys: tuple[str, ...]  # counters that move once per computed canary (summed)
    aborted_key: str | None  # the engine's counter of aborted requests, if it has one
    settle: float = 0.0  # extra seconds after the resume before counters are final
    # A plain client's canary: (path, body) sent with httpx; None where there is no HTTP API.
    plain: Callable[[int], tuple[str, dict[str, Any]]] | None = None
    # Where there is none: a client of its own that gives up on (count, deadline) canaries and
    # yields how many timed out, alive (connections open) until the block ends.
    dropping: Callable[[int, float], AbstractContextManager[int]] | None = None

    @property
    def closable(self) -> bool:
        """Whether a plain client (:func:`by_closing_client`) can be measured here."""
        return self.plain is not None or self.dropping is not None


@dataclass(frozen=True)
class Figures:
    engine: str
    client: str  # "sidecar" or "closing client"
    timed_out: int  # canaries that timed out while the engine was frozen
    computed: int  # of them, computed once it resumed (its own counters)
    aborted: int | None  # its own count of aborted requests (None: it counts none)
    before: Counters
    after: Counters
    note: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "client": self.client,
            "timed_out": self.timed_out,
            "computed": self.computed,
            "aborted": self.aborted,
            "before": self.before,
            "after": self.after,
            "note": self.note,
        }


def sidecar_timeouts(side: Sidecar) -> float:
    """The sidecar's count of canaries that timed out (any endpoint or rank)."""
    text = side.http.get(f"{side.url}/metrics", timeout=5).text
    return total(samples(text), "health_sidecar_canary_total", outcome="timeout")


def _settled(engine: Engine, timeout: float = 30.0) -> Counters:
    """The engine's counters once they stood still for QUIET seconds."""
    time.sleep(engine.settle)
    deadline = time.monotonic() + timeout
    last = engine.read()
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = engine.read()
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= QUIET:
            return now
    return last


def _figures(
    engine: Engine, client: str, timed_out: int, before: Counters, after: Counters, note: str
) -> Figures:
    computed = sum(after.get(k, 0) - before.get(k, 0) for k in engine.computed_keys)
    aborted = None
    if engine.aborted_key is not None:
        aborted = int(after.get(engine.aborted_key, 0) - before.get(engine.aborted_key, 0))
    return Figures(engine.name, client, timed_out, int(computed), aborted, before, after, note)


def by_sidecar(
    engine: Engine,
    start_sidecar: Callable[[dict[str, str]], Sidecar],
    count: int,
    *,
    ready_timeout: float = 30.0,
) -> Figures:
    """``count`` canaries timed out by the sidecar against the frozen engine, then the resume."""
    timings = {"DYN_CANARY_WAIT_TIME": WAIT, "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": TIMEOUT}
    side = start_sidecar(timings | engine.sidecar_env)
    side.wait_status(200, ready_timeout)
    start = sidecar_timeouts(side)
    before = engine.read()
    engine.freeze()
    try:
        got = wait_until(
            lambda: sidecar_timeouts(side) - start >= count and sidecar_timeouts(side),
            count * 5.0 + 10,
            interval=0.1,
            what=f"{count} canary timeouts against the frozen {engine.name}",
        )
        timed_out = int(got - start)
    finally:
        side.close()  # nothing more from the sidecar after the resume (its starter ends it too)
        engine.thaw()
    after = _settled(engine)
    return _figures(engine, "sidecar", timed_out, before, after, "")


@contextlib.contextmanager
def _closing_http(engine: Engine, count: int, timeout: float) -> Iterator[int]:
    """``count`` plain HTTP canaries, each connection closed on the deadline; all closed before
    the block."""
    assert engine.plain is not None
    timed_out = 0
    with httpx.Client(trust_env=False) as client:
        for index in range(count):
            path, body = engine.plain(index)
            try:
                client.post(f"{engine.url}{path}", json=body, timeout=timeout)
            except httpx.TimeoutException:
                timed_out += 1
    yield timed_out


def by_closing_client(engine: Engine, count: int, timeout: float = 1.0) -> Figures:
    """``count`` canaries from a plain client that only gives up on the deadline (closes its
    HTTP connection, or drops its Dynamo stream and stays alive until the counters are read)."""
    assert engine.closable, f"{engine.name} has no plain client"
    before = engine.read()
    engine.freeze()
    thawed = False
    try:
        if engine.dropping is not None:
            client = engine.dropping(count, timeout)
        else:
            client = _closing_http(engine, count, timeout)
        with client as timed_out:
            engine.thaw()
            thawed = True
            after = _settled(engine)
    finally:
        if not thawed:
            engine.thaw()
    return _figures(engine, "closing client", timed_out, before, after, "")


# --- reading counters ---------------------------------------------------------------------------
def prometheus_reader(
    url: str, wanted: Mapping[str, tuple[str, dict[str, str]]]
) -> Callable[[], Counters]:
    """A reader of ``url``'s exposition: {key: the sum of samples ``name`` with ``labels``}."""

    def read() -> Counters:
        with httpx.Client(trust_env=False, timeout=5) as client:
            parsed = samples(client.get(url).text)
        return {key: total(parsed, name, **labels) for key, (name, labels) in wanted.items()}

    return read


# --- the real engines ---------------------------------------------------------------------------
def _freezer(
    find: Callable[[], int], stop: Callable[[int], None], cont: Callable[[int], None]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(freeze, thaw) of the process ``find()`` names at the freeze."""
    pid: list[int] = []

    def freeze() -> None:
        pid[:] = [find()]
        stop(pid[0])

    return freeze, lambda: cont(pid[0])


def _http_env(backend: str, url: str) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": backend,
        "SIDECAR_ENGINE_URL": url,
    }


def llama_engine(server: LlamaServer) -> Engine:
    """llama-server frozen whole; counted in tokens (1 per canary), no abort counter."""
    return Engine(
        name="llama-server",
        url=server.url,
        sidecar_env=_http_env("openai", server.url),
        freeze=server.freeze,
        thaw=server.thaw,
        read=prometheus_reader(
            f"{server.url}/metrics",
            {
                "tokens_predicted": ("llamacpp:tokens_predicted_total", {}),
                "prompt_tokens": ("llamacpp:prompt_tokens_total", {}),
            },
        ),
        computed_keys=("tokens_predicted",),
        aborted_key=None,
        plain=lambda i: (
            "/v1/completions",
            {"prompt": "Say OK.", "max_tokens": 1, "temperature": 0, "stream": False},
        ),
    )


#: A 1-token greedy completion of the sidecar's own prompt, for vLLM's OpenAI API.
_VLLM_PLAIN = {
    "model": "tiny",
    "prompt": list(PROMPT_TOKEN_IDS),
    "max_tokens": 1,
    "temperature": 0,
    "ignore_eos": True,
}


def _vllm_counters(url: str, labels: Mapping[str, str]) -> Callable[[], Counters]:
    """vLLM's own counters (also as dynamo.vllm re-exports them, ``labels`` added): an aborted
    request is in no ``request_success_total`` series, ``finished_reason="abort"`` included."""
    return prometheus_reader(
        f"{url}/metrics",
        {
            "finished": ("vllm:request_success_total", dict(labels)),
            "finished_abort": (
                "vllm:request_success_total",
                {**labels, "finished_reason": "abort"},
            ),
            "generation_tokens": ("vllm:generation_tokens_total", dict(labels)),
            "prompt_tokens": ("vllm:prompt_tokens_total", dict(labels)),
            "running": ("vllm:num_requests_running", dict(labels)),
        },
    )


def vllm_engine(server: VllmServer) -> Engine:
    """vLLM with its ``VLLM::EngineCore`` frozen."""
    freeze, thaw = _freezer(server.engine_core_pid, pause, resume)
    return Engine(
        name="vLLM",
        url=server.url,
        sidecar_env=_http_env("vllm", server.url),
        freeze=freeze,
        thaw=thaw,
        read=_vllm_counters(server.url, {}),
        computed_keys=("finished",),
        aborted_key="finished_abort",
        plain=lambda i: ("/v1/completions", dict(_VLLM_PLAIN)),
    )


def sglang_engine(server: SglangServer) -> Engine:
    """SGLang with its (first) ``sglang::scheduler`` frozen; read after its disconnect poll."""
    freeze, thaw = _freezer(lambda: server.scheduler_pids()[0], server.freeze, server.thaw)
    return Engine(
        name="SGLang",
        url=server.url,
        sidecar_env=sglang_env(server),
        freeze=freeze,
        thaw=thaw,
        read=prometheus_reader(
            f"{server.url}/metrics",
            {
                "requests": ("sglang:num_requests_total", {}),
                "aborted": ("sglang:num_aborted_requests_total", {}),
                "generation_tokens": ("sglang:generation_tokens_total", {}),
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
                "rid": f"abandoned-{i}-{datetime.datetime.now().timestamp()}",
            },
        ),
    )


#: Dynamo's per-endpoint series of a worker's generate endpoint.
_GENERATE = {"dynamo_endpoint": "generate"}


def _dynamo_counters() -> dict[str, tuple[str, dict[str, str]]]:
    return {
        "requests": ("dynamo_component_requests_total", _GENERATE),
        "cancelled": ("dynamo_component_cancellation_total", _GENERATE),
    }


def mocker_engine(worker: MockerWorker) -> Engine:
    """The Dynamo mocker frozen whole (its runtime too); its simulated engine counts no tokens,
    so the requests reaching it are what is read."""
    return Engine(
        name="Dynamo mocker (request plane)",
        url=worker.system_url,
        sidecar_env=dynamo_sidecar_env(worker.system_url, worker.kv_dir),
        freeze=worker.freeze,
        thaw=worker.thaw,
        read=prometheus_reader(f"{worker.system_url}/metrics", _dynamo_counters()),
        computed_keys=("requests",),
        aborted_key="cancelled",
    )


def dynamo_vllm_engine(worker: DynamoVllmWorker) -> Engine:
    """``python -m dynamo.vllm`` with its ``VLLM::EngineCore`` frozen (its runtime and request
    plane alive, as when the GPU loop hangs), read from vLLM's own counters as its system
    server re-exports them; the plain client drops its stream without ``stop_generating()``."""
    freeze, thaw = _freezer(worker.engine_core_pid, pause, resume)
    vllm = _vllm_counters(worker.system_url, _GENERATE)
    dynamo = prometheus_reader(f"{worker.system_url}/metrics", _dynamo_counters())

    @contextlib.contextmanager
    def dropping(count: int, timeout: float) -> Iterator[int]:
        path, instance = worker.endpoint_path, worker.instance_id
        with dropping_canaries(
            worker.kv_dir, path, instance, count=count, timeout=timeout
        ) as results:
            yield sum(not r["ok"] for r in results)

    return Engine(
        name="dynamo.vllm (request plane)",
        url=worker.system_url,
        sidecar_env=dynamo_sidecar_env(worker.system_url, worker.kv_dir),
        freeze=freeze,
        thaw=thaw,
        read=lambda: vllm() | dynamo(),
        computed_keys=("finished",),
        aborted_key="cancelled",
        dropping=dropping,
    )
