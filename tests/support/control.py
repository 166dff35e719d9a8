"""The control routes (``SIDECAR_CONTROL_PORT``'s server, ``sidecar/surface/control.py``)
in-process, beside a sidecar run by ``tests.support.inprocess.running``."""

from __future__ import annotations

import inspect
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute

from sidecar.core.observations import Observation
from sidecar.surface.control import CONTROL_HOST, create_control_app
from sidecar.wiring import resolve
from tests.support.inprocess import InProcessSidecar


def control_client(side: InProcessSidecar, token: str | None = None) -> httpx.AsyncClient:
    """A client of the control routes as ``sidecar.wiring.build`` builds them: each window they
    take is handed to the state's writer on the monitor's loop (here, this one), as
    ``LoopThread.submit`` hands it; ``token``: sent as the bearer token."""

    async def submit(obs: Observation) -> None:
        side.health.observe(obs)

    app = on_the_loop(create_control_app(resolve(side.settings).control, side.health, submit))
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url=f"http://{CONTROL_HOST}:{side.settings.control_port or 9091}",
        headers=headers,
    )


def on_the_loop(app: FastAPI) -> FastAPI:
    """``app`` with its plain (non-async) request guards called on the event loop, through
    FastAPI's ``dependency_overrides``: FastAPI runs them in a worker thread, and a loop on a
    virtual clock that waits for a thread runs its clock ahead meanwhile, by however many timers
    fall due before the thread is done. The guard itself is the app's own, called as it is."""
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        for depends in route.dependencies:
            guard = depends.dependency
            if guard is None or inspect.iscoroutinefunction(guard):
                continue
            assert list(inspect.signature(guard).parameters) == ["request"], guard
            app.dependency_overrides[guard] = _inline(guard)
    return app


def _inline(guard: Any) -> Any:
    async def inline(request: Request) -> Any:
        return guard(request)

    return inline
