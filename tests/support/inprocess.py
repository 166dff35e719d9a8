"""The sidecar in-process, on a virtual clock: its real monitor, probes, engine client and HTTP
app (``sidecar.wiring``), against fake engines served in-process (the fake engine's own ASGI app
over httpx's ASGI transport). No socket, no subprocess, no wall-clock wait: every timeout and
interval runs on aiotools' ``VirtualClock``, so a timing rule is an exact statement about the
schedule, whatever the machine's load.

What a process can suffer, the link between them models: frozen (SIGSTOP: every request waits
until thawed), killed (every connection refused), restarted (a fresh engine state). It serves as
an HTTP server does (``served``, the default; ``served=False`` cancels the handler instead): a
request whose client leaves (a timed-out canary) is not cancelled but hears ``http.disconnect``
and runs on as the engine decides
(vLLM aborts it, TensorRT-LLM computes it anyway: each fake backend's ``notice_delay``), and a
kill fails the requests in flight. ``load_seconds`` loads on the virtual clock (vLLM and
TensorRT-LLM refuse connections meanwhile, the others answer 503 "Loading model"). In the engine's
request log (``requests()``), ``at`` is the virtual time a request arrived. ``in_flight`` holds a
client's request in the engine while a test watches (``send``: one as a task). A plain client
of a link speaks through ``TimedClient``: its httpx read timeout runs on the virtual clock (the
client leaves, httpx.ReadTimeout is raised); ``VirtualIdleLink``'s ranks count their idle time
on the virtual clock too.

What the sidecar shows: ``wait_status`` and ``statuses`` (every status a route answered over a
span), ``health_body``, ``metrics``, and ``log``, the lines its log would say.

    async def main() -> float:
        async with running(env, {URL: EngineLink("vllm")}) as side:
            await side.wait_status(200, within=5)
            await side.engines[URL].fault(hang_generation=True)
            return await side.wait_status(503, within=3)

    took = run_virtually(main)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx
from aiotools import VirtualClock

from fakeengine.app import build_app
from fakeengine.backends import BACKENDS
from fakeengine.state import EngineConfig, EngineState, Rank
from sidecar.config import Settings
from sidecar.core.events import Event
from sidecar.runtime.health import Health
from sidecar.wiring import Surface, check, health_for, monitor_main, resolve, surface_for

T = TypeVar("T")

# Short timings, as the process tests use.
FAST = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5"}


class VirtualEngineState(EngineState):
    """The fake engine's state with its loading phase on the loop's clock, and each request's
    virtual arrival time (``at``) in its request log."""

    def __init__(self, config: EngineConfig, *, loading_seconds: float) -> None:
        super().__init__(config, loading_seconds=0.0)
        self.loaded_at = asyncio.get_running_loop().time() + loading_seconds

    @property
    def loading(self) -> bool:
        return asyncio.get_running_loop().time() < self.loaded_at

    async def wait_loaded(self) -> None:
        remaining = self.loaded_at - asyncio.get_running_loop().time()
        if remaining > 0:
            await asyncio.sleep(remaining)

    def record(self, method: str, path: str, headers: Mapping[str, str], payload: object) -> None:
        super().record(method, path, headers, payload)
        self.requests[-1]["at"] = asyncio.get_running_loop().time()


class EngineLink(httpx.AsyncBaseTransport):
    """One fake engine, reached in-process. Create it inside the running loop.

    ``served``: serve requests as an HTTP server does (module docstring); ``load_seconds``: the
    engine loads for that long (virtual) after each start."""

    def __init__(
        self, backend: str, mode: str = "aggregated", *, served: bool = True, **config: Any
    ) -> None:
        self.config = EngineConfig(
            backend=backend,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            model=config.pop("model", "tiny"),
            host="127.0.0.1",
            latency=config.pop("latency", 0.0),
            load_seconds=config.pop("load_seconds", 0.0),
            **config,
        )
        self.served = served
        self.down = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._handlers: set[asyncio.Task[None]] = set()  # served requests still running
        self._killed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._start()

    def _start(self) -> None:
        # The port opens after loading on engines that bind late (vLLM, TensorRT-LLM).
        late = BACKENDS[self.config.backend].binds_after_loading
        self.state = VirtualEngineState(
            self.config, loading_seconds=0.0 if late else self.config.load_seconds
        )
        self.listening_at = asyncio.get_running_loop().time() + (
            self.config.load_seconds if late else 0.0
        )
        self._app = build_app(self.state)
        self._asgi = httpx.ASGITransport(app=self._app)
        self.admin = httpx.AsyncClient(transport=self._asgi, base_url="http://engine")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down or asyncio.get_running_loop().time() < self.listening_at:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        await self._thawed.wait()
        if self.down:  # killed while frozen
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if self.served:
            return await self._serve(request)
        return await self._asgi.handle_async_request(request)

    async def _serve(self, request: httpx.Request) -> httpx.Response:
        """The request as a server runs it: its handler a task of its own, which hears
        ``http.disconnect`` when the client leaves and runs on; a kill ends it."""
        body = await request.aread()
        scope = {
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
            "client": ("127.0.0.1", 123),
            "root_path": "",
        }
        loop = asyncio.get_running_loop()
        read, complete, gone = False, loop.create_future(), loop.create_future()
        status, headers, parts = 500, [], []

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.wait({complete, gone}, return_when=asyncio.FIRST_COMPLETED)
            return {"type": "http.disconnect"}

        async def send(message: Mapping[str, Any]) -> None:
            nonlocal status, headers
            if gone.done():  # nobody reads it any more
                return
            if message["type"] == "http.response.start":
                status, headers = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False) and not complete.done():
                    complete.set_result(None)

        handler = asyncio.create_task(self._app(scope, receive, send))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            await asyncio.wait({handler, self._killed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left: the handler runs on
            gone.set_result(None)
            raise
        if not handler.done():  # killed while it ran
            handler.cancel()
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        handler.result()  # an error in the fake engine is the test's to see
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(b"".join(parts)))

    def send(self, path: str, body: Mapping[str, Any], method: str = "POST") -> asyncio.Task[Any]:
        """A client's request to the engine, as a task: cancelling it is the client leaving."""

        async def request() -> httpx.Response:
            # Straight through the link: a client closing would close its transport, the link.
            response = await self.handle_async_request(
                httpx.Request(method, f"http://engine{path}", json=body)
            )
            await response.aread()
            return response

        return asyncio.create_task(request(), name=f"client {method} {path}")

    @contextlib.asynccontextmanager
    async def in_flight(
        self, path: str, body: Mapping[str, Any], within: float = 2.0
    ) -> AsyncIterator[asyncio.Task[Any]]:
        """One client request held in the engine while the test watches (it has arrived when
        this enters); the client leaves on exit unless it was answered."""
        task = self.send(path, body)
        try:

            async def arrived() -> bool:
                return any(r["path"] == path and r["json"] == body for r in await self.requests())

            await until(arrived, within, what=f"{path} to reach the engine")
            yield task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # --- what a test does to the engine's process ---------------------------------------------
    def freeze(self) -> None:
        """SIGSTOP: every request waits (connections are still accepted) until :meth:`thaw`."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def kill(self) -> None:
        """SIGKILL: every connection refused from now on (served: the requests in flight end
        with the server's disconnect)."""
        self.down = True
        if not self._killed.done():
            self._killed.set_result(None)
        self._thawed.set()

    async def restart(self, **config: Any) -> None:
        """A new process on the same port: a fresh state (counters from zero), loading for
        ``load_seconds`` again."""
        await self.admin.aclose()
        await self._end_handlers()
        self.config = replace(self.config, **config)
        self._start()
        self.down = False
        self._killed = asyncio.get_running_loop().create_future()
        self._thawed.set()

    async def _end_handlers(self) -> None:
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # --- its admin routes ---------------------------------------------------------------------
    async def fault(self, **faults: Any) -> dict[str, Any]:
        response = await self.admin.post("/_fake/fault", json=faults)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    async def requests(self) -> list[dict[str, Any]]:
        return (await self.admin.get("/_fake/requests")).json()  # type: ignore[no-any-return]

    async def state_of(self) -> dict[str, Any]:
        """GET /_fake/state: running, waiting, counters, per rank."""
        return (await self.admin.get("/_fake/state")).json()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self.admin.aclose()
        await self._end_handlers()


class VirtualRank(Rank):
    """A data-parallel rank whose idle time (SGLang's ``scheduler_idle_seconds_total``) runs on
    the loop's clock, as :class:`Rank`'s runs on the wall clock."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self._idle_since = asyncio.get_running_loop().time()

    def start_running(self) -> None:
        if self.stats.running == 0 and self._idle_since is not None:
            self._idle_total += asyncio.get_running_loop().time() - self._idle_since
            self._idle_since = None
        self.stats.running += 1

    def stop_running(self) -> None:
        self.stats.running -= 1
        if self.stats.running == 0:
            self._idle_since = asyncio.get_running_loop().time()

    def idle_seconds(self) -> float:
        since = self._idle_since
        now = asyncio.get_running_loop().time()
        return self._idle_total + (0.0 if since is None else now - since)


class VirtualIdleLink(EngineLink):
    """An :class:`EngineLink` whose ranks count their idle time on the loop's clock too (after
    each start), so that a published idle time is an exact virtual figure."""

    def _start(self) -> None:
        super()._start()
        self.state.ranks = [VirtualRank(rank.index) for rank in self.state.ranks]


class TimedClient(httpx.AsyncBaseTransport):
    """A client's side of a link, for ``httpx.AsyncClient(transport=TimedClient(link))``: the
    request's read timeout (httpx's ``timeout=``) runs on the loop's clock; when it passes the
    client leaves (a served engine hears ``http.disconnect``) and httpx.ReadTimeout is raised,
    as over a socket. Closing the client leaves the link open (the test closes it)."""

    def __init__(self, link: httpx.AsyncBaseTransport) -> None:
        self.link = link

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        seconds = request.extensions.get("timeout", {}).get("read")
        if seconds is None:
            return await self.link.handle_async_request(request)
        deadline = asyncio.timeout(seconds)
        try:
            async with deadline:
                return await self.link.handle_async_request(request)
        except TimeoutError:
            if not deadline.expired():  # not ours
                raise
            raise httpx.ReadTimeout(f"no answer within {seconds} s", request=request) from None

    async def aclose(self) -> None:
        pass


@dataclass
class InProcessSidecar:
    settings: Settings
    health: Health
    surface: Surface
    engines: Mapping[str, EngineLink]
    http: httpx.AsyncClient
    # The log lines the sidecar writes at its SIDECAR_LOG_LEVEL (its events' texts).
    log: list[str] = field(default_factory=list)

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def hear(self, event: Event) -> None:
        """Health's subscriber: keep what the log would say."""
        if event.text is not None and event.level >= logging.getLevelName(
            self.settings.log_level.value
        ):
            self.log.append(event.text)

    async def statuses(
        self, seconds: float, path: str | None = None, step: float = 0.05
    ) -> set[int]:
        """Every status ``path`` (/health) answered, polled each ``step`` over ``seconds``."""
        path = path or self.settings.health_path
        loop = asyncio.get_running_loop()
        end, seen = loop.time() + seconds, set()
        while loop.time() < end:
            seen.add((await self.get(path)).status_code)
            await asyncio.sleep(step)
        return seen

    async def get(self, path: str) -> httpx.Response:
        return await self.http.get(path)

    async def health_body(self) -> tuple[int, dict[str, Any]]:
        response = await self.get(self.settings.health_path)
        return response.status_code, response.json()

    async def metrics(self) -> str:
        return (await self.get("/metrics")).text

    async def wait_status(
        self, code: int, within: float, path: str | None = None, step: float = 0.05
    ) -> float:
        """Virtual seconds until ``path`` (/health) answers ``code``; fails past ``within``."""
        path = path or self.settings.health_path

        async def answers() -> bool:
            return (await self.get(path)).status_code == code

        return await until(answers, within, step, f"{path} -> {code}")


