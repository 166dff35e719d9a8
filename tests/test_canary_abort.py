"""Probes that do no harm: a canary that timed out does not stay on the engine.

Each test freezes what computes, lets the sidecar (started as users start it) time out canaries
against it, stops the sidecar, resumes the engine, and reads the engine's own counters once they
stand still (``tests/support/abandoned.py``): none of those canaries may be computed, except at
most one that had started. What each real engine does with an abandoned canary, and so what
the sidecar does about it (docs/concepts/backends.md, "Timed-out canaries"):

- vLLM aborts a request whose connection closed: closing it on the deadline is the stop;
- SGLang runs it on until its tokenizer manager next wakes (every 4 s): the probe sends
  ``POST /abort_request {"rid": ...}`` right after the timeout;
- llama-server computes it after SIGCONT and has no abort: the probe keeps the one it sent
  waiting and sends no other, so at most one is computed;
- a Dynamo worker gets ``stop_generating()`` on the request plane.

The fake engine does the same (``fakeengine/``): its tests run in-process, in the unit tier,
in ``tests/test_canary_abort_fake.py``. The real engines skip locally and fail under CI when
missing (``tests/support/prerequisites.py``); SGLang and Dynamo need the private network
namespace, so the whole module runs in one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.abandoned import (
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
from tests.support.netns import isolated  # noqa: F401 - the module's namespace fixture
from tests.support.sglang_engine import SglangServer, sglang_server
from tests.support.vllm_engine import VllmServer, aggregated_vllm

COUNT = 3  # canaries timed out against each frozen engine

pytestmark = pytest.mark.usefixtures("isolated")


def show(figures: Figures) -> None:
    print(
        f"\n{figures.engine}: {figures.timed_out} canaries timed out, {figures.computed} "
        f"computed after the resume, aborted {figures.aborted}; "
        f"before {figures.before}, after {figures.after}"
    )


# --- real engines -------------------------------------------------------------------------------
@pytest.mark.engine
def test_llama_server_computes_at_most_one(sidecar):
    server = LlamaServer("TINY_GGUF").start()
    try:
        figures = by_sidecar(llama_engine(server), sidecar, COUNT)
    finally:
        server.close()
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed <= 1


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmServer]:
    with aggregated_vllm() as server:
        yield server


@pytest.mark.engine
def test_vllm_aborts_timed_out_canaries(vllm, sidecar):
    figures = by_sidecar(vllm_engine(vllm), sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed <= 1
    tokens = figures.after["generation_tokens"] - figures.before["generation_tokens"]
    assert tokens <= 1


@pytest.fixture(scope="module")
def sglang() -> Iterator[SglangServer]:
    with sglang_server() as server:
        yield server


@pytest.mark.engine
def test_sglang_aborts_timed_out_canaries_by_rid(sglang, sidecar):
    figures = by_sidecar(sglang_engine(sglang), sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed <= 1
    assert figures.aborted is not None
    assert figures.aborted >= figures.timed_out - 1


@pytest.mark.engine
def test_dynamo_mocker_stops_timed_out_canaries(sidecar, tmp_path):
    worker = MockerWorker(tmp_path).start()
    try:
        figures = by_sidecar(mocker_engine(worker), sidecar, COUNT)
    finally:
        worker.close()
    show(figures)
    assert figures.timed_out >= COUNT
    # The whole worker frozen (its runtime too): the stops cannot reach it as cancellations,
    # and its requests arrive after SIGCONT. The sidecar sent one canary per timeout, no pile.
    assert figures.computed <= figures.timed_out + 1


@pytest.mark.engine
def test_dynamo_vllm_stops_timed_out_canaries(sidecar, tmp_path):
    """The real ``python -m dynamo.vllm`` with its EngineCore frozen (its request plane alive, as
    when the GPU loop hangs): the sidecar's ``stop_generating()`` reaches the worker, which aborts
    the vLLM request before the engine's next step; a client that only drops its stream gets
    every canary computed after SIGCONT. About a minute, most of it the worker's start."""
    worker = DynamoVllmWorker(kv_dir=tmp_path)
    try:
        worker.start()
        engine = dynamo_vllm_engine(worker)
        stopped = by_sidecar(engine, sidecar, COUNT)
        dropped = by_closing_client(engine, COUNT)
    finally:
        worker.close()
    show(stopped)
    show(dropped)
    assert stopped.timed_out >= COUNT
    assert stopped.computed <= 1
    tokens = stopped.after["generation_tokens"] - stopped.before["generation_tokens"]
    assert tokens <= 1
    # Dynamo counts each stop it received as a cancellation (one that reached it after the
    # sidecar had gone is not; measured once: 2 of 3).
    assert stopped.aborted is not None
    assert stopped.aborted >= stopped.timed_out - 1
    # The contrast, so that the stop is what did it: dropped streams are all computed.
    assert dropped.timed_out == COUNT
    assert dropped.computed >= COUNT - 1
