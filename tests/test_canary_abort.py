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

The fake engine does the same (``fakeengine/``), so the first tests run in a second. The real
engines skip locally and fail under CI when missing (``tests/support/prerequisites.py``); SGLang
and Dynamo need the private network namespace, so the whole module runs in one.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

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
from tests.support.harness import FakeEngine, wait_until
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


# --- the fake engine ----------------------------------------------------------------------------
def fake_engine(fake: FakeEngine, backend: str) -> Engine:
    def read() -> dict[str, float]:
        abandoned = fake.http.get(f"{fake.url}/_fake/state").json()["abandoned"]
        return {key: float(value) for key, value in abandoned.items()}

    return Engine(
        name=f"fake {backend}",
        url=fake.url,
        sidecar_env={
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": backend,
            "SIDECAR_ENGINE_URL": fake.url,
        },
        freeze=lambda: fake.fault(hang_generation=True),
        thaw=lambda: fake.fault(hang_generation=False),
        read=read,
        computed_keys=("computed",),
        aborted_key="aborted",
    )


def generations(fake: FakeEngine, path: str) -> list[dict[str, Any]]:
    return [r for r in fake.requests() if r["path"] == path]


def test_fake_sglang_canaries_are_aborted_by_rid(engine, sidecar):
    fake = engine("sglang")
    figures = by_sidecar(fake_engine(fake, "sglang"), sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed == 0
    assert figures.aborted == figures.timed_out
    rids = [r["json"]["rid"] for r in generations(fake, "/generate")]
    aborted = [r["json"]["rid"] for r in generations(fake, "/abort_request")]
    assert set(aborted) <= set(rids)
    assert len(aborted) >= figures.timed_out
    metrics = fake.http.get(f"{fake.url}/metrics").text
    assert "sglang:num_aborted_requests_total{" in metrics


def test_fake_sglang_runs_an_abandoned_request_on_until_it_notices():
    """Without the abort, a canary whose client left is computed when the scheduler resumes
    within SGLang's 4 s: what the abort is for."""
    fake = FakeEngine("sglang").start()
    try:
        engine = fake_engine(fake, "sglang")
        engine.freeze()
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{fake.url}/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "rid": "x"},
                timeout=0.3,
                trust_env=False,
            )
        engine.thaw()

        def abandoned() -> dict[str, int]:
            return fake.http.get(f"{fake.url}/_fake/state").json()["abandoned"]

        # Resumed, the engine reads the request and computes it: wait for that to be counted.
        wait_until(lambda: sum(abandoned().values()) > 0, 1, what="the request to be counted")
        assert abandoned() == {"aborted": 0, "computed": 1}
    finally:
        fake.close()


def test_fake_vllm_aborts_on_close_and_gets_no_abort_request(engine, sidecar):
    fake = engine("vllm")
    figures = by_sidecar(fake_engine(fake, "vllm"), sidecar, COUNT)
    show(figures)
    assert figures.computed == 0
    assert figures.aborted is not None
    assert figures.aborted >= figures.timed_out >= COUNT
    assert not generations(fake, "/abort_request")


def test_fake_llama_server_frozen_whole_gets_one_canary_at_a_time(engine, sidecar):
    """Frozen whole (SIGSTOP), as the real one below: the kept canary is the only one sent."""
    fake = engine("openai")
    whole = replace(
        fake_engine(fake, "openai"),
        freeze=lambda: fake.proc.signal(signal.SIGSTOP),
        thaw=lambda: fake.proc.signal(signal.SIGCONT),
    )
    figures = by_sidecar(whole, sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed <= 1
    assert len(generations(fake, "/v1/completions")) <= 2  # the first canary, and the kept one


def test_fake_llama_server_with_its_http_alive_gets_each_canary_cancelled(engine, sidecar):
    """Compute hung, HTTP alive: its /health answers, so the kept canary is closed and llama-server
    cancels it; a fresh canary follows."""
    fake = engine("openai")

    def thaw() -> None:
        # The fake llama-server notices a closed connection within 1 s: the compute resumes once
        # it has let go of every canary the sidecar closed (the last one as the sidecar stopped).
        state = f"{fake.url}/_fake/state"
        wait_until(lambda: fake.http.get(state).json()["running"] == 0, 3, what="canaries let go")
        fake.fault(hang_generation=False)

    figures = by_sidecar(replace(fake_engine(fake, "openai"), thaw=thaw), sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed == 0
    assert figures.aborted >= figures.timed_out


# --- real engines -------------------------------------------------------------------------------
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


def test_sglang_aborts_timed_out_canaries_by_rid(sglang, sidecar):
    figures = by_sidecar(sglang_engine(sglang), sidecar, COUNT)
    show(figures)
    assert figures.timed_out >= COUNT
    assert figures.computed <= 1
    assert figures.aborted is not None
    assert figures.aborted >= figures.timed_out - 1


def test_dynamo_mocker_stops_timed_out_canaries(sidecar):
    worker = MockerWorker(tempfile.mkdtemp(prefix="abort-dynamo-")).start()
    try:
        figures = by_sidecar(mocker_engine(worker), sidecar, COUNT)
    finally:
        worker.close()
    show(figures)
    assert figures.timed_out >= COUNT
    # The whole worker frozen (its runtime too): the stops cannot reach it as cancellations,
    # and its requests arrive after SIGCONT. The sidecar sent one canary per timeout, no pile.
    assert figures.computed <= figures.timed_out + 1


def test_dynamo_vllm_stops_timed_out_canaries(sidecar):
    """The real ``python -m dynamo.vllm`` with its EngineCore frozen (its request plane alive, as
    when the GPU loop hangs): the sidecar's ``stop_generating()`` reaches the worker, which aborts
    the vLLM request before the engine's next step; a client that only drops its stream gets
    every canary computed after SIGCONT. About a minute, most of it the worker's start."""
    worker = DynamoVllmWorker(kv_dir=tempfile.mkdtemp(prefix="abort-dynamo-vllm-"))
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
