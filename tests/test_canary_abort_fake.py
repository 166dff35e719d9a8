"""Probes that do no harm, against the fake engine: a canary that timed out does not stay on the
engine. In-process on a virtual clock: the whole sidecar (``tests/support/inprocess.py``) against
the fake engine's app served as its process serves it (``tests/support/engineprocess.py``: a
client that leaves is heard as a disconnect, a stopped process reads its requests at SIGCONT).

Each test freezes what computes, lets the sidecar time out canaries against it, stops the
sidecar, resumes the engine, and reads the engine's own counters once they stand still: none of
those canaries may be computed, except at most one that had started. What each engine does with
an abandoned canary, and so what the sidecar does about it (docs/concepts/backends.md,
"Timed-out canaries"; the real engines: tests/test_canary_abort.py):

- vLLM aborts a request whose connection closed: closing it on the deadline is the stop;
- SGLang runs it on until its tokenizer manager next wakes (every 4 s): the probe sends
  ``POST /abort_request {"rid": ...}`` right after the timeout;
- llama-server computes it after SIGCONT and has no abort: the probe keeps the one it sent
  waiting and sends no other, so at most one is computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.engineprocess import Outliving, ProcessLink
from tests.support.exposition import metric
from tests.support.inprocess import run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
COUNT = 3  # canaries timed out against each frozen engine
WAIT, TIMEOUT = "1", "0.5"  # the sidecar's timings (tests/support/abandoned.py's)
QUIET = 1.5  # the engine's counters stand still this long after the resume to be final


@dataclass(frozen=True)
class Figures:
    timed_out: int  # canaries that timed out while the engine was frozen
    computed: int  # of them, computed once it resumed (its own counters)
    aborted: int  # its own count of abandoned requests it aborted


async def abandoned(engine: ProcessLink) -> dict[str, int]:
    return (await engine.state_of())["abandoned"]  # type: ignore[no-any-return]


async def settled(engine: ProcessLink) -> dict[str, int]:
    """The engine's counters once they stood still for QUIET (virtual) seconds."""
    loop = asyncio.get_running_loop()
    last, still_since = await abandoned(engine), loop.time()
    while loop.time() - still_since < QUIET:
        await asyncio.sleep(0.25)
        now = await abandoned(engine)
        if now != last:
            last, still_since = now, loop.time()
    return last


async def by_sidecar(
    engine: ProcessLink,
    backend: str,
    freeze: Callable[[], Awaitable[None]],
    thaw: Callable[[], Awaitable[None]],
) -> Figures:
    """COUNT canaries timed out by the sidecar against the frozen engine, the sidecar stopped,
    then the resume (tests/support/abandoned.py's ``by_sidecar``)."""
    env = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": backend,
        "SIDECAR_ENGINE_URL": URL,
        "DYN_CANARY_WAIT_TIME": WAIT,
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": TIMEOUT,
    }
    async with running(env, {URL: Outliving(engine)}) as side:
        await side.wait_status(200, 30)

        async def timeouts() -> int:
            found = metric(
                await side.metrics(),
                "health_sidecar_canary_total",
                endpoint="generate",
                outcome="timeout",
            )
            return int(found or 0)

        start = await timeouts()
        before = await abandoned(engine)
        await freeze()

        async def timed_out() -> bool:
            return await timeouts() - start >= COUNT

        await until(timed_out, COUNT * 5.0 + 10, 0.1, f"{COUNT} canary timeouts")
        counted = await timeouts() - start
    # The sidecar has stopped: nothing more from it after the resume.
    await thaw()
    after = await settled(engine)
    figures = Figures(
        counted, after["computed"] - before["computed"], after["aborted"] - before["aborted"]
    )
    print(f"\nfake {backend}: {figures}")
    return figures


def hang(engine: ProcessLink, on: bool) -> Callable[[], Awaitable[None]]:
    async def fault() -> None:
        await engine.fault(hang_generation=on)

    return fault


async def post(engine: ProcessLink, path: str, body: dict[str, Any]) -> httpx.Response:
    """A plain client's request (cancelling it is the client leaving)."""
    async with httpx.AsyncClient(transport=Outliving(engine), base_url=URL) as client:
        return await client.post(path, json=body, timeout=None)


async def generations(engine: ProcessLink, path: str) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == path]


