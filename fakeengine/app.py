"""Assemble the ASGI app for one engine state: backend routes plus the ``/_fake`` admin API."""

from __future__ import annotations

from fastapi import FastAPI

from fakeengine.admin import admin_router
from fakeengine.backends import BACKENDS
from fakeengine.state import EngineState


def build_app(state: EngineState) -> FastAPI:
    config = state.config
    app = FastAPI(
        title=f"fakeengine ({config.backend}, {config.mode})",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    BACKENDS[config.backend](state).register(app)
    app.include_router(admin_router(state))
    return app
