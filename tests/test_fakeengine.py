"""End-to-end tests of ``python -m fakeengine``, each engine a real process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.probes.transfer import REMOTE_DECODE

pytestmark = pytest.mark.process

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT = 10.0
POLL_INTERVAL = 0.02
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


def wait_for(predicate: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(POLL_INTERVAL)


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 5.0, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout, **kw)

    def fault(self, **changes: Any) -> dict[str, Any]:
        response = self.post("/_fake/fault", changes)
        assert response.status_code == 200, response.text
        return response.json()

    def state(self) -> dict[str, Any]:
        return self.get("/_fake/state").json()

    def metric(self, name: str, path: str = "/metrics") -> float:
        return metric_value(self.get(path).text, name)


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


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate all at once, then give each up to 3 s before SIGKILL."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Launcher:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, port: int = 0, wait: bool = True) -> Engine:
        n = len(self.procs)
        port_file = self.workdir / f"engine-{n}.port"
        log = self.workdir / f"engine-{n}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "fakeengine", "--host", HOST, "--port", str(port)]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [*command, "--port-file", str(port_file), *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.procs.append(proc)
        engine = Engine(proc, port, log)
        if wait:
            engine.port = self._read_port(port_file, proc)
        return engine

    @staticmethod
    def _read_port(port_file: Path, proc: subprocess.Popen[bytes]) -> int:
        def ready() -> bool:
            assert proc.poll() is None, f"engine exited early with {proc.returncode}"
            return port_file.exists()

        wait_for(ready)
        return int(port_file.read_text())

    def stop_all(self) -> None:
        stop_processes(self.procs)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher.start
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def shared_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    launcher = Launcher(tmp_path_factory.mktemp("shared-vllm"))
    try:
        yield launcher.start("--backend", "vllm")
    finally:
        launcher.stop_all()


@pytest.fixture
def vllm(shared_vllm: Engine) -> Engine:
    """The module's aggregated vLLM engine with faults and request log cleared."""
    assert shared_vllm.post("/_fake/reset").status_code == 200
    assert httpx.delete(shared_vllm.url + "/_fake/requests").status_code == 200
    return shared_vllm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


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


# ------------------------------------------------------------------------------ lifecycle


def test_port_file_and_listening_line(vllm: Engine) -> None:
    line = f"fakeengine listening on http://{HOST}:{vllm.port} backend=vllm mode=aggregated"
    assert line in vllm.log.read_text()
    state = vllm.state()
    assert state["backend"] == "vllm"
    assert state["mode"] == "aggregated"
    assert state["model"] == "tiny"
    assert state["loading"] is False
    assert state["pid"] == vllm.proc.pid


def test_sigterm_exits_zero_and_restart_after_sigkill(launch: Callable[..., Engine]) -> None:
    first = launch("--backend", "openai")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=5)
    second = launch("--backend", "openai", port=first.port)
    assert second.port == first.port
    assert second.get("/health").json() == {"status": "ok"}
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=5) == 0


# ------------------------------------------------------------------------------------ vLLM


def test_vllm_happy_path(vllm: Engine) -> None:
    health = vllm.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    models = vllm.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "max_model_len")} == {
        "id": "tiny",
        "object": "model",
        "owned_by": "vllm",
        "root": "tiny",
        "max_model_len": 2048,
    }
    response = vllm.post("/v1/completions", completion(max_tokens=3, request_id="canary-7"))
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
    text_prompt = vllm.post("/v1/completions", completion(prompt="hello there")).json()
    assert text_prompt["usage"]["prompt_tokens"] == 2


def test_vllm_metrics_and_wrong_model(vllm: Engine) -> None:
    before = vllm.metric("vllm:generation_tokens_total")
    assert vllm.post("/v1/completions", completion(max_tokens=4)).status_code == 200
    text = vllm.get("/metrics").text
    assert metric_value(text, "vllm:generation_tokens_total") == before + 4
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:iteration_tokens_total_count",
    ):
        metric_value(text, name)
    # As a real vLLM counts (tests/test_vllm_real.py): one step for a 4-token request's prefill
    # and first token, one per further token; the sum is prompt plus generated tokens.
    assert metric_value(text, "vllm:iteration_tokens_total_count") >= 4
    assert 'model_name="tiny"' in text
    wrong = vllm.post("/v1/completions", completion(model="other"))
    assert wrong.status_code == 404
    assert wrong.json() == {
        "error": {
            "message": "The model `other` does not exist.",
            "type": "NotFoundError",
            "code": 404,
        }
    }


def test_vllm_streaming(vllm: Engine) -> None:
    response = vllm.post("/v1/completions", completion(max_tokens=2, stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"finish_reason":"length"' in events[-2]


def test_vllm_decode_runs_plain_requests_and_dies_on_bad_remote_prefill(
    launch: Callable[..., Engine],
) -> None:
    decode = launch("--backend", "vllm", "--mode", "decode")
    ok = decode.post("/v1/completions", completion(max_tokens=2))
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 2

    bad = completion(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": []})
    crash = decode.post("/v1/completions", bad)
    assert crash.status_code == 500
    assert crash.json() == {
        "error": {
            "message": VLLM_DEAD,
            "type": "InternalServerError",
            "code": 500,
        }
    }
    health = decode.get("/health")
    assert health.status_code == 503
    assert "error" in health.json()
    assert decode.post("/v1/completions", completion()).status_code == 500
    assert decode.get("/v1/models").status_code == 200


def test_vllm_prefill_to_decode_handoff(launch: Callable[..., Engine]) -> None:
    prefill = launch("--backend", "vllm", "--mode", "prefill")
    decode = launch("--backend", "vllm", "--mode", "decode")
    leg1 = completion(kv_transfer_params=REMOTE_DECODE)
    params = prefill.post("/v1/completions", leg1).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"]
    assert params["remote_engine_id"]
    leg2 = decode.post("/v1/completions", completion(max_tokens=2, kv_transfer_params=params))
    assert leg2.status_code == 200
    assert leg2.json()["usage"]["completion_tokens"] == 2
    assert decode.get("/health").status_code == 200


def test_vllm_encoder(launch: Callable[..., Engine]) -> None:
    encoder = launch("--backend", "vllm", "--mode", "encode")
    rejected = encoder.post("/v1/completions", completion())
    assert rejected.status_code == 400
    assert rejected.json()["error"] == {
        "message": "This instance is an encoder (ec_producer); text generation is not supported",
        "type": "BadRequestError",
        "code": 400,
    }
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [image]}],
        "max_tokens": 1,
        "stream": False,
    }
    response = encoder.post("/v1/chat/completions", chat)
    assert response.status_code == 200
    assert len(response.json()["choices"]) == 1


def test_vllm_loading_refuses_connections(launch: Callable[..., Engine]) -> None:
    port = free_port()
    engine = launch("--backend", "vllm", "--load-seconds", "1.0", port=port, wait=False)
    refused = 0

    def healthy() -> bool:
        nonlocal refused
        try:
            return engine.get("/health", timeout=1.0).status_code == 200
        except httpx.ConnectError:
            refused += 1
            return False

    wait_for(healthy)
    assert refused > 0


