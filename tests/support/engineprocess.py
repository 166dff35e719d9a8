"""A fake engine reached in-process as its process would be reached: what a stopped process
(SIGSTOP) does with the requests sent to it, and every request the sidecar sent, arrived or not.

:class:`ProcessLink` is ``tests.support.inprocess.EngineLink`` served as a server serves
(``served=True``: a client that leaves is heard as ``http.disconnect``, the request runs on as
the engine decides), with two more things a process shows:

- stopped whole (:meth:`ProcessLink.freeze`, SIGSTOP), it still accepts connections (the kernel
  does) and keeps what is sent on them; at :meth:`ProcessLink.thaw` (SIGCONT) it reads each such
  request, even one whose client has left meanwhile, and hears that client's disconnect only
  then, as a resumed llama-server does;
- :attr:`ProcessLink.sent` lists every request sent to it, in order, with its virtual time, also
  those a stopped or dead engine never read (what a recording relay in front of a process sees).

:class:`Outliving` hands a link to ``tests.support.inprocess.running`` without giving it away:
the engine outlives the sidecar (``running`` ends the engines it is given), so that a test can
stop the sidecar, resume the engine and read what it did afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.inprocess import EngineLink


@dataclass(frozen=True)
class Sent:
    """One request as the sidecar sent it."""

    at: float  # virtual time
    method: str
    path: str
    headers: Mapping[str, str]


class ProcessLink(EngineLink):
    """A fake engine served in-process as its process would serve (module docstring). Create it
    inside the running loop."""

    def __init__(self, backend: str, mode: str = "aggregated", **config: Any) -> None:
        super().__init__(backend, mode, served=True, **config)
        self.sent: list[Sent] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        loop = asyncio.get_running_loop()
        self.sent.append(
            Sent(loop.time(), request.method, request.url.path, dict(request.headers.items()))
        )
        if self._thawed.is_set() or self.down:
            return await super().handle_async_request(request)
        # Stopped: the kernel accepts the connection and keeps the request for the process.
        await request.aread()
        gone: asyncio.Future[None] = loop.create_future()
        served = asyncio.create_task(self._served_after_thaw(request, gone), name="stopped")
        self._handlers.add(served)
        served.add_done_callback(self._handlers.discard)
        try:
            await asyncio.wait({served, self._killed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left: the request still waits to be read
            if not gone.done():
                gone.set_result(None)
            raise
        if not served.done():  # killed first
            served.cancel()
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        status, headers, body = served.result()
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))

    async def _served_after_thaw(
        self, request: httpx.Request, gone: asyncio.Future[None]
    ) -> tuple[int, list[Any], bytes]:
        """Read at the thaw and run as the engine runs it: its disconnect heard then, if its
        client has gone; what it answers nobody reads."""
        await self._thawed.wait()
        if self.down:
            raise asyncio.CancelledError
        complete: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        status, headers, parts = 500, [], []
        read = False

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": request.content, "more_body": False}
            await asyncio.wait({complete, gone}, return_when=asyncio.FIRST_COMPLETED)
            return {"type": "http.disconnect"}

        async def send(message: Mapping[str, Any]) -> None:
            nonlocal status, headers
            if gone.done():
                return
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False) and not complete.done():
                    complete.set_result(None)

        await self._app(scope_of(request), receive, send)
        return status, headers, b"".join(parts)


def scope_of(request: httpx.Request) -> dict[str, Any]:
    """The ASGI scope of ``request``, as a server on 127.0.0.1 gives it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
        "scheme": request.url.scheme,
        "path": request.url.path,
        "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query,
        "server": (request.url.host, request.url.port),
        "client": ("127.0.0.1", 50000),
        "root_path": "",
    }


class Outliving(httpx.AsyncBaseTransport):
    """``link`` as an engine that outlives the sidecar: the sidecar's end neither thaws nor
    closes it (the test does, with :meth:`EngineLink.aclose`)."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.link.handle_async_request(request)

    def thaw(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
