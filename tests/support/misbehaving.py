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
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.harness import Proc, base_env, wait_until

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


class MisbehavingEngine:
    """The test side: start ``python -m tests.support.misbehaving`` as a real process, switch its
    mode,
    read its stats. Ended by its process group in :meth:`close`."""

    def __init__(self, mode: str = "ok") -> None:
        port_file = Path(tempfile.mkdtemp(prefix="misbehaving-")) / "port"
        argv = [
            sys.executable,
            "-m",
            "tests.support.misbehaving",
            "--host",
            LOOPBACK,
            "--port",
            "0",
        ]
        argv += ["--port-file", str(port_file), "--mode", mode]
        self.proc = Proc(argv, base_env(), f"misbehaving-{mode}")
        self.http = httpx.Client(timeout=2.0, trust_env=False)
        try:
            wait_until(port_file.exists, 10, what="the misbehaving engine to bind")
        except AssertionError:
            self.close()
            raise
        self.port = int(port_file.read_text())

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def set_mode(self, mode: str) -> None:
        answer = self.http.post(f"{self.url}/mode/{mode}")
        answer.raise_for_status()

    def stats(self) -> dict[str, Any]:
        return self.http.get(f"{self.url}/stats").json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.url}/requests").json()

    def close(self) -> None:
        self.http.close()
        self.proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
