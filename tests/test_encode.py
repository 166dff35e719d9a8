"""The encode worker's canary, in-process on a virtual clock against the fake vLLM encoder
(``ec_role`` ``ec_producer``; tests/support/inprocess.py): a new image per canary, the answer
judged whole, a hung encoder behind a 200 /health found within wait + timeout, the connector's
files of each canary removed and nobody else's, and a text model's encode role without a canary.

The real encoders are in tests/test_vllm_encode.py (engine tier).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiotools import VirtualClock

from sidecar.config import Settings
from sidecar.core.evidence.result import Outcome
from sidecar.core.vocabulary import EmbeddingTransfer
from sidecar.probes.base import CanaryPlan
from sidecar.probes.canary import Canary
from sidecar.probes.exchange import Answer, NoAnswer, Received, Streamed
from sidecar.probes.image import data_url, fresh_png
from sidecar.probes.judge import judge
from sidecar.runtime.leftovers import Leftovers
from sidecar.tools.plan import render as render_plan
from sidecar.tools.probes import render as render_probes
from sidecar.tools.probes import size
from sidecar.wiring import resolve
from tests.support.configured import blueprint_of
from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WAIT, TIMEOUT = 1.0, 0.5
ENCODER = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_ENGINE_URL": URL,
    "SIDECAR_BACKEND": "vllm",
    "SIDECAR_DISAGGREGATION_MODE": "encode",
    "SIDECAR_MODEL_TYPE": "multimodal",
}
CACHE_FILE = "encoder_cache.safetensors"
DYNAMO_URL = "http://w:9090"  # a Dynamo worker's system server


def image_encoder(backend: str = "vllm", **fields: object) -> CanaryPlan:
    """The generate endpoint's plan of a multimodal model's encode worker, canaries on."""
    return blueprint_of(
        backend=backend,
        disaggregation_mode="encode",
        model_type="multimodal",
        health_check_enabled=True,
        **fields,
    ).plan


def encoder_plan() -> CanaryPlan:
    """vLLM's encoder over its HTTP API."""
    return image_encoder(engine_url=URL)


async def canaries(engine: EngineLink) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == "/v1/chat/completions"]


def image_of(request: dict[str, Any]) -> str:
    (message,) = request["json"]["messages"]
    (part,) = message["content"]
    assert part["type"] == "image_url"
    return part["image_url"]["url"]


# --- the image and the request -----------------------------------------------------------------


def test_the_image_is_a_png_new_for_every_request_id():
    a, b = fresh_png("canary-a"), fresh_png("canary-b")
    assert a.startswith(b"\x89PNG\r\n\x1a\n")
    assert b"IHDR" in a
    assert a.endswith(b"IEND\xaeB`\x82")
    assert a != b
    assert fresh_png("canary-a") == a  # rebuilt from a logged request id
    assert data_url(a).startswith("data:image/png;base64,iVBORw0KGgo")


def test_the_image_decodes_to_its_pixels():
    """A reader of PNGs gets back the 32 x 32 RGB pixels (zlib, one filter byte per row)."""
    import struct
    import zlib

    png = fresh_png("canary-x")
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    assert (width, height, depth, colour) == (32, 32, 8, 2)
    start = png.index(b"IDAT") + 4
    length = struct.unpack(">I", png[start - 8 : start - 4])[0]
    raw = zlib.decompress(png[start : start + length])
    assert len(raw) == 32 * (1 + 32 * 3)
    assert all(raw[row * 97] == 0 for row in range(32))


def test_the_request_is_what_vllms_encoder_proxy_sends():
    plan = encoder_plan()
    assert plan.enabled
    assert plan.path == "/v1/chat/completions"
    request = plan.request("tiny", "canary-1")
    body = request.body
    assert body["model"] == "tiny"
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    (message,) = body["messages"]
    assert message["role"] == "user"
    (part,) = message["content"]  # just the image: no text
    assert part["uuid"] == "canary-1"
    assert part["image_url"]["url"] == data_url(fresh_png("canary-1"))
    assert plan.request("tiny", "canary-2").body != body