def test_fake_sglang_canaries_are_aborted_by_rid():
    async def main() -> None:
        engine = ProcessLink("sglang")
        try:
            figures = await by_sidecar(engine, "sglang", hang(engine, True), hang(engine, False))
            assert figures.timed_out >= COUNT
            assert figures.computed == 0
            assert figures.aborted == figures.timed_out
            rids = [r["json"]["rid"] for r in await generations(engine, "/generate")]
            aborted = [r["json"]["rid"] for r in await generations(engine, "/abort_request")]
            assert set(aborted) <= set(rids)
            assert len(aborted) >= figures.timed_out
            metrics = (await engine.admin.get("/metrics")).text
            assert "sglang:num_aborted_requests_total{" in metrics
        finally:
            await engine.aclose()

    run_virtually(main)


def test_fake_sglang_runs_an_abandoned_request_on_until_it_notices():
    """Without the abort, a canary whose client left is computed when the scheduler resumes
    within SGLang's 4 s: what the abort is for."""

    async def main() -> None:
        engine = ProcessLink("sglang")
        try:
            await engine.fault(hang_generation=True)
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "rid": "x"}
            client = asyncio.create_task(post(engine, "/generate", body))
            await asyncio.sleep(0.3)
            assert not client.done()  # no answer within the client's 0.3 s: it gives up
            client.cancel()
            await asyncio.gather(client, return_exceptions=True)
            await engine.fault(hang_generation=False)

            async def counted() -> bool:
                return sum((await abandoned(engine)).values()) > 0

            # Resumed, the engine computes the request: wait for that to be counted.
            await until(counted, 1, what="the request to be counted")
            assert await abandoned(engine) == {"aborted": 0, "computed": 1}
        finally:
            await engine.aclose()

    run_virtually(main)


def test_fake_vllm_aborts_on_close_and_gets_no_abort_request():
    async def main() -> None:
        engine = ProcessLink("vllm")
        try:
            figures = await by_sidecar(engine, "vllm", hang(engine, True), hang(engine, False))
            assert figures.computed == 0
            assert figures.aborted >= figures.timed_out >= COUNT
            assert not await generations(engine, "/abort_request")
        finally:
            await engine.aclose()

    run_virtually(main)


def test_fake_llama_server_frozen_whole_gets_one_canary_at_a_time():
    """Frozen whole (SIGSTOP), as the real one in tests/test_canary_abort.py: the kept canary is
    the only one sent; read at SIGCONT, it is the one computed."""

    async def main() -> None:
        engine = ProcessLink("openai")
        stopped: list[float] = []

        async def freeze() -> None:
            stopped.append(asyncio.get_running_loop().time())
            engine.freeze()

        async def thaw() -> None:
            stopped.append(asyncio.get_running_loop().time())
            engine.thaw()

        try:
            figures = await by_sidecar(engine, "openai", freeze, thaw)
            assert figures.timed_out >= COUNT
            assert figures.computed <= 1
            # The first canary, and the kept one.
            assert len(await generations(engine, "/v1/completions")) <= 2
            # What the sidecar sent while the engine was stopped: one canary, kept.
            sent = [s for s in engine.sent if stopped[0] <= s.at <= stopped[1]]
            assert [s.path for s in sent if s.method == "POST"] == ["/v1/completions"]
        finally:
            await engine.aclose()

    run_virtually(main)


def test_fake_llama_server_with_its_http_alive_gets_each_canary_cancelled():
    """Compute hung, HTTP alive: its /health answers, so the kept canary is closed and
    llama-server cancels it; a fresh canary follows."""

    async def main() -> None:
        engine = ProcessLink("openai")

        async def thaw() -> None:
            # The fake llama-server notices a closed connection within 1 s: the compute resumes
            # once it has let go of every canary the sidecar closed (the last one as it stopped).
            async def let_go() -> bool:
                return (await engine.state_of())["running"] == 0

            await until(let_go, 3, what="canaries let go")
            await engine.fault(hang_generation=False)

        try:
            figures = await by_sidecar(engine, "openai", hang(engine, True), thaw)
            assert figures.timed_out >= COUNT
            assert figures.computed == 0
            assert figures.aborted >= figures.timed_out
            # Each timed-out canary was closed and a fresh one sent: none kept waiting.
            posts = [s for s in engine.sent if s.method == "POST"]
            assert len(posts) >= figures.timed_out + 1
        finally:
            await engine.aclose()

    run_virtually(main)
