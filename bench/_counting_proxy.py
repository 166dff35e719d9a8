"""A counting HTTP/1.1 proxy on loopback: what reaches the engine, request by request.

The sidecar's ``SIDECAR_ENGINE_URL`` points at the proxy; the proxy opens one connection to the
engine for each connection the sidecar opens, and forwards both directions byte for byte. It
parses only the client's side, request head by request head (``Content-Length`` or chunked
bodies; HTTP/1.1 clients like httpx never pipeline), and notes each request's arrival time,
method, path (without the query) and ``X-data-parallel-rank`` header. The engine's answers pass
through unparsed. A connection the sidecar closes (a canary's deadline) is closed towards the
engine at once, as it would be without the proxy.

It runs on an asyncio loop in a thread of its own, started from the thread that will use it (so
in that thread's network namespace), and listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from tests.support.harness import LOOPBACK

HEAD_LIMIT = 1 << 20


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic() when the request's head arrived
    method: str
    path: str
    rank: str | None  # the X-data-parallel-rank header, if any
    connection: int

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


class CountingProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.seen: list[Seen] = []
        self.errors: list[str] = []
        self.port = 0
        self._connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="counting-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError(f"the counting proxy did not start: {self.errors}")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # --- reading what was seen (from any thread) ------------------------------------------
    def between(self, start: float, end: float) -> list[Seen]:
        return [s for s in list(self.seen) if start <= s.at < end]

    @staticmethod
    def count(seen: Iterable[Seen]) -> Counter[str]:
        return Counter(s.key for s in seen)

    # --- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._client, LOOPBACK, 0, limit=HEAD_LIMIT)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as exc:
            self.errors.append(repr(exc))
        self._ready.set()
        if self._server is not None:
            self._loop.run_forever()
        self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._connections += 1
        number = self._connections
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the engine is not there: the client sees its connection closed
            back = asyncio.create_task(self._pipe(up_reader, writer))
            forth = asyncio.create_task(self._requests(reader, up_writer, number))
            _, pending = await asyncio.wait({back, forth}, return_when=asyncio.FIRST_COMPLETED)
            for other in pending:
                other.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()

    async def _requests(
        self, reader: asyncio.StreamReader, up: asyncio.StreamWriter, number: int
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.monotonic()
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                path = target.split("?", 1)[0]
                rank = headers.get("x-data-parallel-rank")
                self.seen.append(Seen(arrived, method, path, rank, number))
                up.write(head)
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    await self._chunked(reader, up)
                else:
                    length = int(headers.get("content-length", "0") or 0)
                    if length:
                        up.write(await reader.readexactly(length))
                await up.drain()

    async def _chunked(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            up.write(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    up.write(line)
                    if line == b"\r\n":
                        return
            up.write(await reader.readexactly(size + 2))

    # --- end ------------------------------------------------------------------------------
    def close(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(shut(), self._loop)
            with contextlib.suppress(Exception):
                future.result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