def encoded(*names: str, **extra: Any) -> dict[str, Any]:
    items = {name: {"item_indices": [i], "metadata": {}} for i, name in enumerate(names)}
    return {
        "choices": [{"index": 0, "message": {"content": ""}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 17, "completion_tokens": 0},
        "ec_transfer_params": items,
    } | extra


@pytest.mark.parametrize(
    ("answer", "outcome", "reason"),
    [
        (encoded("canary-1"), Outcome.SUCCESS, "complete, well-formed answer"),
        (encoded(), Outcome.INVALID, "no ec_transfer_params in body: nothing was encoded"),
        (
            {"choices": [{"finish_reason": "stop"}]},
            Outcome.INVALID,
            "no ec_transfer_params in body: nothing was encoded",
        ),
        (
            encoded("a", "b"),
            Outcome.INVALID,
            "ec_transfer_params names 2 items, expected exactly 1",
        ),
        (
            {"ec_transfer_params": {"a": {"item_indices": [1]}}},
            Outcome.INVALID,
            "ec_transfer_params' item has no item_indices [0]",
        ),
        (
            encoded("a", error={"message": "boom"}),
            Outcome.INVALID,
            "engine error in body: boom",
        ),
    ],
)
def test_a_pass_needs_exactly_one_encoded_item(answer, outcome, reason):
    import json

    plan = encoder_plan()
    request = plan.request("tiny", "canary-1")
    received = Received(Answer(200, "application/json", json.dumps(answer).encode()), 0, 1, 1)
    result = judge(plan, request, received)
    assert (result.outcome, result.reason) == (outcome, reason)


def test_what_a_canary_leaves_is_named_by_its_answer_or_its_id():
    plan = encoder_plan()
    request = plan.request("tiny", "canary-1")
    assert plan.leftovers(request, encoded("abc123")) == (f"abc123/{CACHE_FILE}",)
    assert plan.leftovers(request, None) == (f"canary-1/{CACHE_FILE}",)
    # A name from the engine is only ever one plain path component.
    assert plan.leftovers(request, encoded("../../etc")) == ()
    assert plan.leftovers(request, encoded("a/b")) == ()


# --- the whole sidecar, in-process -------------------------------------------------------------


def test_the_encoder_goes_ready_and_each_canary_sends_a_new_image(tmp_path):
    async def main() -> None:
        engine = EngineLink("vllm", "encode", ec_storage_path=str(tmp_path))
        env = ENCODER | {"SIDECAR_EC_STORAGE_PATH": str(tmp_path)}
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            _, body = await side.health_body()
            assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

            async def three() -> bool:
                return len(await canaries(engine)) >= 3

            await until(three, 3 * WAIT + 1, 0.01, "three canaries")
            images = [image_of(r) for r in await canaries(engine)]
            assert len(set(images)) == len(images)
            assert (await side.get("/health")).status_code == 200

    run_virtually(main)


def test_each_canary_item_is_removed_and_no_other(tmp_path):
    """The connector's file of every canary is gone once its answer came; a user's image,
    encoded by the same encoder, stays."""

    async def main() -> None:
        engine = EngineLink("vllm", "encode", ec_storage_path=str(tmp_path))
        env = ENCODER | {"SIDECAR_EC_STORAGE_PATH": str(tmp_path)}
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            user = {"type": "image_url", "image_url": {"url": data_url(fresh_png("user"))}}
            user["uuid"] = "users-image"
            body = {"messages": [{"role": "user", "content": [user]}], "max_tokens": 1}
            answer = await engine.admin.post("/v1/chat/completions", json=body)
            assert answer.json()["ec_transfer_params"] == {
                "users-image": {"item_indices": [0], "metadata": {}}
            }

            async def three() -> bool:
                return len(await canaries(engine)) >= 3

            await until(three, 3 * WAIT + 1, 0.01, "three canaries")
            await side.wait_status(200, 1)
        # Every canary's entry removed, the user's kept.
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
            "users-image",
            f"users-image/{CACHE_FILE}",
        ]

    run_virtually(main)


