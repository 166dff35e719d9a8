"""A misbehaving engine: a raw asyncio HTTP/1.1 server that breaks the protocol on purpose.

Run as a real process (``python -m tests.support.misbehaving --port 0 --port-file F --mode MODE``).
It
answers the registration routes like a healthy engine (``GET /health`` 200, ``GET /v1/models``
one model) and misbehaves on generation requests (``POST /v1/completions``, ``/generate``,
``/v1/chat/completions``) as its current mode says. Every response closes its connection.

Control routes (same port):

- ``POST /mode/<name>``: switch the mode at runtime (404 for an unknown name);
- ``GET /stats``: the mode, generation requests per mode, connections open and in total, and
  connections to the redirect target;
- ``GET /requests``: the last requests (method, path and a few headers, Host included).

The redirect mode points at a second listener on another loopback port, which answers a
*valid* completion and counts its connections: a client that followed the redirect would pass.
Every connection is held at most ``MAX_HOLD`` seconds, so the process never waits forever on a
client that went away without closing. Nothing here binds anything but the given loopback host.

The same engine also serves in-process (:class:`InProcessMisbehaving`), over an in-memory network
in place of TCP: its modes write the same bytes through asyncio's ``StreamWriter``, and the
client's side is an httpcore network stream under httpx's own transport, so that what the
sidecar's engine client parses is what a socket would carry, with httpx's own HTTP/1.1 parser
and its own exceptions. What the kernel does with a connection is modelled (a FIN after the
bytes sent, a RST once SO_LINGER 0 is set, a peer's writes failing once its client has gone,
buffers that fill and make the writer wait); the kernel itself, its sockets and their states
are only there when it runs as a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import httpx

from tests.support.processes import Process, read_port_file

LOOPBACK = "127.0.0.1"
MODEL = "misbehaving-model"
HUGE_BYTES = 50 * 1024 * 1024  # more than SIDECAR_MAX_RESPONSE_BYTES can ever be (64 MiB max)
CHUNK = 64 * 1024
TRICKLE_INTERVAL = 0.1
MAX_HOLD = 300.0  # the longest any connection is kept open ("forever", for a test)
MAX_HEAD = 64 * 1024
MAX_BODY = 1024 * 1024
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
RECORDED_HEADERS = ("host", "authorization", "user-agent", "x-request-id", "content-type")
HTML_PAGE = (
    b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>"
    b"<center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>"
)

# Each misbehaviour, and "ok" (a valid completion: the negative control).
MODES: tuple[str, ...] = (
    "ok",
    "invalid_json",  # 200 application/json, not JSON
    "html",  # 502 text/html: a proxy's error page
    "html_200",  # 200 text/html: an HTML page where JSON was expected
    "empty",  # 200 application/json, Content-Length 0
    "truncated",  # 200, a complete HTTP message whose JSON is cut in half
    "short_body",  # 200, Content-Length promises more than is sent, then FIN
    "huge",  # 200, chunked, HUGE_BYTES of body
    "huge_declared",  # 200, Content-Length HUGE_BYTES, body streamed
    "trickle",  # 200 headers, then one body byte every 100 ms, forever
    "headers_then_silence",  # 200 headers (Content-Length 100), then nothing
    "silence",  # reads the request, never answers
    "redirect",  # 302 to the redirect target on another loopback port
    "reset_mid_body",  # headers and part of the body, then RST (SO_LINGER 0)
    "wrong_content_type",  # a valid completion, served as text/plain
    "close_without_answer",  # reads the request, closes without a byte
    "not_http",  # answers bytes that are not HTTP, then closes
)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Stats:
    mode: str
    generations: Counter[str] = field(default_factory=Counter)
    open_connections: int = 0
    total_connections: int = 0
    redirect_target_connections: int = 0
    redirect_port: int = 0
    requests: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=2000))

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "generations": dict(self.generations),
            "generation_total": sum(self.generations.values()),
            "open_connections": self.open_connections,
            "total_connections": self.total_connections,
            "redirect_target_connections": self.redirect_target_connections,
            "redirect_port": self.redirect_port,
            "pid": os.getpid(),
        }


class BadRequest(Exception):
    pass


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One HTTP/1.1 request (Content-Length bodies only); None on a clean EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise BadRequest("incomplete request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest("request head too large") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        raise BadRequest("bad request line") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest("bad header line")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or "0")
    if length < 0 or length > MAX_BODY:
        raise BadRequest("bad Content-Length")
    body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), target.split("?", 1)[0], headers, body)


def head(status: str, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers), "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return head(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))]) + body


def completion(request: Request) -> bytes:
    """A well-formed OpenAI completion generating exactly the tokens asked for."""
    try:
        asked = json.loads(request.body or b"{}")
    except ValueError:
        asked = {}
    tokens = asked.get("max_tokens", 1) if isinstance(asked, dict) else 1
    tokens = tokens if isinstance(tokens, int) and tokens > 0 else 1
    body = {
        "id": "cmpl-misbehaving",
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {"index": 0, "text": " OK" * tokens, "logprobs": None, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
    }
    return json.dumps(body).encode()


class Engine:
    def __init__(self, mode: str, host: str) -> None:
        self.stats = Stats(mode)
        self.host = host
        self.handlers: dict[str, Callable[..., Awaitable[None]]] = {
            name: getattr(self, f"_{name}") for name in MODES
        }

    # --- connection handling --------------------------------------------------------------------
    async def serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.stats.open_connections += 1
        self.stats.total_connections += 1
        try:
            async with asyncio.timeout(MAX_HOLD):
                await self._one_exchange(reader, writer)
        except (OSError, BadRequest, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.stats.open_connections -= 1
            writer.transport.abort()

    async def _one_exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await read_request(reader)
        if request is None:
            return
        kept = {k: request.headers[k] for k in RECORDED_HEADERS if k in request.headers}
        self.stats.requests.append(
            {"time": time.time(), "method": request.method, "path": request.path, "headers": kept}
        )
        if request.method == "POST" and request.path in GENERATION_PATHS:
            mode = self.stats.mode
            self.stats.generations[mode] += 1
            await self.handlers[mode](request, reader, writer)
            return
        writer.write(self._control(request))
        await writer.drain()
        writer.close()  # FIN after the answer, not RST
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    def _control(self, request: Request) -> bytes:
        path, method = request.path, request.method
        if method == "GET" and path == "/health":
            return response("200 OK", b"{}")
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            return response("200 OK", json.dumps(models).encode())
        if method == "GET" and path == "/stats":
            return response("200 OK", json.dumps(self.stats.as_json()).encode())
        if method == "GET" and path == "/requests":
            return response("200 OK", json.dumps(list(self.stats.requests)).encode())
        if method == "POST" and path.startswith("/mode/"):
            name = path.removeprefix("/mode/")
            if name not in MODES:
                return response("404 Not Found", json.dumps({"error": f"no mode {name}"}).encode())
            self.stats.mode = name
            return response("200 OK", json.dumps({"mode": name}).encode())
        return response("404 Not Found", b'{"error": "not found"}')

    @staticmethod
    async def _until_eof(reader: asyncio.StreamReader) -> None:
        """Wait until the client closes its side (or the hold cap ends the connection)."""
        while await reader.read(CHUNK):
            pass

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, *, close: bool = True) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    # --- modes ----------------------------------------------------------------------------------
    async def _ok(self, request: Request, reader: asyncio.StreamReader, writer: Any) -> None:
        await self._send(writer, response("200 OK", completion(request)))

    async def _invalid_json(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, response("200 OK", b'{"choices": [{"text": oops, }'))

    async def _html(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, response("502 Bad Gateway", HTML_PAGE, "text/html"))

    async def _html_200(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, response("200 OK", HTML_PAGE, "text/html; charset=utf-8"))

    async def _empty(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, response("200 OK", b""))

    async def _truncated(self, request: Request, reader: Any, writer: Any) -> None:
        whole = completion(request)
        await self._send(writer, response("200 OK", whole[: len(whole) // 2]))

    async def _short_body(self, request: Request, reader: Any, writer: Any) -> None:
        whole = completion(request)
        framing = [("Content-Type", "application/json"), ("Content-Length", str(len(whole)))]
        await self._send(writer, head("200 OK", framing) + whole[: len(whole) // 2])

    async def _stream_huge(self, writer: asyncio.StreamWriter, *, chunked: bool) -> None:
        opening = b'{"choices": [{"text": "'
        block = opening + b"x" * (CHUNK - len(opening))
        sent = 0
        while sent < HUGE_BYTES:
            data = block if sent == 0 else b"x" * CHUNK
            writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            await writer.drain()  # raises once the client has gone
            sent += len(data)
        if chunked:
            writer.write(b"0\r\n\r\n")
        await self._send(writer, b"")

    async def _huge(self, request: Request, reader: Any, writer: Any) -> None:
        framing = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
        writer.write(head("200 OK", framing))
        await self._stream_huge(writer, chunked=True)

    async def _huge_declared(self, request: Request, reader: Any, writer: Any) -> None:
        framing = [("Content-Type", "application/json"), ("Content-Length", str(HUGE_BYTES))]
        writer.write(head("200 OK", framing))
        await self._stream_huge(writer, chunked=False)

    async def _trickle(self, request: Request, reader: asyncio.StreamReader, writer: Any) -> None:
        framing = [("Content-Type", "application/json"), ("Content-Length", "1000000")]
        await self._send(writer, head("200 OK", framing), close=False)
        gone = asyncio.ensure_future(self._until_eof(reader))
        try:
            while not gone.done():
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait([gone], timeout=TRICKLE_INTERVAL)
        finally:
            gone.cancel()

    async def _headers_then_silence(
        self, request: Request, reader: asyncio.StreamReader, writer: Any
    ) -> None:
        framing = [("Content-Type", "application/json"), ("Content-Length", "100")]
        await self._send(writer, head("200 OK", framing), close=False)
        await self._until_eof(reader)

    async def _silence(self, request: Request, reader: asyncio.StreamReader, writer: Any) -> None:
        await self._until_eof(reader)

    async def _redirect(self, request: Request, reader: Any, writer: Any) -> None:
        where = f"http://{self.host}:{self.stats.redirect_port}{request.path}"
        framing = [("Location", where), ("Content-Length", "0")]
        await self._send(writer, head("302 Found", framing))

    async def _reset_mid_body(self, request: Request, reader: Any, writer: Any) -> None:
        framing = [("Content-Type", "application/json"), ("Content-Length", "4096")]
        await self._send(writer, head("200 OK", framing) + b'{"choices": [{"te', close=False)
        await asyncio.sleep(0.05)  # let the client read the headers: the reset is mid-body
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # close() with SO_LINGER 0: the kernel sends RST

    async def _wrong_content_type(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, response("200 OK", completion(request), "text/plain"))

    async def _close_without_answer(self, request: Request, reader: Any, writer: Any) -> None:
        writer.close()

    async def _not_http(self, request: Request, reader: Any, writer: Any) -> None:
        await self._send(writer, b"SSH-2.0-OpenSSH_9.6\r\nthis is not HTTP\r\n\r\n")

    # --- the redirect target --------------------------------------------------------------------
    async def serve_redirect_target(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.stats.redirect_target_connections += 1
        try:
            async with asyncio.timeout(5):
                request = await read_request(reader)
                if request is not None:
                    await self._send(writer, response("200 OK", completion(request)))
        except (OSError, BadRequest, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.transport.abort()


def write_port_file(path: Path, port: int) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(port))
    partial.replace(path)


async def run(args: argparse.Namespace) -> int:
    engine = Engine(args.mode, args.host)
    target = await asyncio.start_server(engine.serve_redirect_target, args.host, 0)
    engine.stats.redirect_port = target.sockets[0].getsockname()[1]
    server = await asyncio.start_server(
        engine.serve_connection, args.host, args.port, limit=MAX_HEAD, backlog=1024
    )
    port = server.sockets[0].getsockname()[1]
    if args.port_file is not None:
        write_port_file(args.port_file, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server, target:
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.misbehaving", description=__doc__
    )
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, required=True, help="0 lets the OS pick a port")
    parser.add_argument("--port-file", type=Path, help="write the bound port here (atomically)")
    parser.add_argument("--mode", choices=MODES, default="ok")
    return asyncio.run(run(parser.parse_args(argv)))


class MisbehavingEngine(Process):
    """The test side: ``python -m tests.support.misbehaving`` started as a real process (at
    once), its mode switched, its stats read. Ended by its process group in :meth:`close`."""

    start_timeout = 10.0
    ready_interval = 0.02

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.name = f"misbehaving-{mode}"
        self.initial_mode = mode
        try:
            self.start()
        except AssertionError:
            self.close()
            raise

    @property
    def port_file(self) -> Path:
        return self.workdir / "port"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tests.support.misbehaving", "--host", LOOPBACK]
        argv += ["--port", str(self.port), "--port-file", str(self.port_file)]
        return [*argv, "--mode", self.initial_mode]

    def ready(self) -> bool:
        return read_port_file(self.port_file) == self.port

    def set_mode(self, mode: str) -> None:
        answer = self.http.post(f"{self.url}/mode/{mode}")
        answer.raise_for_status()

    def stats(self) -> dict[str, Any]:
        return self.http.get(f"{self.url}/stats").json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.url}/requests").json()


# --- in-process: the same engine over an in-memory network ---------------------------------------
#: What the peer may hold unread before the engine's writes wait (a socket's send and receive
#: buffers); a writer waiting resumes once the reader has taken all but LOW_WATER of it.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
PORT = 8000  # the in-memory network's engine port (its redirect target: PORT + 1)


class _Linger:
    """What ``transport.get_extra_info("socket")`` gives a mode: SO_LINGER is all it sets."""

    def __init__(self, transport: _EngineSide) -> None:
        self._transport = transport

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        if (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER):
            on, seconds = struct.unpack("ii", value)
            self._transport.linger_zero = bool(on) and seconds == 0


class _EngineSide(asyncio.Transport):
    """The engine's end of an in-memory connection, as asyncio's socket transport behaves: a
    write goes to the client's buffer, ``close`` sends FIN after it, ``abort`` closes at once
    (FIN, or RST with SO_LINGER 0, as the kernel does)."""

    def __init__(self, connection: Connection) -> None:
        super().__init__()
        self._connection = connection
        self.linger_zero = False
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return _Linger(self)
        if name == "peername":
            return (LOOPBACK, 50000)
        return default

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._connection.engine_wrote(bytes(data))

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closing:
            self._connection.engine_closed(reset=False)

    def abort(self) -> None:
        if not self.closing:
            self._connection.engine_closed(reset=self.linger_zero)

    def get_write_buffer_size(self) -> int:
        return len(self._connection.to_client)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self.closing


class Connection:
    """One TCP connection in memory between the sidecar's engine client and the engine."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.to_client = bytearray()
        self.readable = asyncio.Event()  # something for the client: bytes, a FIN, a RST
        self.fin = False  # the engine closed after what it sent
        self.reset = False  # RST: what was unread is gone, every read and write fails
        self.client_gone = False
        self.delivered = 0  # bytes the engine's writes handed to the client's side
        self._paused = False
        self._lost = False
        self.reader = asyncio.StreamReader(limit=MAX_HEAD, loop=loop)
        self.protocol = asyncio.StreamReaderProtocol(self.reader, loop=loop)
        self.transport = _EngineSide(self)
        self.protocol.connection_made(self.transport)
        self.writer = asyncio.StreamWriter(self.transport, self.protocol, self.reader, loop)

    # --- the engine's end -------------------------------------------------------------------
    def engine_wrote(self, data: bytes) -> None:
        if self.transport.closing or not data:
            return
        if self.client_gone or self.reset:  # the client's kernel answers with RST: EPIPE
            self._lose(ConnectionResetError(104, "Connection reset by peer"))
            return
        self.to_client += data
        self.delivered += len(data)
        self.readable.set()
        if not self._paused and len(self.to_client) > HIGH_WATER:
            self._paused = True
            self.protocol.pause_writing()

    def engine_closed(self, *, reset: bool) -> None:
        if reset:
            self.to_client.clear()
            self.reset = True
        else:
            self.fin = True
        self.readable.set()
        self._lose(None)

    def _lose(self, exc: Exception | None) -> None:
        self.transport.closing = True
        if not self._lost:
            self._lost = True
            self.loop.call_soon(self.protocol.connection_lost, exc)

    # --- the client's end -------------------------------------------------------------------
    def client_read(self, max_bytes: int) -> bytes | None:
        """Bytes for the client; b"" at the engine's FIN; None when there is nothing yet."""
        if self.reset:  # anyio's BrokenResourceError, as httpcore maps it: no message
            raise httpcore.ReadError("")
        if self.to_client:
            data = bytes(self.to_client[:max_bytes])
            del self.to_client[:max_bytes]
            if self._paused and len(self.to_client) <= LOW_WATER:
                self._paused = False
                self.protocol.resume_writing()
            return data
        if self.fin:
            return b""
        self.readable.clear()
        return None

    def client_wrote(self, data: bytes) -> None:
        if self.reset:
            raise httpcore.WriteError("")
        if not self.transport.closing and data:
            self.protocol.data_received(data)

    def client_closed(self) -> None:
        if self.client_gone:
            return
        self.client_gone = True
        if self._lost:
            return
        if self.to_client:  # closed with bytes unread: the kernel sends RST, not FIN
            self.to_client.clear()
            self._lose(ConnectionResetError(104, "Connection reset by peer"))
        else:
            self.protocol.eof_received()


