"""The sidecar in-process, on a virtual clock: its real monitor, probes, engine client and HTTP
app (``sidecar.wiring``), against fake engines served in-process (the fake engine's own ASGI app
over httpx's ASGI transport). No socket, no subprocess, no wall-clock wait: every timeout and
interval runs on aiotools' ``VirtualClock``, so a timing rule is an exact statement about the
schedule, whatever the machine's load.

What a process can suffer, the link between them models: frozen (SIGSTOP: every request waits
until thawed), killed (every connection refused), restarted (a fresh engine state).

    async def scenario(side: InProcessSidecar) -> None:
        await side.wait_status(200, within=5)
        await side.engines[URL].fault(hang_generation=True)
        took = await side.wait_status(503, within=3)

    run_virtually(lambda: running(env, {URL: EngineLink("vllm")}), scenario)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import httpx
from aiotools import VirtualClock

from fakeengine.app import build_app
from fakeengine.state import EngineConfig, EngineState
from sidecar.config import Settings, broken_rules
from sidecar.runtime.health import Health
from sidecar.wiring import Surface, health_for, monitor_main, plans_for, surface_for

T = TypeVar("T")

# Short timings, as the process tests use.
FAST = {"DYN_CANARY_WAIT_TIME": "1", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5"}


class EngineLink(httpx.AsyncBaseTransport):
    """One fake engine, reached in-process. Create it inside the running loop."""

    def __init__(self, backend: str, mode: str = "aggregated", **config: Any) -> None:
        self.config = EngineConfig(
            backend=backend,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            model=config.pop("model", "tiny"),
            host="127.0.0.1",
            latency=config.pop("latency", 0.0),
            load_seconds=config.pop("load_seconds", 0.0),
            **config,
        )
        self.down = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._start()

    def _start(self) -> None:
        self.state = EngineState(self.config, loading_seconds=0.0)
        self._asgi = httpx.ASGITransport(app=build_app(self.state))
        self.admin = httpx.AsyncClient(transport=self._asgi, base_url="http://engine")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        await self._thawed.wait()
        if self.down:  # killed while frozen
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        return await self._asgi.handle_async_request(request)

    # --- what a test does to the engine's process ---------------------------------------------
    def freeze(self) -> None:
        """SIGSTOP: every request waits (connections are still accepted) until :meth:`thaw`."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def kill(self) -> None:
        """SIGKILL: every connection refused from now on."""
        self.down = True
        self._thawed.set()

    async def restart(self, **config: Any) -> None:
        """A new process on the same port: a fresh state (counters from zero)."""
        await self.admin.aclose()
        self.config = replace(self.config, **config)
        self._start()
        self.down = False
        self._thawed.set()

    # --- its admin routes ---------------------------------------------------------------------
    async def fault(self, **faults: Any) -> dict[str, Any]:
        response = await self.admin.post("/_fake/fault", json=faults)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    async def requests(self) -> list[dict[str, Any]]:
        return (await self.admin.get("/_fake/requests")).json()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self.admin.aclose()


@dataclass
class InProcessSidecar:
    settings: Settings
    health: Health
    surface: Surface
    engines: Mapping[str, EngineLink]
    http: httpx.AsyncClient

    def now(self) -> float:
        return asyncio.get_running_loop().time()

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
    problems = broken_rules(settings)
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
    plans = plans_for(settings)
    health = health_for(settings, plans, clock=loop.time)
    surface = surface_for(settings, health)

    def connect(url: str) -> httpx.AsyncBaseTransport:
        return engines[url]

    monitor = asyncio.create_task(monitor_main(settings, health, plans, connect=connect))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=surface.app), base_url="http://side")
    try:
        yield InProcessSidecar(settings, health, surface, engines, http)
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