def test_a_repeated_image_proves_nothing(tmp_path):
    """Why every canary's image is new: an image the encoder has seen takes an engine step and is
    answered 200 with its item named, but is not encoded again (its file is not rewritten), as a
    real vLLM encoder answers it (docs/engines.md)."""

    async def main() -> None:
        engine = EngineLink("vllm", "encode", ec_storage_path=str(tmp_path))
        part = {"type": "image_url", "image_url": {"url": data_url(fresh_png("same"))}}
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
        first = await engine.admin.post("/v1/chat/completions", json=body)
        assert first.status_code == 200
        (item,) = first.json()["ec_transfer_params"]
        (tmp_path / item / CACHE_FILE).unlink()
        again = await engine.admin.post("/v1/chat/completions", json=body)
        assert again.status_code == 200
        assert again.json()["ec_transfer_params"] == first.json()["ec_transfer_params"]
        assert not (tmp_path / item / CACHE_FILE).exists()  # nothing was encoded
        await engine.aclose()

    run_virtually(main)


def test_a_hung_encoder_is_notready_within_wait_plus_timeout_while_its_health_says_200():
    async def main() -> None:
        engine = EngineLink("vllm", "encode")
        async with running(ENCODER, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            took = await side.wait_status(503, WAIT + 2 * TIMEOUT + 1.0 + 0.05)
            assert took <= WAIT + TIMEOUT + 1.0 + TIMEOUT + 0.05  # two failures, one retry apart
            assert (await engine.admin.get("/health")).status_code == 200
            _, body = await side.health_body()
            assert "canary timeout" in body["reason"]
            await engine.fault(hang_generation=False)
            await side.wait_status(200, 1.0 + TIMEOUT + 0.05)

    run_virtually(main)


def test_a_busy_encoder_is_not_hung():
    """Other clients' images, each 0.8 s (longer than the canary's timeout), from four clients a
    fifth of a second apart: the canaries time out behind them, but each such request is one
    engine step that moves the counters (as a real vLLM encoder counts it, docs/engines.md), so
    every timeout is excused by their progress and /health stays 200; once the load ends, the
    canary passes again."""
    env = ENCODER | {"SIDECAR_METRICS_INTERVAL": "0.5"}

    async def main() -> None:
        engine = EngineLink("vllm", "encode")
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(latency=0.8)
            stop = asyncio.Event()

            async def client(n: int) -> None:
                await asyncio.sleep(0.2 * n)
                sent = 0
                while not stop.is_set():
                    sent += 1
                    part = {"type": "image_url", "image_url": {"url": f"data:,{n}-{sent}"}}
                    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
                    answer = await engine.admin.post("/v1/chat/completions", json=body, timeout=5)
                    assert answer.status_code == 200

            clients = [asyncio.ensure_future(client(n)) for n in range(4)]
            try:
                assert await side.statuses(8.0) == {200}
                _, body = await side.health_body()
                check = body["checks"]["generate"]
                assert check["progress"]["stall_suspected"] is False
            finally:
                stop.set()
                await asyncio.gather(*clients)
            timeouts = metric(
                await side.metrics(),
                "health_sidecar_canary_total",
                endpoint="generate",
                outcome="timeout",
            )
            assert timeouts >= 1  # the canaries really queued behind the load
            await engine.fault(latency=0.0)

            async def passed() -> bool:
                _, body = await side.health_body()
                return body["checks"]["generate"]["last_canary"]["outcome"] == "success"

            await until(passed, 2 * WAIT + TIMEOUT, 0.01, "a canary passed")

    run_virtually(main)


@pytest.mark.parametrize(
    ("backend", "said"),
    [
        # Dynamo's SGLang encode worker takes its own request type, which no prober builds yet.
        ("sglang", "no encode canary is known for sglang over dynamo"),
        # TensorRT-LLM's encoder gets none whatever carries it: the engine's rule, written once.
        ("trtllm", "CUDA IPC handles"),
    ],
)
def test_an_encode_worker_over_dynamos_request_plane_has_no_canary_yet_and_says_so(backend, said):
    """No canary for these encode workers over Dynamo's request plane, and the reason says why
    and how to give one (DYN_HEALTH_CHECK_PAYLOAD)."""
    plan = image_encoder(backend, transport="dynamo", engine_url=DYNAMO_URL)
    assert plan.enabled is False
    assert said in plan.why
    assert "DYN_HEALTH_CHECK_PAYLOAD" in plan.why


# What Dynamo 1.6.1's vLLM encode worker answered the tiny Llava's canary (local transfer mode),
# measured: its request back, the image dropped, with the embeddings' shape and file.
DYNAMO_ENCODED = {
    "engine_prompt": {"prompt_token_ids": []},
    "request_id": "canary-0",
    "multimodal_inputs": [
        {
            "multimodal_input": {"image_url": None, "video_url": None, "image_decoded": None},
            "image_grid_thw": [],
            "embeddings_shape": [1, 17, 128],
            "serialized_request": {
                "embeddings_shape": [1, 17, 128],
                "embedding_dtype_str": "float16",
                "serialized_request": "/tmp/dv-6jk566r2/encoder_cache."
                "08ebcc02602d4e7c816812290b5c1f52_0.rr3rdun5.safetensors",
            },
        }
    ],
}
DYNAMO_FILE = "encoder_cache.08ebcc02602d4e7c816812290b5c1f52_0.rr3rdun5.safetensors"


def dynamo_encoder_plan(transfer: EmbeddingTransfer = EmbeddingTransfer.LOCAL) -> CanaryPlan:
    """Dynamo's vLLM encode worker over its request plane, in ``transfer`` mode."""
    return image_encoder(
        transport="dynamo", engine_url=DYNAMO_URL, embedding_transfer_mode=transfer
    )


@pytest.mark.parametrize("transfer", [EmbeddingTransfer.NIXL_WRITE, EmbeddingTransfer.NIXL_READ])
def test_dynamos_vllm_encode_worker_in_a_nixl_mode_keeps_the_old_rule_and_says_why(transfer):
    plan = dynamo_encoder_plan(transfer)
    assert plan.enabled is False
    assert f"encode worker in {transfer} mode (DYN_VLLM_EMBEDDING_TRANSFER_MODE" in plan.why
    assert "would hold every later one" in plan.why


def test_nixl_write_is_dynamos_default_and_the_sidecars(monkeypatch):
    """Unset, DYN_VLLM_EMBEDDING_TRANSFER_MODE is nixl-write (ai-dynamo 1.6.1's code, whatever
    its help text says): no canary until it says local."""
    base = ENCODER | {"SIDECAR_TRANSPORT": "dynamo", "SIDECAR_ENGINE_URL": DYNAMO_URL}
    unset = Settings.model_validate(base)
    local = Settings.model_validate(base | {"DYN_VLLM_EMBEDDING_TRANSFER_MODE": "local"})
    assert unset.embedding_transfer_mode is EmbeddingTransfer.NIXL_WRITE
    assert resolve(unset).plan.enabled is False
    assert resolve(local).plan.enabled is True


def test_dynamos_vllm_encode_canary_is_its_multimodal_request_with_a_new_image():
    plan = dynamo_encoder_plan()
    assert plan.enabled is True
    first, second = plan.request(None, "canary-1"), plan.request(None, "canary-2")
    assert first.expected_tokens == 0
    assert first.body["request_id"] == "canary-1"
    assert first.body["engine_prompt"] == {"prompt_token_ids": []}
    (group,) = first.body["multimodal_inputs"]
    assert group["multimodal_input"]["image_url"] == data_url(fresh_png("canary-1"))
    (other,) = second.body["multimodal_inputs"]
    assert other["multimodal_input"]["image_url"] != group["multimodal_input"]["image_url"]


def _streamed(*chunks: Any) -> Received:
    return Received(Streamed(tuple(chunks)), 0.0, 0.01, 0.0)


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ((json.dumps(DYNAMO_ENCODED),), None),  # as the worker yields it: JSON text
        ((DYNAMO_ENCODED,), None),
        ((), "0 chunk(s), expected the one answer"),
        ((json.dumps(DYNAMO_ENCODED),) * 2, "2 chunk(s), expected the one answer"),
        (("not json",), "the answer is not a JSON object"),
        ((DYNAMO_ENCODED | {"multimodal_inputs": []},), "no multimodal_inputs in the answer"),
        (
            (DYNAMO_ENCODED | {"multimodal_inputs": DYNAMO_ENCODED["multimodal_inputs"] * 2},),
            "2 multimodal_inputs in the answer, expected 1",
        ),
        (
            (DYNAMO_ENCODED | {"multimodal_inputs": [{"embeddings_shape": None}]},),
            "no embeddings_shape in the answer: nothing was encoded",
        ),
        (
            (DYNAMO_ENCODED | {"multimodal_inputs": [{"embeddings_shape": [1, 0, 128]}]},),
            "embeddings_shape [1, 0, 128] is not a tensor's shape",
        ),
    ],
)
def test_dynamos_encode_answer_is_judged_whole(chunks, problem):
    plan = dynamo_encoder_plan()
    request = plan.request(None, "canary-0")
    result = judge(plan, request, _streamed(*chunks))
    if problem is None:
        assert result.outcome is Outcome.SUCCESS, result.reason
    else:
        assert result.outcome is Outcome.INVALID
        assert result.reason.startswith(problem), result.reason


