"""The engine client: the only code that talks to the engine, and only to SIDECAR_ENGINE_URL.

Every call has a deadline over the whole exchange (connect, headers and the complete body), not
just the first byte, and reads at most SIDECAR_MAX_RESPONSE_BYTES (also once decompressed: it
asks for identity encoding, and undoes gzip or deflate when an engine compresses anyway).
Every failure comes back as a result with a precise reason; nothing here raises to the caller.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from typing import Any

import httpx

from sidecar import __version__
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.jsontext import loads as loads_json
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import Answer, Checked, NoAnswer, Received, error_text
from sidecar.redact import redact

__all__ = ["Answer", "EngineClient", "NoAnswer", "error_text"]

USER_AGENT = f"health-sidecar/{__version__}"
# The engine's own routes are read one or two at a time (the registration check and what it
# brings, the metrics read): a small pool never makes one wait. Canaries go through a client of
# their own, whose pool has no limit: one canary per unit, however many units.
CHECK_CONNECTIONS = 6
KEEPALIVE_CONNECTIONS = 3


class BodyTooLarge(Exception):
    pass


class BadEncoding(Exception):
    pass


def _no_answer(exc: Exception, timeout: float) -> NoAnswer:
    if isinstance(exc, TimeoutError):
        return NoAnswer(Outcome.TIMEOUT, f"no complete answer within {timeout:g} s")
    if isinstance(exc, BodyTooLarge):
        return NoAnswer(Outcome.INVALID, f"answer too large ({exc})")
    if isinstance(exc, BadEncoding):
        return NoAnswer(Outcome.INVALID, str(exc))
    detail = str(exc) or str(exc.__cause__ or "") or type(exc).__name__
    if isinstance(exc, httpx.ConnectError):
        return NoAnswer(Outcome.REFUSED, f"cannot connect: {detail}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return NoAnswer(Outcome.ERROR, f"connection broke mid-answer: {detail}")
    if isinstance(exc, httpx.TransportError):
        return NoAnswer(Outcome.ERROR, f"{type(exc).__name__}: {detail}")
    return NoAnswer(Outcome.ERROR, f"cannot send the request: {type(exc).__name__}: {detail}")


def _decode(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo a Content-Encoding the engine applied although identity was asked for (prometheus
    client's ASGI app gzips whenever it likes), reading at most ``limit`` bytes of the result."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise BadEncoding(f"Content-Encoding {encoding!r} is not supported")
    wbits = zlib.MAX_WBITS | 16 if "gzip" in encoding else zlib.MAX_WBITS
    try:
        inflater = zlib.decompressobj(wbits)
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadEncoding(f"{encoding} body does not decompress: {exc}") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise BodyTooLarge(f"more than {limit} bytes once decompressed")
    if not inflater.eof:  # the compressed stream ended early: its prefix is not the answer
        raise BadEncoding(f"{encoding} body does not decompress: the stream is cut short")
    return plain


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        max_bytes: int,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
        connections: int | None = CHECK_CONNECTIONS,
    ) -> None:
        """``transport``: httpx's own (None), or an in-process one for tests (an ASGI app's, a
        mock's). ``connections``: the most open at once (None: no limit, for canaries, at most
        one per unit, whose client must never make one wait for another)."""
        # Identity encoding: the sidecar reads bodies with a byte bound, and a compressed body
        # would need decompressing anyway (see _decode for engines that compress regardless).
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        self._secret = api_key or None
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.clock = clock
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            follow_redirects=False,
            trust_env=False,  # no proxies from the environment: requests go to the engine only
            # Only SIDECAR_ENGINE_URL is ever requested: for http:// no TLS happens, so skip
            # building the default SSL context (the CA bundle costs about 3 MiB).
            verify=not base_url.startswith("http://"),
            # No request ever waits for a connection: a request cancelled by its deadline while
            # it waits leaves the connection it was being given stuck in httpcore's pool
            # (encode/httpcore#1093), and once every one is stuck nothing reaches the engine.
            limits=httpx.Limits(
                max_connections=connections, max_keepalive_connections=KEEPALIVE_CONNECTIONS
            ),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def redact(self, text: str) -> str:
        """Every reason the sidecar serves or logs comes through here: an engine or gateway that
        echoes the bearer token in its error text must not publish it."""
        return redact(text, (self._secret,))

    async def _exchange(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> Answer | NoAnswer:
        """One request with a deadline over the whole answer (``deadline`` seconds, else the
        client's timeout), and a bounded read."""
        seconds = self.timeout if deadline is None else deadline
        try:
            return await self._read(method, path, json_body, headers, seconds)
        except (
            TimeoutError,
            BodyTooLarge,
            BadEncoding,
            httpx.HTTPError,
            httpx.InvalidURL,
            ValueError,
        ) as exc:
            # ValueError: a body or header httpx cannot encode. Never let one kill the monitor.
            return _no_answer(exc, seconds)

    async def _read(
        self,
        method: str,
        path: str,
        json_body: Any,
        headers: dict[str, str] | None,
        seconds: float,
    ) -> Answer:
        async with asyncio.timeout(seconds):
            request = self._http.build_request(
                method, path, json=json_body, headers=headers, timeout=httpx.Timeout(seconds)
            )
            response = await self._http.send(request, stream=True)
            try:
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > self.max_bytes:
                    raise BodyTooLarge(f"Content-Length {declared}")
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise BodyTooLarge(f"more than {self.max_bytes} bytes")
                    chunks.append(chunk)
            finally:
                await response.aclose()
        body = _decode(
            b"".join(chunks), response.headers.get("content-encoding", ""), self.max_bytes
        )
        return Answer(
            response.status_code,
            response.headers.get("content-type", ""),
            body,
            response.headers.get("location"),
        )

    async def get(self, path: str) -> Answer | NoAnswer:
        """GET a route: its answer, or why none came (with secrets scrubbed from the reason)."""
        answer = await self._exchange("GET", path)
        if isinstance(answer, NoAnswer):
            return NoAnswer(answer.outcome, self.redact(f"GET {path}: {answer.reason}"))
        return answer

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        """Send one request a probe built (a canary, an abort, a check) with its own deadline
        over the whole answer: what came back, judged by nobody here; the reason of a missing
        answer has secrets scrubbed."""
        headers = dict(request.headers)
        if request.request_id:
            headers["X-Request-Id"] = request.request_id
        started = self.clock()
        answer = await self._exchange(
            request.method,
            request.path,
            json_body=request.body or None,
            headers=headers,
            deadline=deadline,
        )
        if isinstance(answer, NoAnswer):
            answer = NoAnswer(answer.outcome, self.redact(answer.reason))
        return Received(answer, started, self.clock(), time.time())

    async def registration(self, path: str, *, any_status: bool = False) -> Result:
        """Check the engine's own cheapest "up and model loaded" route; with ``any_status``, any
        answer below 500 says it is up (an engine that serves no cheap route answering 200)."""
        started = self.clock()

        def result(outcome: Outcome, reason: str, status: int | None = None) -> Result:
            return Result(
                outcome, self.redact(reason), started, self.clock(), time.time(), "", status
            )

        answer = await self._exchange("GET", path)
        if isinstance(answer, NoAnswer):
            return result(answer.outcome, f"GET {path}: {answer.reason}")
        if answer.status == 200:
            return result(Outcome.SUCCESS, f"GET {path} -> 200", 200)
        if any_status and answer.status < 500:
            return result(
                Outcome.SUCCESS, f"GET {path} -> {answer.status} (it answers: up)", answer.status
            )
        text = error_text(answer.body)
        return result(Outcome.ERROR, f"GET {path} -> {answer.status}: {text}", answer.status)

    async def answers(self, path: str, deadline: float) -> bool:
        """Whether ``path`` answers at all (any status) within ``deadline``: the engine's HTTP
        side is alive."""
        got = await self._exchange("GET", path, deadline=deadline)
        return not isinstance(got, NoAnswer)

    async def metrics_text(self, path: str) -> tuple[str | None, str]:
        """(text, reason): the engine's Prometheus exposition, or None and why not."""
        answer = await self._exchange("GET", path)
        if isinstance(answer, NoAnswer):
            return None, self.redact(f"GET {path}: {answer.reason}")
        if answer.status != 200:
            return None, f"GET {path} -> {answer.status}"
        return answer.body.decode("utf-8", "replace"), f"GET {path} -> 200"

    async def sleep_state(self, path: str) -> tuple[bool | None, str, bool]:
        """(sleeping, reason, missing): what the engine's sleep route says; sleeping is None
        without a usable answer, and ``missing`` is True when the route does not exist (404)."""
        answer = await self._exchange("GET", path)
        if isinstance(answer, NoAnswer):
            return None, self.redact(f"GET {path}: {answer.reason}"), False
        if answer.status == 404:
            return None, f"GET {path} -> 404: the engine serves no sleep route", True
        if answer.status != 200:
            return None, f"GET {path} -> {answer.status}", False
        try:
            sleeping = loads_json(answer.body).get("is_sleeping")
        except (ValueError, AttributeError):
            sleeping = None
        if not isinstance(sleeping, bool):
            return None, f"GET {path}: no is_sleeping in the answer", False
        return sleeping, f"GET {path} -> is_sleeping {str(sleeping).lower()}", False

    async def served_model(self) -> tuple[str | None, str]:
        """(model, reason): the first model GET /v1/models lists, or None and why not."""
        path = "/v1/models"
        answer = await self._exchange("GET", path)
        if isinstance(answer, NoAnswer):
            return None, self.redact(f"GET {path}: {answer.reason}")
        if answer.status != 200:
            return None, self.redact(f"GET {path} -> {answer.status}: {error_text(answer.body)}")
        try:
            data = loads_json(answer.body).get("data")
            model = data[0]["id"]
        except (ValueError, AttributeError, LookupError, TypeError):
            return None, f"GET {path}: no model id in the answer"
        if not isinstance(model, str) or not model:
            return None, f"GET {path}: no model id in the answer"
        return self.redact(model), f"GET {path} lists a model"


class RouteRegistration:
    """The registration check (:class:`~sidecar.probes.exchange.Registration`) of an engine's
    HTTP route: :meth:`EngineClient.registration`, once per interval (the client is the
    wiring's)."""

    def __init__(self, client: EngineClient, path: str, *, any_status: bool) -> None:
        self.client, self.path, self.any_status = client, path, any_status

    async def __call__(self) -> Checked:
        return Checked(await self.client.registration(self.path, any_status=self.any_status))

    async def aclose(self) -> None:
        """Nothing of its own."""