async def until(
    condition: Callable[[], Awaitable[bool] | bool],
    within: float,
    step: float = 0.05,
    what: str = "the condition",
) -> float:
    """Virtual seconds until ``condition`` holds (it may be a coroutine function); fails past
    ``within``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return loop.time() - start
        if loop.time() - start > within:
            raise AssertionError(f"not within {within} virtual s: {what}")
        await asyncio.sleep(step)


def settings_of(env: Mapping[str, str]) -> Settings:
    """The settings of exactly ``env`` (FAST timings unless it says otherwise), validated as the
    sidecar validates them; the process environment is not read."""
    settings = Settings.model_validate(FAST | dict(env))
    problems = check(settings)
    assert not problems, problems
    return settings


@contextlib.asynccontextmanager
async def running(
    env: Mapping[str, str], engines: Mapping[str, EngineLink]
) -> AsyncIterator[InProcessSidecar]:
    """The sidecar as ``python -m sidecar`` builds it, its monitor on this loop, its engine
    clients connected to ``engines`` (by URL: SIDECAR_ENGINE_URL, SIDECAR_KV_PEER_URL)."""
    settings = settings_of(env)
    loop = asyncio.get_running_loop()
    blueprint = resolve(settings)
    health = health_for(blueprint, clock=loop.time)
    surface = surface_for(blueprint, health)

    def connect(url: str) -> httpx.AsyncBaseTransport:
        return engines[url]

    async def inline(call: Callable[[], None]) -> None:
        call()  # the file system's calls (canary leftovers) on the loop: no thread, no real wait

    monitor = asyncio.create_task(monitor_main(blueprint, health, connect=connect, offload=inline))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=surface.app), base_url="http://side")
    side = InProcessSidecar(settings, health, surface, engines, http)
    health.subscribe(side.hear)
    try:
        yield side
    finally:
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)
        await http.aclose()
        for engine in engines.values():
            engine.thaw()
            await engine.aclose()
    if monitor.done() and not monitor.cancelled() and monitor.exception() is not None:
        raise monitor.exception()  # type: ignore[misc]


def run_virtually(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main`` on a new event loop whose clock is virtual; then check that no task outlives
    it (the sidecar owns every task it starts)."""

    async def virtual() -> T:
        with VirtualClock().patch_loop():
            result = await main()
            left = asyncio.all_tasks() - {asyncio.current_task()}
            assert not left, f"tasks left running: {left}"
            return result

    return asyncio.run(virtual())