@pytest.mark.parametrize(
    ("path", "names"),
    [
        (f"/tmp/dv-6jk566r2/{DYNAMO_FILE}", (DYNAMO_FILE,)),
        (f"/elsewhere/{DYNAMO_FILE}", (DYNAMO_FILE,)),  # by name: mounted under another path
        ("/tmp/x/model.safetensors", ()),  # not the local sender's name: never removed
        ("/tmp/../../etc/encoder_cache.0_0.x.safetensors/..", ()),
        (None, ()),  # NIXL modes name no file
    ],
)
def test_dynamos_encode_canary_leaves_the_file_its_answer_names(path, names):
    plan = dynamo_encoder_plan()
    request = plan.request(None, "canary-0")
    group = json.loads(json.dumps(DYNAMO_ENCODED["multimodal_inputs"][0]))
    group["serialized_request"]["serialized_request"] = path
    answer = [json.dumps(DYNAMO_ENCODED | {"multimodal_inputs": [group]})]
    assert plan.leftovers(request, answer) == names
    assert plan.leftovers(request, None) == ()  # no answer: the name is not known yet


class _StoppedEncodeWorker:
    """Dynamo's encode worker, stopped: canaries wait on their streams until ``resume``, then
    each is answered with a file of its own, written as it is answered."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sent: list[str] = []
        self.resumed = asyncio.Event()

    def redact(self, text: str) -> str:
        return text

    async def send(self, request: Any, deadline: float) -> Received:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.sent.append(request.request_id)
        try:
            async with asyncio.timeout(deadline):
                await self.resumed.wait()
        except TimeoutError:
            return Received(NoAnswer(Outcome.TIMEOUT, "no answer"), started, loop.time(), 0.0)
        name = f"encoder_cache.ab_{len(self.sent) - 1}.r{len(self.sent)}.safetensors"
        (self.root / name).write_bytes(b"embeddings")
        group = {
            "embeddings_shape": [1, 17, 128],
            "serialized_request": {"serialized_request": f"/worker/tmp/{name}"},
        }
        body = {"request_id": request.request_id, "multimodal_inputs": [group]}
        return Received(Streamed((json.dumps(body),)), started, loop.time(), 0.0)


def test_a_timed_out_dynamo_encode_canary_is_kept_and_its_late_file_removed(tmp_path):
    """The encode handler runs a stopped canary to its end when the worker resumes, and names
    its file only in its answer: the probe keeps the timed-out canary's stream open, sends no
    other while it runs, and removes the file its late answer names; the user's files stay."""
    plan = dynamo_encoder_plan()
    (tmp_path / "encoder_cache.ff_9.users.safetensors").write_bytes(b"someone else's")

    async def main() -> None:
        with VirtualClock().patch_loop():
            loop = asyncio.get_running_loop()
            worker = _StoppedEncodeWorker(tmp_path)
            sweeper = Leftovers(tmp_path, clock=loop.time, offload=_inline)
            probe = Canary(worker, timeout=0.5, clock=loop.time, sweeper=sweeper, holds_on="stream")
            results = [await probe(plan, plan.request(None, f"canary-{n}"), None) for n in range(3)]
            assert [r.outcome for r in results] == [Outcome.TIMEOUT] * 3
            assert worker.sent == ["canary-0"]  # never more than the one on the worker
            assert "stays on its stream (Dynamo's encode handler runs it" in results[1].reason
            worker.resumed.set()
            result = await probe(plan, plan.request(None, "canary-3"), None)
            assert (result.outcome, result.request_id) == (Outcome.SUCCESS, "canary-0")
            assert sorted(p.name for p in tmp_path.iterdir()) == [
                "encoder_cache.ff_9.users.safetensors"
            ]
            result = await probe(plan, plan.request(None, "canary-4"), None)
            assert (result.outcome, worker.sent[-1]) == (Outcome.SUCCESS, "canary-4")
            assert sweeper.removed == 2
            await probe.aclose()
            assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_the_plans_say_an_encoders_gauges_show_no_work_and_bound_no_stall(tmp_path):
    """An encoder's in-flight gauges read 0 under load (docs/engines.md): --check-config says
    nothing is held or suspected for load, and the probes promise no bound under load; a text
    model's decode worker keeps both."""
    encoder = resolve(Settings.model_validate(ENCODER | {"SIDECAR_EC_STORAGE_PATH": str(tmp_path)}))
    decode = resolve(
        Settings.model_validate(
            ENCODER | {"SIDECAR_DISAGGREGATION_MODE": "decode", "SIDECAR_MODEL_TYPE": "text"}
        )
    )
    assert "stall rule   off: no request shows in flight" in render_plan(encoder)
    assert "holds        routine canaries" not in render_plan(encoder)
    assert "holds        routine canaries" in render_plan(decode)
    assert size(encoder, 600).stall_to_notready is None
    assert size(decode, 600).stall_to_notready is not None
    assert "Under load" not in render_probes(encoder, 600)
    assert "Under load" in render_probes(decode, 600)