class _ClientSide(httpcore.AsyncNetworkStream):
    """The client's end, as httpcore's socket stream behaves (per-call timeouts are left to the
    caller's own deadline: on a virtual clock they would tie with it, where a real clock has the
    whole-answer deadline first)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        while True:
            data = self._connection.client_read(max_bytes)
            if data is not None:
                return data
            await self._connection.readable.wait()

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self._connection.client_wrote(bytes(buffer))

    async def aclose(self) -> None:
        self._connection.client_closed()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            connection = self._connection
            return bool(connection.to_client) or connection.fin or connection.reset
        return None


class MemoryNetwork(httpcore.AsyncNetworkBackend):
    """Loopback in memory: the engine's port and its redirect target's; any other refused."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tasks: set[asyncio.Task[None]] = set()  # the engine's connections being served
        self.connections: list[Connection] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        served = {
            PORT: self.engine.serve_connection,
            self.engine.stats.redirect_port: self.engine.serve_redirect_target,
        }
        handler = served.get(port) if host == LOOPBACK else None
        if handler is None:
            raise httpcore.ConnectError("[Errno 111] Connection refused")
        connection = Connection()
        self.connections.append(connection)
        task = asyncio.create_task(handler(connection.reader, connection.writer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return _ClientSide(connection)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("no unix sockets here")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class InProcessMisbehaving(httpx.AsyncBaseTransport):
    """The misbehaving engine in-process (create it inside the running loop), reached at
    :attr:`url` through this transport: httpx's own HTTP transport over a
    :class:`MemoryNetwork` (the connection pool sized as the sidecar's engine client sizes it).
    Its mode switched and its stats read as the process's control routes do."""

    url = f"http://{LOOPBACK}:{PORT}"

    def __init__(self, mode: str = "ok") -> None:
        assert mode in MODES, mode
        self.engine = Engine(mode, LOOPBACK)
        self.engine.stats.redirect_port = PORT + 1
        self.network = MemoryNetwork(self.engine)
        self._http = httpx.AsyncHTTPTransport(trust_env=False)
        # httpx builds its pool on the system's sockets; this one is the same pool on memory.
        assert isinstance(self._http._pool, httpcore.AsyncConnectionPool)
        self._http._pool = httpcore.AsyncConnectionPool(
            network_backend=self.network, max_connections=6, max_keepalive_connections=3
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._http.handle_async_request(request)

    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        self.engine.stats.mode = mode

    def stats(self) -> dict[str, Any]:
        return self.engine.stats.as_json()

    def requests(self) -> list[dict[str, Any]]:
        return list(self.engine.stats.requests)

    def thaw(self) -> None:
        """Never frozen (``tests.support.inprocess.running`` thaws every engine it ends)."""

    async def aclose(self) -> None:
        await self._http.aclose()
        await self.network.aclose()


if __name__ == "__main__":
    raise SystemExit(main())