# ---------------------------------------------------------------------------------- SGLang

SGLANG_RANK_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"}
SGLANG_REQUEST_LABELS = {"model_name", "engine_type", "is_streaming"}
SGLANG_REQUEST_COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
)
SGLANG_DECODE_CRASH = "AttributeError: 'NoneType' object has no attribute 'startswith'"
#: --health-check-timeout for tests that make SGLang's /health give up.
HEALTH_TIMEOUT = 0.5


def sglang_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("sglang:")
    ]


def sglang_rank(engine: Engine, rank: int = 0) -> dict[str, float]:
    """One rank's scheduler series, as its dp_rank="<rank>" series say."""
    text = engine.get("/metrics").text
    r = str(rank)
    return {
        "running": sample(text, "sglang:num_running_reqs", dp_rank=r),
        "queue": sample(text, "sglang:num_queue_reqs", dp_rank=r),
        "prefill": sample(text, "sglang:realtime_tokens_total", dp_rank=r, mode="prefill_compute"),
        "decode": sample(text, "sglang:realtime_tokens_total", dp_rank=r, mode="decode"),
        "input": sample(text, "sglang:prefill_effective_tokens_total", dp_rank=r, mode="input"),
        "idle": sample(text, "sglang:scheduler_idle_seconds_total", dp_rank=r),
    }


def sglang_requests(engine: Engine, *, streaming: bool = False) -> dict[str, float]:
    """The tokenizer manager's engine-wide counters (one series per is_streaming value)."""
    text = engine.get("/metrics").text
    flag = "true" if streaming else "false"
    return {name: sample(text, name, is_streaming=flag) for name in SGLANG_REQUEST_COUNTERS}


def timed_get(engine: Engine, path: str, timeout: float = 5.0) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = engine.get(path, timeout=timeout)
    return response, time.monotonic() - start