def test_a_text_models_encode_role_keeps_the_old_rule_and_says_why():
    env = ENCODER | {"SIDECAR_MODEL_TYPE": "text"}

    async def main() -> None:
        engine = EngineLink("vllm", "encode")
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            assert await canaries(engine) == []
            _, body = await side.health_body()
            assert body["checks"]["generate"]["canary"] == "disabled"
            assert "an encode worker of a text model" in body["reason"]

    run_virtually(main)


# --- removing what a canary left -----------------------------------------------------------------


async def _inline(call) -> None:
    call()


def _write(root: Path, name: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_a_timed_out_canarys_file_is_removed_when_it_appears(tmp_path):
    now = [0.0]
    sweeper = Leftovers(tmp_path, clock=lambda: now[0], offload=_inline, keep=60)

    async def main() -> None:
        await sweeper.remove([f"late/{CACHE_FILE}"], later=True)  # not written yet
        assert sweeper.waiting == (f"late/{CACHE_FILE}",)
        _write(tmp_path, f"late/{CACHE_FILE}")  # the engine resumed and wrote it
        await sweeper.remove([], later=False)  # the next canary's round
        assert not (tmp_path / "late").exists()
        assert sweeper.waiting == ()

    asyncio.run(main())


def test_a_name_that_never_appears_is_given_up_after_keep(tmp_path):
    now = [0.0]
    sweeper = Leftovers(tmp_path, clock=lambda: now[0], offload=_inline, keep=60)

    async def main() -> None:
        await sweeper.remove([f"never/{CACHE_FILE}"], later=True)
        now[0] = 59.0
        await sweeper.remove([], later=False)
        assert sweeper.waiting == (f"never/{CACHE_FILE}",)
        now[0] = 61.0
        await sweeper.remove([], later=False)
        assert sweeper.waiting == ()

    asyncio.run(main())


def test_only_a_regular_file_under_the_root_is_removed(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = _write(tmp_path, "outside/keep")
    (root / "link").symlink_to(outside.parent)
    (root / "dirlink").mkdir()
    (root / "dirlink" / CACHE_FILE).symlink_to(outside)
    shared = _write(root, f"shared/{CACHE_FILE}")
    _write(root, "shared/other")  # the engine's own: the folder stays
    sweeper = Leftovers(root, offload=_inline)

    async def main() -> None:
        await sweeper.remove(
            ["../outside/keep", "/etc/passwd", "link/keep", f"dirlink/{CACHE_FILE}"], later=False
        )
        await sweeper.remove([f"shared/{CACHE_FILE}"], later=False)

    asyncio.run(main())
    assert outside.exists()
    assert (root / "dirlink" / CACHE_FILE).is_symlink()
    assert not shared.exists()
    assert (root / "shared" / "other").exists()
    assert sweeper.removed == 1


def test_a_stuck_removal_never_holds_the_canary_back(tmp_path):
    """A hung mount: the removal's deadline passes, the canary goes on; while it is stuck no
    other removal starts, and names to remove later are kept for the next round."""
    release = asyncio.Event

    async def main() -> None:
        gate = release()

        async def stuck(call) -> None:
            await gate.wait()
            call()

        sweeper = Leftovers(tmp_path, offload=stuck, timeout=0.5)
        await sweeper.remove([f"a/{CACHE_FILE}"], later=True)  # returns after its deadline
        await sweeper.remove([f"b/{CACHE_FILE}"], later=True)  # skipped, kept waiting
        assert f"b/{CACHE_FILE}" in sweeper.waiting
        gate.set()
        await asyncio.sleep(0)

    async def virtual() -> None:
        with VirtualClock().patch_loop():
            await main()

    asyncio.run(virtual())


def test_the_sidecar_refuses_to_start_without_its_storage_path(tmp_path):
    missing = tmp_path / "missing"
    settings = Settings.model_validate(ENCODER | {"SIDECAR_EC_STORAGE_PATH": str(missing)})
    assert resolve(settings).missing == (
        f"SIDECAR_EC_STORAGE_PATH={missing}: expected a directory here (it is not one)",
    )
    settings = Settings.model_validate(ENCODER | {"SIDECAR_EC_STORAGE_PATH": str(tmp_path)})
    assert resolve(settings).missing == ()


def test_no_answer_is_a_timeout_whose_file_may_come_later():
    plan = encoder_plan()
    request = plan.request("tiny", "canary-9")
    received = Received(NoAnswer(Outcome.TIMEOUT, "no complete answer within 3 s"), 0, 3, 3)
    assert judge(plan, request, received).outcome is Outcome.TIMEOUT
    assert plan.leftovers(request, None) == (f"canary-9/{CACHE_FILE}",)


# --- SGLang's encoder: its own GET /health, under the sidecar's deadline ------------------------
SGLANG_ENCODER = ENCODER | {"SIDECAR_BACKEND": "sglang"}


def test_sglangs_encoder_is_checked_by_its_own_health_route_with_no_body():
    """Registered on any answer of GET /v1/models (the encoder serves none: 404), ready on a
    GET /health that answers 200 (SGLang encodes its own test image)."""

    async def main() -> None:
        engine = EngineLink("sglang", "encode")
        async with running(SGLANG_ENCODER, {URL: engine}) as side:
            await side.wait_status(200, 5)
            _, body = await side.health_body()
            canary = body["checks"]["generate"]["last_canary"]
            assert canary["outcome"] == "success"
            assert canary["reason"] == "HTTP 200 from GET /health"
            assert (await engine.admin.get("/v1/models")).status_code == 404
            assert not [r for r in await engine.requests() if r["path"] == "/generate"]

    run_virtually(main)


def test_a_hung_sglang_encoder_is_notready_with_one_health_check_on_it_at_a_time():
    """The encoder hung: its /health gives no answer; the sidecar is notready within wait plus
    two timeouts and a retry, keeps the timed-out /health waiting instead of sending more (at
    most one on the encoder), and is ready again once the encoder resumes."""

    async def main() -> None:
        engine = EngineLink("sglang", "encode")
        async with running(SGLANG_ENCODER, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            await side.wait_status(503, WAIT + 2 * TIMEOUT + 1.0 + 0.05)
            _, body = await side.health_body()
            assert "canary timeout" in body["reason"]
            kept = body["checks"]["generate"]["last_canary"]["reason"]
            assert "stays on its connection (SGLang runs a /health to its end" in kept
            held = []
            for _ in range(40):  # 4 s of canaries due every second
                held.append((await engine.state_of())["running"])
                await asyncio.sleep(0.1)
            assert max(held) == 1, held  # the one kept /health, never more
            await engine.fault(hang_generation=False)
            await side.wait_status(200, 1.0 + TIMEOUT + 0.05)

    run_virtually(main)


def test_sglangs_encoder_gets_no_pinned_ranks_and_reads_no_metrics():
    blueprint = resolve(Settings.model_validate(SGLANG_ENCODER))
    assert blueprint.ranks == 1
    assert blueprint.plan.reads.pin is None
    assert blueprint.timing.metrics is None
    assert not blueprint.metrics_read
    text = render_plan(blueprint)
    assert "request      GET /health" in text
    assert "body         none" in text
    assert "engine metrics not read" in text
    assert "registered while it answers at all" in text
