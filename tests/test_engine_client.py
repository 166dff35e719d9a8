"""The engine client (``sidecar/runtime/engine.py``), the sidecar's one I/O boundary, in-process on
a virtual clock: a deadline over the whole answer, a bounded read (also once decompressed), no
redirect followed, every connection it opened closed, a precise reason for every failure, the
API key sent and never shown, and nothing raised to the caller.

The engine is either httpx's ``MockTransport`` (an answer as the test writes it) or the
misbehaving engine's own modes served over an in-memory network (``tests/support/misbehaving.py``:
the bytes a socket would carry, parsed by httpx's own HTTP/1.1 parser). What the whole sidecar
concludes from each misbehaviour: tests/test_engine_misbehaviour.py.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sidecar.core.evidence.result import Outcome
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import Answer, NoAnswer, Received
from sidecar.runtime.engine import USER_AGENT, EngineClient
from tests.support.inprocess import run_virtually, until
from tests.support.misbehaving import CHUNK, HIGH_WATER, MODES, InProcessMisbehaving

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
TIMEOUT = 0.5
MAX_BYTES = 1024 * 1024
CANARY = CanaryRequest(
    "POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, "canary-1", 1
)
Handler = Callable[[httpx.Request], httpx.Response]


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> httpx.Response:
    """An answer as a transport hands it over: a stream not read yet (``content=`` would read it,
    and decode it, before the client does)."""
    return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


def client_of(transport: httpx.AsyncBaseTransport, url: str = URL, **options: Any) -> EngineClient:
    options = {"timeout": TIMEOUT, "max_bytes": MAX_BYTES} | options
    return EngineClient(url, clock=asyncio.get_running_loop().time, transport=transport, **options)


def sent(handler: Handler, request: CanaryRequest = CANARY, **options: Any) -> Received:
    """What ``send`` received from an engine answering with ``handler``."""

    async def main() -> Received:
        client = client_of(httpx.MockTransport(handler), **options)
        try:
            return await client.send(request, TIMEOUT)
        finally:
            await client.aclose()

    return run_virtually(main)


# --- each misbehaviour, on the wire ---------------------------------------------------------------
# mode: (what came back, its outcome or status, a fragment of its reason or content type, seconds)
ON_THE_WIRE: dict[str, tuple[type, Any, str, float]] = {
    "ok": (Answer, 200, "application/json", 0.0),
    "invalid_json": (Answer, 200, "application/json", 0.0),
    "html": (Answer, 502, "text/html", 0.0),
    "html_200": (Answer, 200, "text/html; charset=utf-8", 0.0),
    "empty": (Answer, 200, "application/json", 0.0),
    "truncated": (Answer, 200, "application/json", 0.0),
    "short_body": (
        NoAnswer,
        Outcome.ERROR,
        "connection broke mid-answer: peer closed connection without sending complete message body",
        0.0,
    ),
    "huge": (NoAnswer, Outcome.INVALID, "answer too large (more than 1048576 bytes)", 0.0),
    "huge_declared": (NoAnswer, Outcome.INVALID, "answer too large (Content-Length 52428800)", 0),
    "trickle": (NoAnswer, Outcome.TIMEOUT, "no complete answer within 0.5 s", TIMEOUT),
    "headers_then_silence": (NoAnswer, Outcome.TIMEOUT, "no complete answer within 0.5 s", 0.5),
    "silence": (NoAnswer, Outcome.TIMEOUT, "no complete answer within 0.5 s", TIMEOUT),
    "redirect": (Answer, 302, "", 0.0),
    "reset_mid_body": (NoAnswer, Outcome.ERROR, "connection broke mid-answer: ReadError", 0.05),
    "wrong_content_type": (Answer, 200, "text/plain", 0.0),
    "close_without_answer": (
        NoAnswer,
        Outcome.ERROR,
        "connection broke mid-answer: Server disconnected without sending a response.",
        0.0,
    ),
    "not_http": (NoAnswer, Outcome.ERROR, "connection broke mid-answer: illegal status line", 0),
}


def test_every_mode_has_its_expectation():
    assert set(ON_THE_WIRE) == set(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_what_each_misbehaviour_gives_and_when(mode):
    """Exactly what came back and how long it took (the deadline is over the whole answer:
    bytes that keep coming do not extend it), and every connection closed afterwards, whatever
    the engine did; the redirect's target never reached."""
    kind, what, text, seconds = ON_THE_WIRE[mode]

    async def main() -> None:
        engine = InProcessMisbehaving(mode)
        client = client_of(engine, engine.url)
        try:
            received = await client.send(CANARY, TIMEOUT)
            answer = received.answer
            assert isinstance(answer, kind), answer
            if isinstance(answer, NoAnswer):
                assert answer.outcome is what, answer
                assert answer.reason.startswith(text), answer
            else:
                assert answer.status == what, answer
                assert answer.content_type == text, answer
            assert received.finished - received.started == pytest.approx(seconds, abs=1e-9)
            # The client closed every connection it opened, whatever the engine did; the
            # engine's side then ends (at its next read or write).
            assert all(c.client_gone for c in engine.network.connections)
            await until(lambda: engine.stats()["open_connections"] == 0, 1, 0.01, "the end")
            stats = engine.stats()
            assert stats["generations"] == {mode: 1}
            assert stats["redirect_target_connections"] == 0
        finally:
            await client.aclose()
            await engine.aclose()

    run_virtually(main)