def test_sglang_happy_path(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang")
    for path in ("/health", "/health_generate"):
        health = engine.get(path)
        assert health.status_code == 200
        assert health.content == b""
    assert engine.get("/model_info").json() == {
        "model_path": "tiny",
        "tokenizer_path": "tiny",
        "is_generation": True,
    }
    assert engine.get("/v1/models").json()["data"][0]["id"] == "tiny"
    body = engine.post("/generate", sglang_generate(max_new_tokens=3)).json()
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
    assert sglang_requests(engine) == {
        "sglang:prompt_tokens_total": 8,
        "sglang:generation_tokens_total": 3,
        "sglang:num_requests_total": 1,
    }
    rank = sglang_rank(engine)
    assert (rank["prefill"], rank["input"], rank["decode"]) == (10, 10, 2)
    assert (rank["running"], rank["queue"]) == (0, 0)


def test_sglang_series_and_labels(launch: Callable[..., Engine]) -> None:
    """The scheduler's series once per rank with its rank labels; the request counters
    engine-wide, without a rank."""
    engine = launch("--backend", "sglang", "--dp-size", "2")
    response = engine.get("/metrics", timeout=5.0)
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
    # The tokenizer manager's count of aborted requests: engine-wide, not split by streaming
    # (labels as measured on SGLang 0.5.23).
    aborted = "sglang:num_aborted_requests_total"
    assert {name for name, _, _ in series} == per_rank | set(SGLANG_REQUEST_COUNTERS) | {aborted}
    families = family_types(response.text)
    assert families["sglang:num_running_reqs"] == "gauge"
    assert families["sglang:realtime_tokens"] == "counter"
    assert families["sglang:prompt_tokens"] == "counter"
    modes = {
        "sglang:realtime_tokens_total": {"prefill_compute", "decode"},
        "sglang:prefill_effective_tokens_total": {"input", "device_hit", "host_hit", "storage_hit"},
    }
    for name, labels, value in series:
        if name in per_rank:
            extra = {"mode"} if name in modes else set()
            assert set(labels) == SGLANG_RANK_LABELS | extra, (name, labels)
            assert labels["engine_type"] == "unified"
            assert (labels["tp_rank"], labels["pp_rank"], labels["moe_ep_rank"]) == ("0", "0", "0")
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
    single = launch("--backend", "sglang", "--mode", "prefill")
    for name, labels, _ in sglang_series(single.get("/metrics").text):
        if name in per_rank:
            assert (labels["dp_rank"], labels["engine_type"]) == ("0", "prefill")
        else:
            assert labels["engine_type"] == "prefill"


def test_sglang_counters_of_a_rank_move_with_its_work_and_requests_count_at_the_end(
    launch: Callable[..., Engine],
) -> None:
    engine = launch("--backend", "sglang", "--dp-size", "2")
    before = [sglang_rank(engine, rank) for rank in (0, 1)]
    body = engine.post("/generate", sglang_generate(max_new_tokens=4, data_parallel_rank=1))
    assert body.status_code == 200
    assert body.json()["meta_info"]["dp_rank"] == 1
    after = [sglang_rank(engine, rank) for rank in (0, 1)]
    # Rank 1 computed the 8-token prompt and 3 decode steps (its first token came with the
    # prefill); rank 0 only idled.
    assert after[1]["prefill"] - before[1]["prefill"] == 8
    assert after[1]["input"] - before[1]["input"] == 8
    assert after[1]["decode"] - before[1]["decode"] == 3
    assert {k: v for k, v in after[0].items() if k != "idle"} == {
        k: v for k, v in before[0].items() if k != "idle"
    }
    assert after[0]["idle"] > before[0]["idle"]
    assert sglang_requests(engine) == {
        "sglang:prompt_tokens_total": 8,
        "sglang:generation_tokens_total": 4,
        "sglang:num_requests_total": 1,
    }

    # A long request: its rank's token counter moves at each step and its idle time stands
    # still; the request counters move only when it finishes.
    engine.fault(latency=1.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(
            engine.post, "/generate", sglang_generate(max_new_tokens=10, data_parallel_rank=0)
        )
        wait_for(lambda: sglang_rank(engine, 0)["decode"] >= 2, timeout=3)
        busy = sglang_rank(engine, 0)
        idle_1 = sglang_rank(engine, 1)["idle"]
        assert busy["running"] == 1
        assert sglang_requests(engine)["sglang:generation_tokens_total"] == 4
        time.sleep(0.15)
        assert sglang_rank(engine, 0)["idle"] == busy["idle"]
        assert sglang_rank(engine, 1)["idle"] > idle_1
        assert running.result(timeout=5).status_code == 200
    engine.fault(latency=0)
    done = sglang_rank(engine, 0)
    assert done["decode"] - before[0]["decode"] == 9
    assert done["running"] == 0
    assert sglang_requests(engine) == {
        "sglang:prompt_tokens_total": 16,
        "sglang:generation_tokens_total": 14,
        "sglang:num_requests_total": 2,
    }
    # A streamed request finishes into the is_streaming="true" series, which then appears.
    streamed = engine.post("/generate", sglang_generate(max_new_tokens=2, stream=True))
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert sglang_requests(engine, streaming=True) == {
        "sglang:prompt_tokens_total": 8,
        "sglang:generation_tokens_total": 2,
        "sglang:num_requests_total": 1,
    }
    assert sglang_requests(engine)["sglang:num_requests_total"] == 2


def test_sglang_metrics_are_gzipped_only_on_request(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang")
    for encoding, gzipped in (
        ("identity", False),
        ("deflate, br", False),
        ("gzip", True),
        ("br, GZip;q=0.5", True),
    ):
        response = httpx.get(
            engine.url + "/metrics", headers={"Accept-Encoding": encoding}, timeout=5.0
        )
        assert response.status_code == 200
        assert response.headers.get("content-encoding") == ("gzip" if gzipped else None), encoding
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert sample(response.text, "sglang:num_running_reqs", dp_rank="0") == 0
    # Without an Accept-Encoding header at all: identity.
    with socket.create_connection((HOST, engine.port), timeout=5) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: fake\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"content-encoding" not in head.lower()
    assert b"sglang:num_running_reqs" in payload


def test_sglang_health_runs_a_generation(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang", "--health-check-timeout", str(HEALTH_TIMEOUT))
    # It takes the engine's latency.
    engine.fault(latency=0.3)
    health, elapsed = timed_get(engine, "/health")
    assert health.status_code == 200
    assert elapsed >= 0.25
    engine.fault(latency=0)

    # Generation hangs: so does /health, until its timeout, then 503 (both routes); the cheap
    # route and the metrics answer at once.
    engine.fault(hang_generation=True)
    for path in ("/health", "/health_generate"):
        health, elapsed = timed_get(engine, path)
        assert health.status_code == 503
        assert health.content == b""
        assert HEALTH_TIMEOUT - 0.05 <= elapsed < HEALTH_TIMEOUT + 2
    models, elapsed = timed_get(engine, "/v1/models")
    assert models.status_code == 200
    assert elapsed < HEALTH_TIMEOUT
    # The checks' generations still wait in the engine (running), not counted as requests.
    assert sglang_rank(engine)["running"] == 2
    assert sglang_requests(engine)["sglang:num_requests_total"] == 0
    assert "Health check failed. Server couldn't get a response" in engine.log.read_text()

    # Released: the held generations finish, and /health passes again.
    engine.fault(hang_generation=False)
    wait_for(lambda: sglang_rank(engine)["running"] == 0)
    assert engine.get("/health").status_code == 200
    assert sglang_rank(engine)["prefill"] == 4  # four health generations of one token each
    assert sglang_requests(engine)["sglang:num_requests_total"] == 0


def test_sglang_health_passes_on_any_output_and_fails_on_a_wedged_rank(
    launch: Callable[..., Engine],
) -> None:
    """SGLang's check waits for any output of the engine since it started: the health
    generation is balanced over the ranks like any request, and on a wedged rank it passes only
    while another rank produces tokens."""
    engine = launch(
        "--backend", "sglang", "--dp-size", "2", "--health-check-timeout", str(HEALTH_TIMEOUT)
    )
    engine.fault(hang_ranks=[1])
    assert engine.get("/health").status_code == 200  # rank 0
    assert engine.get("/health").status_code == 503  # rank 1, nothing else runs
    assert engine.get("/health").status_code == 200  # rank 0
    engine.fault(latency=1.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        slow = pool.submit(
            engine.post, "/generate", sglang_generate(max_new_tokens=10, data_parallel_rank=0)
        )
        wait_for(lambda: rank_state(engine, 0)["running"] == 1)
        assert engine.get("/health").status_code == 200  # rank 1 again, but rank 0 produces
        assert slow.result(timeout=5).status_code == 200
    assert [rank["routed"] for rank in engine.state()["ranks"]] == [3, 2]
    assert rank_state(engine, 1)["in_flight"] == 2  # the two health generations held there
    engine.fault(hang_ranks=[], latency=0)
    wait_for(lambda: rank_state(engine, 1)["in_flight"] == 0)


def test_sglang_decode_bootstrap_rules(launch: Callable[..., Engine]) -> None:
    decode = launch("--backend", "sglang", "--mode", "decode")
    roomless = decode.post("/generate", sglang_generate(rid="canary-42", bootstrap_host="2.2.2.2"))
    assert roomless.status_code == 400
    assert roomless.json() == {
        "error": {
            "message": "Invalid request: Disaggregated request received without bootstrap "
            "room id. req.rid=canary-42"
        }
    }
    fake = sglang_generate(max_new_tokens=2, bootstrap_host="2.2.2.2", bootstrap_room=0)
    ok = decode.post("/generate", fake)
    assert ok.status_code == 200
    assert ok.json()["meta_info"]["completion_tokens"] == 2
    # A decode server computes no prefill (the KV comes from its peer, or the fake transfer);
    # its first token runs no forward pass.
    rank = sglang_rank(decode)
    assert (rank["prefill"], rank["input"], rank["decode"]) == (0, 0, 1)
    assert 'engine_type="decode"' in decode.get("/metrics").text

    # A real peer named on one side only: the request waits in the transfer queue for KV that
    # never comes (not in the waiting queue), until its client leaves.
    real_peer = sglang_generate(bootstrap_host="10.0.0.9", bootstrap_port=8998, bootstrap_room=7)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(decode.post, "/generate", real_peer, timeout=1.5)
        wait_for(lambda: rank_state(decode, 0)["waiting_for_peer"] == 1)
        text = decode.get("/metrics").text
        assert sample(text, "sglang:num_decode_transfer_queue_reqs", dp_rank="0") == 1
        assert sample(text, "sglang:num_queue_reqs", dp_rank="0") == 0
        assert sample(text, "sglang:num_running_reqs", dp_rank="0") == 0
        with pytest.raises(httpx.ReadTimeout):
            waiting.result(timeout=5)
    wait_for(lambda: decode.metric("sglang:num_decode_transfer_queue_reqs") == 0)
    assert decode.get("/health").status_code == 200


def test_sglang_prefill_bootstrap_rules(launch: Callable[..., Engine]) -> None:
    prefill = launch("--backend", "sglang", "--mode", "prefill")
    assert prefill.post("/generate", sglang_generate(bootstrap_host="2.2.2.2")).status_code == 400
    fake = sglang_generate(max_new_tokens=4, bootstrap_host="2.2.2.2", bootstrap_room=3)
    ok = prefill.post("/generate", fake)
    assert ok.status_code == 200
    assert ok.json()["meta_info"]["completion_tokens"] == 1  # prefill ends at its first token
    # With no decode peer connecting, a request waits in the bootstrap queue.
    with pytest.raises(httpx.ReadTimeout):
        prefill.post(
            "/generate",
            sglang_generate(bootstrap_host="10.0.0.9", bootstrap_room=4),
            timeout=HUNG_CLIENT_TIMEOUT,
        )
    wait_for(lambda: prefill.metric("sglang:num_prefill_bootstrap_queue_reqs") == 0)
    assert prefill.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_sglang_decode_request_without_bootstrap_host_kills_the_server(
    launch: Callable[..., Engine], path: str
) -> None:
    decode = launch("--backend", "sglang", "--mode", "decode")
    body = sglang_generate(bootstrap_room=5) if path == "/generate" else completion()
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        decode.post(path, body)
    # SGLang's clean-up kills its own process tree.
    assert decode.proc.wait(timeout=5) == -signal.SIGKILL
    log = decode.log.read_text()
    assert SGLANG_DECODE_CRASH in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    with pytest.raises(httpx.ConnectError):
        decode.get("/v1/models")


def test_sglang_transfer_backend_fake_refused_by_prefill_only(
    launch: Callable[..., Engine], tmp_path: Path
) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    port_file = tmp_path / "prefill.port"
    command = [sys.executable, "-m", "fakeengine", "--port", "0"]
    command += ["--port-file", str(port_file), "--disaggregation-transfer-backend", "fake"]
    refused = subprocess.run(
        [*command, "--backend", "sglang", "--mode", "prefill"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert refused.returncode == 1
    assert "Prefill server does not support 'fake' as the transfer backend" in refused.stderr
    assert not port_file.exists()  # it never listened
    other = subprocess.run(
        [*command, "--backend", "vllm"], capture_output=True, text=True, env=env, timeout=30
    )
    assert other.returncode == 2
    assert "--disaggregation-transfer-backend exists only for --backend sglang" in other.stderr

    decode = launch(
        "--backend", "sglang", "--mode", "decode", "--disaggregation-transfer-backend", "fake"
    )
    assert decode.get("/v1/models").status_code == 200
    prefill = launch(
        "--backend",
        "sglang",
        "--mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "mooncake_tcp",
    )
    assert prefill.get("/v1/models").status_code == 200


def test_sglang_loading_health_503_while_generation_queues(
    launch: Callable[..., Engine],
) -> None:
    engine = launch("--backend", "sglang", "--load-seconds", "0.6")
    assert engine.get("/health").status_code == 503
    assert engine.get("/v1/models").status_code == 200
    assert engine.state()["loading"] is True
    queued = engine.post("/generate", sglang_generate())
    assert queued.status_code == 200
    assert engine.get("/health").status_code == 200


# ----------------------------------------------------------------------------- TensorRT-LLM


def test_trtllm_happy_path(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "trtllm")
    health = engine.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert engine.get("/v1/models").json()["data"][0]["owned_by"] == "tensorrt_llm"
    body = engine.post("/v1/completions", completion(max_tokens=2)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    text = engine.get("/prometheus/metrics").text
    assert metric_value(text, "trtllm_request_success_total") == 1
    assert metric_value(text, "trtllm_prompt_tokens_total") == 8
    engine.fault(health_status=503)
    unhealthy = engine.get("/health")
    assert unhealthy.status_code == 503
    assert unhealthy.text == "LLM is unavailable. Please check the server logs for more details."


def test_trtllm_decode_requires_disaggregated_params(launch: Callable[..., Engine]) -> None:
    decode = launch("--backend", "trtllm", "--mode", "decode")
    plain = decode.post("/v1/completions", completion())
    assert plain.status_code == 400
    assert plain.json() == {
        "error": {
            "message": "Disaggregated params are required for decode mode",
            "type": "BadRequestError",
            "code": 400,
        }
    }
    local = completion(disaggregated_params={"request_type": "context_and_generation"})
    ok = decode.post("/v1/completions", local)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 1

    unknown = decode.post("/v1/completions", completion(disaggregated_params={"request_type": "x"}))
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"] == "Unknown request type: x"
    forged = completion(disaggregated_params={"request_type": "generation_only"})
    assert decode.post("/v1/completions", forged).status_code == 400


def test_trtllm_prefill_context_only(launch: Callable[..., Engine]) -> None:
    prefill = launch("--backend", "trtllm", "--mode", "prefill")
    plain = prefill.post("/v1/completions", completion())
    assert plain.status_code == 400
    assert plain.json()["error"]["message"] == "Disaggregated params are required for prefill mode"
    context = completion(max_tokens=5, disaggregated_params={"request_type": "context_only"})
    body = prefill.post("/v1/completions", context).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    params = choice["disaggregated_params"]
    assert params["request_type"] == "context_only"
    assert isinstance(params["ctx_request_id"], int)
    assert params["encoded_opaque_state"]
    assert len(params["first_gen_tokens"]) == 1


# ---------------------------------------------------------------------- llama.cpp (openai)


def test_openai_happy_path(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "openai")
    for path in ("/health", "/v1/health"):
        response = engine.get(path)
        assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert engine.get("/v1/models").json()["data"][0]["owned_by"] == "llamacpp"
    body = engine.post("/v1/completions", completion(model="anything", max_tokens=2)).json()
    assert body["usage"]["completion_tokens"] == 2
    native = engine.post("/completion", {"prompt": "hi there", "n_predict": 3}).json()
    assert native["tokens_predicted"] == 3
    assert (native["stop"], native["stop_type"]) == (True, "limit")
    assert isinstance(native["content"], str)
    text = engine.get("/metrics").text
    assert metric_value(text, "llamacpp:tokens_predicted_total") == 5
    assert metric_value(text, "llamacpp:prompt_tokens_total") == 10
    assert metric_value(text, "llamacpp:requests_processing") == 0
    assert metric_value(text, "llamacpp:requests_deferred") == 0


def test_openai_loading_503_then_ok(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "openai", "--load-seconds", "0.8")
    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    for path in ("/health", "/v1/models", "/metrics"):
        response = engine.get(path)
        assert (response.status_code, response.json()) == (503, loading)
    assert engine.post("/completion", {"prompt": "hi", "n_predict": 1}).status_code == 503
    wait_for(lambda: engine.get("/health").status_code == 200)
    assert engine.get("/health").json() == {"status": "ok"}
    assert engine.get("/v1/models").status_code == 200


# ----------------------------------------------------------------------------- fault API


def test_hang_generation_keeps_health_green(vllm: Engine) -> None:
    vllm.fault(hang_generation=True)
    with pytest.raises(httpx.ReadTimeout):
        vllm.post("/v1/completions", completion(), timeout=HUNG_CLIENT_TIMEOUT)
    for path in ("/health", "/v1/models", "/metrics"):
        assert vllm.get(path).status_code == 200
    # vLLM aborts a request whose client left (measured): the hung one is gone, uncounted.
    wait_for(lambda: vllm.state()["abandoned"] == {"aborted": 1, "computed": 0})
    assert vllm.metric("vllm:num_requests_running") == 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(vllm.post, "/v1/completions", completion(max_tokens=2))
        wait_for(lambda: vllm.state()["running"] == 1)
        assert not pending.done()
        vllm.fault(hang_generation=False)
        released = pending.result(timeout=5)
    assert released.status_code == 200
    assert released.json()["usage"]["completion_tokens"] == 2
    wait_for(lambda: vllm.state()["running"] == 0)


def test_latency_moves_counters_during_generation(vllm: Engine) -> None:
    vllm.fault(latency=0.6)
    before = vllm.state()["generated_tokens"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        pending = pool.submit(vllm.post, "/v1/completions", completion(max_tokens=6))
        wait_for(lambda: vllm.state()["generated_tokens"] > before)
        assert vllm.state()["generated_tokens"] < before + 6
        assert pending.result(timeout=5).status_code == 200
    assert time.monotonic() - started >= 0.55
    assert vllm.state()["generated_tokens"] == before + 6


@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_garbage(vllm: Engine, kind: str) -> None:
    valid = vllm.post("/v1/completions", completion(max_tokens=2)).content
    vllm.fault(garbage=kind)
    response = vllm.post("/v1/completions", completion(max_tokens=2))
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


def test_garbage_shapes_of_other_backends(launch: Callable[..., Engine]) -> None:
    sglang = launch("--backend", "sglang")
    sglang.fault(garbage="wrong_token_count")
    assert sglang.post("/generate", sglang_generate()).json()["meta_info"]["completion_tokens"] == 2
    sglang.fault(garbage="no_finish_reason")
    assert "finish_reason" not in sglang.post("/generate", sglang_generate()).json()["meta_info"]


def test_injected_errors_dead_and_reset(vllm: Engine) -> None:
    state = vllm.fault(generation_status=429, generation_error="slow down")
    assert state["generation_status"] == 429
    throttled = vllm.post("/v1/completions", completion())
    assert throttled.status_code == 429
    assert throttled.json()["error"]["message"] == "slow down"

    vllm.fault(health_status=503)
    assert vllm.get("/health").status_code == 503
    vllm.fault(health_status=None, generation_status=None, dead=True)
    assert vllm.get("/health").status_code == 503
    assert vllm.post("/v1/completions", completion()).status_code == 500

    reset = vllm.post("/_fake/reset").json()
    assert reset == vllm.get("/_fake/fault").json()
    assert (reset["dead"], reset["hang_generation"], reset["garbage"]) == (False, False, None)
    assert vllm.get("/health").status_code == 200
    assert vllm.post("/v1/completions", completion()).status_code == 200
    assert vllm.post("/_fake/fault", {"garbage": "nonsense"}).status_code == 422


def test_a_fault_answer_says_only_what_it_set(vllm: Engine) -> None:
    """The demo prints the hang command; its answer is the hang, not every fault's value (an
    unrelated generation_error among them). GET /_fake/fault shows them all."""
    assert vllm.fault(hang_generation=True) == {"hang_generation": True}
    assert vllm.fault(hang_generation=False) == {"hang_generation": False}
    assert vllm.fault(latency=0.2, health_status=503) == {"latency": 0.2, "health_status": 503}
    every = vllm.get("/_fake/fault").json()
    assert (every["latency"], every["health_status"], every["hang_generation"]) == (0.2, 503, False)
    assert "generation_error" in every


def test_request_log(vllm: Engine) -> None:
    headers = {"X-Request-Id": "rid-1", "Authorization": "Bearer t", "X-Other": "dropped"}
    vllm.post("/v1/completions", completion(request_id="r1"), headers=headers)
    httpx.post(vllm.url + "/v1/completions", content=b"{oops", timeout=5)
    vllm.get("/health")
    log = vllm.get("/_fake/requests").json()
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
    assert httpx.delete(vllm.url + "/_fake/requests").status_code == 200
    assert vllm.get("/_fake/requests").json() == []


# ------------------------------------------------------------------- wrong answers (any backend)


def test_wrong_answer_keeps_the_shape_but_changes_the_tokens(vllm: Engine) -> None:
    body = completion(max_tokens=3, return_token_ids=True)
    healthy = vllm.post("/v1/completions", body).json()["choices"][0]
    vllm.fault(wrong_answer=True)
    for _ in range(2):
        response = vllm.post("/v1/completions", body)
        assert response.status_code == 200
        answer = response.json()
        assert answer["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 3
        assert all(a != b for a, b in zip(choice["token_ids"], healthy["token_ids"], strict=True))
        assert choice["text"].split() != healthy["text"].split()
        assert len(choice["text"].split()) == 3
    streamed = vllm.post("/v1/completions", completion(max_tokens=3, stream=True))
    pieces = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(pieces) == choice["text"]
    vllm.fault(wrong_answer=False)
    assert vllm.post("/v1/completions", body).json()["choices"][0] == healthy


def test_wrong_answers_counts_down_then_answers_right_again(vllm: Engine) -> None:
    body = completion(max_tokens=2, return_token_ids=True)
    healthy = vllm.post("/v1/completions", body).json()["choices"][0]["token_ids"]
    assert vllm.fault(wrong_answers=1)["wrong_answers"] == 1
    first = vllm.post("/v1/completions", body).json()["choices"][0]["token_ids"]
    assert first != healthy
    assert vllm.get("/_fake/fault").json()["wrong_answers"] == 0
    for _ in range(2):
        assert vllm.post("/v1/completions", body).json()["choices"][0]["token_ids"] == healthy
    vllm.fault(wrong_answers=2)
    answers = [vllm.post("/v1/completions", body).json() for _ in range(3)]
    tokens = [answer["choices"][0]["token_ids"] for answer in answers]
    assert tokens[0] != healthy
    assert tokens[1] != healthy
    assert tokens[2] == healthy
    assert {answer["usage"]["completion_tokens"] for answer in answers} == {2}
    assert vllm.post("/_fake/fault", {"wrong_answers": -1}).status_code == 422


def test_wrong_answer_on_sglang_generate(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang")
    healthy = engine.post("/generate", sglang_generate(max_new_tokens=2)).json()
    engine.fault(wrong_answers=1)
    wrong = engine.post("/generate", sglang_generate(max_new_tokens=2)).json()
    assert wrong["meta_info"] == healthy["meta_info"]
    assert wrong["output_ids"] != healthy["output_ids"]
    assert wrong["text"] != healthy["text"]
    assert engine.post("/generate", sglang_generate(max_new_tokens=2)).json() == healthy


# ---------------------------------------------------------------------- vLLM sleep mode


def sleep_states(engine: Engine) -> dict[str, float]:
    text = engine.get("/metrics").text
    assert family_types(text)["vllm:engine_sleep_state"] == "gauge"
    return {
        state: sample(text, "vllm:engine_sleep_state", sleep_state=state, model_name="tiny")
        for state in ("awake", "weights_offloaded", "discard_all")
    }


AWAKE = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_vllm_sleep_routes_need_dev_mode(vllm: Engine) -> None:
    assert vllm.post("/sleep?level=1").status_code == 404
    assert vllm.post("/wake_up").status_code == 404
    assert vllm.get("/is_sleeping").status_code == 404
    # The gauge is published all the same, as by a real vLLM.
    assert sleep_states(vllm) == AWAKE
    assert vllm.post("/v1/completions", completion()).status_code == 200


def test_dev_mode_is_vllm_only() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fakeengine", "--backend", "sglang", "--dev-mode"]
    refused = subprocess.run(
        [*command, "--port", "0"], capture_output=True, text=True, env=env, timeout=30
    )
    assert refused.returncode == 2
    assert "--dev-mode (sleep mode) exists only for --backend vllm" in refused.stderr


def test_vllm_sleep_holds_requests_until_wake_up(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dev-mode")
    healthy = engine.post("/v1/completions", completion(max_tokens=2)).json()["choices"][0]
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_states(engine) == AWAKE

    asleep = engine.post("/sleep")
    assert (asleep.status_code, asleep.json()) == (200, {"status": "sleeping", "level": 1})
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_states(engine) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    assert engine.get("/health").status_code == 200
    assert engine.get("/v1/models").status_code == 200

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(engine.post, "/v1/completions", completion(max_tokens=2))
        wait_for(lambda: engine.state()["held"] == 1)
        assert not pending.done()
        # The paused engine core publishes nothing: a held request is neither waiting nor
        # running.
        text = engine.get("/metrics").text
        assert sample(text, "vllm:num_requests_waiting") == 0
        assert sample(text, "vllm:num_requests_running") == 0
        assert engine.get("/health").status_code == 200
        woken = engine.post("/wake_up")
        assert woken.status_code == 200
        assert woken.json()["status"] == "awake"
        released = pending.result(timeout=5)
    assert released.status_code == 200
    assert released.json()["choices"][0]["text"] == healthy["text"]
    assert released.json()["usage"]["completion_tokens"] == 2
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_states(engine) == AWAKE

    deep = engine.post("/sleep?level=2")
    assert (deep.status_code, deep.json()) == (200, {"status": "sleeping", "level": 2})
    assert sleep_states(engine) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    assert engine.post("/wake_up?tags=weights&tags=kv_cache").json()["status"] == "awake"
    assert sleep_states(engine) == AWAKE
    # Level 0 only pauses the scheduler: asleep, yet no series of the gauge says so.
    assert engine.post("/sleep?level=0").json() == {"status": "sleeping", "level": 0}
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_states(engine) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert engine.post("/wake_up").json()["status"] == "awake"
    for bad in ("/sleep?level=3", "/sleep?level=x", "/sleep?mode=later"):
        rejected = engine.post(bad)
        assert rejected.status_code == 400, bad
        assert rejected.json()["error"]["code"] == 400
    assert engine.get("/is_sleeping").json() == {"is_sleeping": False}


def test_vllm_sleep_modes_for_requests_in_flight(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dev-mode")
    engine.fault(latency=3.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(engine.post, "/v1/completions", completion(max_tokens=30))
        wait_for(lambda: engine.state()["running"] == 1)
        # mode "abort" (the default): the request in flight ends at once.
        assert engine.post("/sleep?level=1").status_code == 200
        aborted = pending.result(timeout=5)
    assert aborted.status_code == 200
    choice = aborted.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert aborted.json()["usage"]["completion_tokens"] < 30
    text = engine.get("/metrics").text
    assert sample(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 0
    engine.post("/wake_up")

    # mode "wait": the sleep answers once the request in flight has finished normally.
    engine.fault(latency=0.3)
    before = engine.state()["generated_tokens"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(engine.post, "/v1/completions", completion(max_tokens=3))
        wait_for(lambda: engine.state()["running"] == 1)
        assert engine.post("/sleep?mode=wait").json() == {"status": "sleeping", "level": 1}
        state = engine.state()
        assert (state["running"], state["generated_tokens"]) == (0, before + 3)
        finished = pending.result(timeout=5)
    assert finished.json()["choices"][0]["finish_reason"] == "length"
    assert finished.json()["usage"]["completion_tokens"] == 3
    engine.post("/wake_up")


# ------------------------------------------------------------------------ vLLM NIXL transfers


NIXL_COUNTERS = (
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
)
HANDSHAKE_TIMEOUT = 0.4


def nixl_counts(engine: Engine) -> dict[str, float]:
    text = engine.get("/metrics").text
    return {name: sample(text, name + "_total") for name in NIXL_COUNTERS} | {
        "error": sample(text, "vllm:request_success_total", finished_reason="error")
    }


def kv_fetch(engine: Engine) -> dict[str, float]:
    text = engine.get("/metrics").text
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


@pytest.fixture(scope="module")
def shared_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    launcher = Launcher(tmp_path_factory.mktemp("shared-decode"))
    timeout = str(HANDSHAKE_TIMEOUT)
    try:
        yield launcher.start(
            "--backend", "vllm", "--mode", "decode", "--kv-handshake-timeout", timeout
        )
    finally:
        launcher.stop_all()


@pytest.fixture
def decode(shared_decode: Engine) -> Engine:
    assert shared_decode.post("/_fake/reset").status_code == 200
    return shared_decode


def test_nixl_series_on_kv_instances_only(decode: Engine, launch: Callable[..., Engine]) -> None:
    prefill = launch("--backend", "vllm", "--mode", "prefill")
    for engine in (decode, prefill):
        text = engine.get("/metrics").text
        types = family_types(text)
        for name in NIXL_COUNTERS:
            assert types[name] == "counter"
            assert f"# TYPE {name}_total counter" in text
        assert types["vllm:num_requests_kv_fetch_by_stage"] == "gauge"
    assert nixl_counts(prefill) == dict.fromkeys([*NIXL_COUNTERS, "error"], 0.0)
    assert kv_fetch(prefill) == dict.fromkeys(
        ["waiting_to_start", "in_progress", "completed_waiting", "waiting", "deferred", "running"],
        0.0,
    )
    ok = decode.post("/v1/completions", decode_leg())
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 2
    aggregated = launch("--backend", "vllm").get("/metrics").text
    assert "nixl" not in aggregated
    assert "kv_fetch_by_stage" not in aggregated


def test_nixl_peer_killed_fails_the_transfer_at_once(decode: Engine) -> None:
    before = nixl_counts(decode)
    decode.fault(kv_transfer_failure="peer_killed")
    started = time.monotonic()
    failed = decode.post("/v1/completions", decode_leg())
    assert time.monotonic() - started < 1.0
    assert failed.status_code == 500
    assert failed.json() == {
        "error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}
    }
    after = nixl_counts(decode)
    assert after["vllm:nixl_num_failed_transfers"] == before["vllm:nixl_num_failed_transfers"] + 2
    notifications = "vllm:nixl_num_failed_notifications"
    assert after[notifications] == before[notifications] + 1
    assert after["vllm:nixl_num_kv_expired_reqs"] == before["vllm:nixl_num_kv_expired_reqs"]
    assert after["error"] == before["error"] + 1
    # Only transfers fail: health and local requests are fine.
    assert decode.get("/health").status_code == 200
    assert decode.post("/v1/completions", completion()).status_code == 200
    assert kv_fetch(decode)["waiting"] == 0


def test_nixl_handshake_timeout_fails_after_the_timeout(decode: Engine) -> None:
    before = nixl_counts(decode)
    decode.fault(kv_transfer_failure="handshake_timeout")
    started = time.monotonic()
    failed = decode.post("/v1/completions", decode_leg())
    assert time.monotonic() - started >= HANDSHAKE_TIMEOUT
    assert failed.status_code == 500
    assert failed.json()["error"]["message"] == "Internal server error"
    after = nixl_counts(decode)
    assert after["vllm:nixl_num_failed_transfers"] == before["vllm:nixl_num_failed_transfers"] + 2
    notifications = "vllm:nixl_num_failed_notifications"
    assert after[notifications] == before[notifications]
    assert kv_fetch(decode)["deferred"] == 0
    assert decode.get("/health").status_code == 200


def test_nixl_peer_frozen_after_handshake_waits_deferred(decode: Engine) -> None:
    before = nixl_counts(decode)
    decode.fault(kv_transfer_failure="peer_frozen")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(decode.post, "/v1/completions", decode_leg(max_tokens=2))
        wait_for(lambda: kv_fetch(decode)["deferred"] == 1)
        assert kv_fetch(decode) == {
            "waiting_to_start": 0,
            "in_progress": 1,
            "completed_waiting": 0,
            "waiting": 1,
            "deferred": 1,
            "running": 0,
        }
        assert decode.get("/health").status_code == 200
        assert decode.post("/v1/completions", completion()).status_code == 200
        assert not pending.done()
        assert nixl_counts(decode) == before
        # The peer thaws (SIGCONT): the transfer completes and the request is answered.
        decode.fault(kv_transfer_failure="none")
        answered = pending.result(timeout=5)
    assert answered.status_code == 200
    assert answered.json()["usage"]["completion_tokens"] == 2
    assert kv_fetch(decode)["waiting"] == 0
    assert nixl_counts(decode) == before


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


def rank_counts(engine: Engine, rank: int) -> dict[str, float]:
    """A rank's progress counters and finished requests, as its engine="<rank>" series say."""
    text = engine.get("/metrics").text
    engine_label = str(rank)
    counts = {name: sample(text, name, engine=engine_label) for name in RANK_COUNTERS}
    success = sample(
        text, "vllm:request_success_total", engine=engine_label, finished_reason="length"
    )
    return counts | {"success": success}


def rank_state(engine: Engine, rank: int) -> dict[str, Any]:
    return engine.state()["ranks"][rank]


def pinned(rank: object) -> dict[str, str]:
    return {RANK_HEADER: str(rank)}


def test_single_rank_vllm_labels_every_series_engine_0(vllm: Engine) -> None:
    series = vllm_series(vllm.get("/metrics").text)
    assert series
    assert {labels.get("engine") for _, labels, _ in series} == {"0"}
    state = vllm.state()
    assert state["dp_size"] == 1
    assert [rank["rank"] for rank in state["ranks"]] == [0]
    # One rank: rank 0 may be pinned, rank 1 is out of range.
    assert vllm.post("/v1/completions", completion(), headers=pinned(0)).status_code == 200
    assert vllm.post("/v1/completions", completion(), headers=pinned(1)).status_code == 400


def test_vllm_dp_publishes_every_series_once_per_rank(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dp-size", "2")
    assert "backend=vllm mode=aggregated dp-size=2" in engine.log.read_text()
    text = engine.get("/metrics").text
    assert 'vllm:num_requests_running{engine="1",model_name="tiny"} 0.0' in text
    assert 'vllm:prompt_tokens_total{engine="1",model_name="tiny"} 0.0' in text
    line = 'vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny"} 0.0'
    assert line in text
    series = vllm_series(text)
    by_rank: dict[str, set[tuple[str, tuple[tuple[str, str], ...]]]] = {}
    for name, labels, _ in series:
        others = tuple(sorted((k, v) for k, v in labels.items() if k != "engine"))
        by_rank.setdefault(labels["engine"], set()).add((name, others))
    # Only the count of distinct engine values tells the DP size; each rank has the same series.
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
    assert engine.state()["dp_size"] == 2


def test_vllm_dp_header_pins_a_request_and_only_its_rank_moves(
    launch: Callable[..., Engine],
) -> None:
    engine = launch("--backend", "vllm", "--dp-size", "2")
    zero = {name: 0.0 for name in (*RANK_COUNTERS, "success")}
    assert rank_counts(engine, 0) == rank_counts(engine, 1) == zero

    for chat in (False, True):
        before = [rank_counts(engine, rank) for rank in (0, 1)]
        if chat:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            response = engine.post("/v1/chat/completions", body, headers=pinned(1))
        else:
            response = engine.post("/v1/completions", completion(max_tokens=2), headers=pinned(1))
        assert response.status_code == 200
        after = [rank_counts(engine, rank) for rank in (0, 1)]
        assert after[0] == before[0]
        assert (
            after[1]["vllm:generation_tokens_total"]
            == before[1]["vllm:generation_tokens_total"] + 2
        )
        assert after[1]["success"] == before[1]["success"] + 1
        assert after[1]["vllm:prompt_tokens_total"] > before[1]["vllm:prompt_tokens_total"]

    before = [rank_counts(engine, rank) for rank in (0, 1)]
    assert engine.post("/v1/completions", completion(), headers=pinned(0)).status_code == 200
    after = [rank_counts(engine, rank) for rank in (0, 1)]
    assert after[1] == before[1]
    assert after[0]["success"] == before[0]["success"] + 1
    assert after[0]["vllm:prompt_tokens_total"] == before[0]["vllm:prompt_tokens_total"] + 8

    # A body field does not pin (vLLM ignores it), nor does a header that is not an integer:
    # such requests are balanced, so rank 0 gets some of them.
    before = [rank_counts(engine, rank) for rank in (0, 1)]
    for header in ("", "one", None, "1.0"):
        headers = {} if header is None else pinned(header)
        body = completion(data_parallel_rank=1)
        assert engine.post("/v1/completions", body, headers=headers).status_code == 200
    after = [rank_counts(engine, rank) for rank in (0, 1)]
    assert after[0]["success"] > before[0]["success"]
    assert (
        after[0]["success"] + after[1]["success"] == before[0]["success"] + before[1]["success"] + 4
    )
    assert [rank["routed"] for rank in engine.state()["ranks"]] == [
        int(after[0]["success"]),
        int(after[1]["success"]),
    ]


def test_vllm_dp_rank_out_of_range_is_a_400(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dp-size", "2")
    before = [rank_counts(engine, rank) for rank in (0, 1)]
    for rank in (2, 5, -1):
        for path, body in (
            ("/v1/completions", completion()),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            rejected = engine.post(path, body, headers=pinned(rank))
            assert rejected.status_code == 400
            assert rejected.json() == {
                "error": {
                    "message": f"data_parallel_rank {rank} is out of range [0, 2).",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
    assert [rank_counts(engine, rank) for rank in (0, 1)] == before
    assert [rank["routed"] for rank in engine.state()["ranks"]] == [0, 0]


def test_vllm_dp_one_wedged_rank(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "vllm", "--dp-size", "2")
    assert engine.post("/v1/completions", completion(), headers=pinned(1)).status_code == 200
    frozen_text = engine.get("/metrics").text
    frozen = [s for s in vllm_series(frozen_text) if s[1]["engine"] == "1"]
    assert engine.fault(hang_ranks=[1])["hang_ranks"] == [1]
    assert engine.state()["ranks"][1]["hung"] is True
    assert engine.state()["ranks"][0]["hung"] is False

    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(
            engine.post, "/v1/completions", completion(max_tokens=2), headers=pinned(1)
        )
        wait_for(lambda: rank_state(engine, 1)["in_flight"] == 1)
        # A pinned request to the wedged rank is accepted and never answered...
        with pytest.raises(httpx.ReadTimeout):
            engine.post(
                "/v1/completions", completion(), headers=pinned(1), timeout=HUNG_CLIENT_TIMEOUT
            )
        # ...while rank 0 answers, and the server looks healthy.
        ok = engine.post("/v1/completions", completion(max_tokens=2), headers=pinned(0))
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 2
        for path in ("/health", "/v1/models", "/metrics"):
            assert engine.get(path).status_code == 200
        # Balanced requests are sent to the wedged rank too, and those hang.
        outcomes = []
        for _ in range(4):
            try:
                response = engine.post("/v1/completions", completion(), timeout=HUNG_CLIENT_TIMEOUT)
                outcomes.append(response.status_code)
            except httpx.ReadTimeout:
                outcomes.append("hung")
        assert 200 in outcomes
        assert "hung" in outcomes
        # The wedged rank's series stand where they were: gauges too, though requests wait.
        text = engine.get("/metrics").text
        assert [s for s in vllm_series(text) if s[1]["engine"] == "1"] == frozen
        assert sample(text, "vllm:num_requests_running", engine="1") == 0
        assert sample(text, "vllm:num_requests_running", engine="0") == 0
        state = rank_state(engine, 1)
        assert state["hung"] is True
        # Only the held request waits there: vLLM aborts those whose client left (measured).
        wait_for(lambda: rank_state(engine, 1)["in_flight"] == 1)
        assert not held.done()

        # SIGCONT: the held request completes at once and the rank's counters move again.
        assert engine.fault(hang_ranks=[])["hang_ranks"] == []
        released = held.result(timeout=5)
    assert released.status_code == 200
    assert released.json()["usage"]["completion_tokens"] == 2
    wait_for(lambda: rank_state(engine, 1)["in_flight"] == 0)
    assert rank_state(engine, 1)["hung"] is False
    after = engine.get("/metrics").text
    assert sample(after, "vllm:request_success_total", engine="1", finished_reason="length") > (
        sample(frozen_text, "vllm:request_success_total", engine="1", finished_reason="length")
    )
    assert engine.post("/v1/completions", completion(), headers=pinned(1)).status_code == 200


def test_hang_ranks_must_name_existing_ranks(vllm: Engine) -> None:
    refused = vllm.post("/_fake/fault", {"hang_ranks": [1]})
    assert refused.status_code == 422
    assert "[0, 1)" in refused.json()["detail"]
    assert vllm.post("/_fake/fault", {"hang_ranks": [-1]}).status_code == 422
    assert vllm.get("/_fake/fault").json()["hang_ranks"] == []


def test_sglang_dp_rank_field_pins_generate(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang", "--dp-size", "2")

    def finished() -> list[int]:
        return [rank["finished_requests"] for rank in engine.state()["ranks"]]

    body = sglang_generate(max_new_tokens=2, data_parallel_rank=1)
    answer = engine.post("/generate", body)
    assert answer.status_code == 200
    assert answer.json()["meta_info"]["dp_rank"] == 1
    assert finished() == [0, 1]
    answer = engine.post("/generate", sglang_generate(data_parallel_rank=0))
    assert answer.json()["meta_info"]["dp_rank"] == 0
    assert finished() == [1, 1]
    # The request counters stay engine-wide, without a rank label.
    text = engine.get("/metrics").text
    assert sample(text, "sglang:num_requests_total") == 2
    assert sample(text, "sglang:generation_tokens_total") == 3
    assert sample(text, "sglang:realtime_tokens_total", dp_rank="1", mode="decode") == 1
    assert sample(text, "sglang:realtime_tokens_total", dp_rank="0", mode="decode") == 0

    for rank in (2, 5, -1):
        rejected = engine.post("/generate", sglang_generate(data_parallel_rank=rank))
        assert rejected.status_code == 400
        assert rejected.json() == {
            "error": {"message": f"routed_dp_rank={rank} out of range [0, 2)"}
        }
    # Unpinned requests alternate 0, 1, 0, 1.
    ranks = [
        engine.post("/generate", sglang_generate()).json()["meta_info"]["dp_rank"] for _ in range(4)
    ]
    assert ranks == [0, 1, 0, 1]
    # Only /generate's field pins; a header means nothing to SGLang.
    assert engine.post("/v1/completions", completion(), headers=pinned(5)).status_code == 200

    engine.fault(hang_ranks=[0])
    with pytest.raises(httpx.ReadTimeout):
        engine.post("/generate", sglang_generate(data_parallel_rank=0), timeout=HUNG_CLIENT_TIMEOUT)
    assert engine.post("/generate", sglang_generate(data_parallel_rank=1)).status_code == 200
    assert engine.get("/v1/models").status_code == 200
    assert rank_state(engine, 0)["hung"] is True
    engine.fault(hang_ranks=[])
    wait_for(lambda: rank_state(engine, 0)["in_flight"] == 0)


def test_sglang_dp_one_wedged_rank_freezes_its_series(launch: Callable[..., Engine]) -> None:
    engine = launch("--backend", "sglang", "--dp-size", "2")
    assert engine.post("/generate", sglang_generate(data_parallel_rank=1)).status_code == 200

    def of_rank(rank: str) -> list[tuple[str, dict[str, str], float]]:
        return [
            s for s in sglang_series(engine.get("/metrics").text) if s[1].get("dp_rank") == rank
        ]

    engine.fault(hang_ranks=[1])
    frozen = of_rank("1")
    requests_before = sglang_requests(engine)
    with pytest.raises(httpx.ReadTimeout):
        engine.post("/generate", sglang_generate(data_parallel_rank=1), timeout=HUNG_CLIENT_TIMEOUT)
    ok = engine.post("/generate", sglang_generate(max_new_tokens=3, data_parallel_rank=0))
    assert ok.status_code == 200
    time.sleep(0.1)
    # Rank 1's series stand still, idle time included; rank 0's moved; the request counters
    # counted rank 0's request.
    assert of_rank("1") == frozen
    assert rank_state(engine, 1)["in_flight"] == 1
    assert sglang_rank(engine, 0)["decode"] == 2
    requests = sglang_requests(engine)
    assert requests["sglang:num_requests_total"] == requests_before["sglang:num_requests_total"] + 1
    assert requests["sglang:generation_tokens_total"] == (
        requests_before["sglang:generation_tokens_total"] + 3
    )
    engine.fault(hang_ranks=[])
    wait_for(lambda: rank_state(engine, 1)["in_flight"] == 0)
    assert sglang_rank(engine, 1)["prefill"] == 16
    frozen_idle = next(v for n, _, v in frozen if n == "sglang:scheduler_idle_seconds_total")
    assert sglang_rank(engine, 1)["idle"] > frozen_idle


@pytest.mark.parametrize("backend", ["trtllm", "openai"])
def test_dp_size_is_for_vllm_and_sglang_only(backend: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fakeengine", "--backend", backend, "--port", "0"]
    refused = subprocess.run(
        [*command, "--dp-size", "2"], capture_output=True, text=True, env=env, timeout=30
    )
    assert refused.returncode == 2
    assert "usage:" in refused.stderr
    assert "--dp-size 2: data-parallel ranks exist only for --backend vllm and sglang" in (
        refused.stderr
    )
    zero = subprocess.run(
        [*command, "--dp-size", "0"], capture_output=True, text=True, env=env, timeout=30
    )
    assert zero.returncode == 2