def test_a_flood_is_read_no_further_than_the_bound():
    """An engine that streams 50 MB: the client stops reading just past SIDECAR_MAX_RESPONSE_BYTES
    and closes the connection (the engine's writes then fail)."""

    async def main() -> None:
        engine = InProcessMisbehaving("huge")
        client = client_of(engine, engine.url)
        try:
            got = (await client.send(CANARY, TIMEOUT)).answer
            assert isinstance(got, NoAnswer)
            assert got.outcome is Outcome.INVALID
            (connection,) = engine.network.connections
            assert connection.client_gone
            # It took no more than the bound and what was in flight: the engine's writes wait
            # on a full buffer, and end with the close.
            await until(lambda: engine.stats()["open_connections"] == 0, 1, 0.01, "the end")
            assert connection.delivered <= MAX_BYTES + HIGH_WATER + CHUNK, connection.delivered
        finally:
            await client.aclose()
            await engine.aclose()

    run_virtually(main)


# --- answers as an engine may write them ----------------------------------------------------------


def test_what_goes_on_the_wire():
    """Identity encoding asked, the sidecar named, the request id and the probe's own headers
    sent, the body as JSON."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(200, b"{}", {"Content-Type": "application/json"})

    request = CanaryRequest("POST", "/generate", {"rid": "r"}, "canary-7", 1, {"X-Extra": "1"})
    sent(handler, request)
    (wire,) = seen
    assert (wire.method, wire.url) == ("POST", httpx.URL(f"{URL}/generate"))
    assert wire.headers["accept-encoding"] == "identity"
    assert wire.headers["user-agent"] == USER_AGENT
    assert wire.headers["x-request-id"] == "canary-7"
    assert wire.headers["x-extra"] == "1"
    assert "authorization" not in wire.headers
    assert wire.content == b'{"rid":"r"}'


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate"])
def test_a_compressed_answer_is_read(encoding):
    """Compressed although identity was asked for (prometheus-client's ASGI app does)."""
    plain = b'{"choices": [{"text": " OK"}]}'
    body = gzip.compress(plain) if "gzip" in encoding else zlib.compress(plain)

    def handler(request: httpx.Request) -> httpx.Response:
        return answer(200, body, {"Content-Encoding": encoding})

    got = sent(handler).answer
    assert isinstance(got, Answer)
    assert got.body == plain


@pytest.mark.parametrize(
    ("headers", "body", "reason"),
    [
        (
            {"Content-Encoding": "gzip"},
            gzip.compress(b"x" * (MAX_BYTES + 1)),
            f"answer too large (more than {MAX_BYTES} bytes once decompressed)",
        ),
        ({"Content-Encoding": "gzip"}, b"not gzip at all", "gzip body does not decompress: "),
        ({"Content-Encoding": "br"}, b"...", "Content-Encoding 'br' is not supported"),
    ],
    ids=["bomb", "corrupt", "unsupported"],
)
def test_a_compressed_answer_that_cannot_be_read_is_invalid(headers, body, reason):
    def handler(request: httpx.Request) -> httpx.Response:
        return answer(200, body, headers)

    got = sent(handler).answer
    assert isinstance(got, NoAnswer)
    assert got.outcome is Outcome.INVALID
    assert got.reason.startswith(reason), got.reason


def test_a_refused_connection_is_refused_not_an_error():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    got = sent(handler).answer
    assert got == NoAnswer(Outcome.REFUSED, "cannot connect: [Errno 111] Connection refused")


def test_a_request_httpx_cannot_encode_is_an_answer_not_a_raise():
    """A header value httpx refuses (a non-ASCII one) comes back as a reason; the monitor never
    sees an exception."""
    request = CanaryRequest("POST", "/v1/completions", {}, "canary-1", 1, {"X-Note": "café ☕"})
    got = sent(lambda r: answer(200), request).answer
    assert isinstance(got, NoAnswer)
    assert got.outcome is Outcome.ERROR
    assert got.reason.startswith("cannot send the request: "), got.reason


def test_the_api_key_is_every_requests_bearer_and_scrubbed_from_every_reason():
    key = "sk-hs-0123456789abcdef"
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        raise httpx.ConnectError(f"proxy said: bad key {key}", request=request)

    async def main() -> None:
        client = client_of(httpx.MockTransport(handler), api_key=key)
        try:
            canary = (await client.send(CANARY, TIMEOUT)).answer
            got = await client.get("/health")
            registration = await client.registration("/health")
            metrics = await client.metrics_text("/metrics")
            sleep = await client.sleep_state("/is_sleeping")
            model = await client.served_model()
        finally:
            await client.aclose()
        reasons = [canary.reason, got.reason, registration.reason, metrics[1], sleep[1], model[1]]
        for reason in reasons:
            assert key not in reason, reason
            assert "bad key <hidden>" in reason, reason

    run_virtually(main)
    assert seen == [f"Bearer {key}"] * 6


@pytest.mark.parametrize(
    ("status", "body", "outcome", "reason"),
    [
        (200, b"{}", Outcome.SUCCESS, "GET /health -> 200"),
        (503, b'{"error": "Loading model"}', Outcome.ERROR, "GET /health -> 503: Loading model"),
        (None, b"", Outcome.REFUSED, "GET /health: cannot connect: refused"),
    ],
)
def test_the_registration_check(status, body, outcome, reason):
    def handler(request: httpx.Request) -> httpx.Response:
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return answer(status, body)

    async def main() -> None:
        client = client_of(httpx.MockTransport(handler))
        try:
            result = await client.registration("/health")
        finally:
            await client.aclose()
        assert (result.outcome, result.reason, result.status_code) == (outcome, reason, status)

    run_virtually(main)


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (200, b'{"is_sleeping": true}', (True, "GET /is_sleeping -> is_sleeping true", False)),
        (200, b'{"is_sleeping": false}', (False, "GET /is_sleeping -> is_sleeping false", False)),
        (
            404,
            b"",
            (None, "GET /is_sleeping -> 404: the engine serves no sleep route", True),
        ),
        (200, b"[]", (None, "GET /is_sleeping: no is_sleeping in the answer", False)),
        (500, b"", (None, "GET /is_sleeping -> 500", False)),
    ],
)
def test_the_sleep_route(status, body, said):
    async def main() -> None:
        client = client_of(httpx.MockTransport(lambda r: answer(status, body)))
        try:
            assert await client.sleep_state("/is_sleeping") == said
        finally:
            await client.aclose()

    run_virtually(main)


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (200, b'{"data": [{"id": "tiny"}]}', ("tiny", "GET /v1/models lists a model")),
        (200, b'{"data": []}', (None, "GET /v1/models: no model id in the answer")),
        (200, b'{"data": [{"id": ""}]}', (None, "GET /v1/models: no model id in the answer")),
        (503, b'{"error": "loading"}', (None, "GET /v1/models -> 503: loading")),
    ],
)
def test_the_served_model(status, body, said):
    async def main() -> None:
        client = client_of(httpx.MockTransport(lambda r: answer(status, body)))
        try:
            assert await client.served_model() == said
        finally:
            await client.aclose()

    run_virtually(main)
