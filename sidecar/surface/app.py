"""The HTTP app: /health, /live, /metrics, /sidecar/live, and the status page (/, /debug/history).

No route waits on the engine, reads a request body or query string, or changes any state. Each
answer reads ``health.snapshot`` once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sidecar import __version__
from sidecar.surface.history import History
from sidecar.surface.metrics import Metrics
from sidecar.surface.report import health_body, live_body, sidecar_body
from sidecar.surface.routes import HISTORY_PATH, METRICS_PATH, SIDECAR_LIVE_PATH, STATUS_PAGE_PATH
from sidecar.surface.statuspage import history_body, page
from sidecar.surface.view import About, HealthView

NO_STORE = {"Cache-Control": "no-store"}


def probe_route(
    app: FastAPI,
    path: str,
    handler: Callable[[], Awaitable[Response]],
    summary: str,
    responses: dict[int | str, dict[str, Any]],
    response_class: type[Response] = JSONResponse,
    include_in_schema: bool = True,
) -> None:
    """GET and HEAD on ``path``, registered apart so each has its own OpenAPI operationId."""
    for method in ("GET", "HEAD"):
        app.add_api_route(
            path,
            handler,
            methods=[method],
            summary=summary,
            responses=responses,
            response_class=response_class,
            operation_id=f"{handler.__name__}_{method.lower()}",
            include_in_schema=include_in_schema,
        )


def create_app(
    about: About, health: HealthView, metrics: Metrics, history: History | None = None
) -> FastAPI:
    app = FastAPI(
        title="health-sidecar",
        version=__version__,
        description="Readiness, liveness and metrics of one LLM inference worker.",
        docs_url=None,
        redoc_url=None,
    )

    async def readiness() -> JSONResponse:
        ready, body = health_body(health.snapshot, health.started, health.clock())
        return JSONResponse(body, status_code=200 if ready else 503)

    async def liveness() -> JSONResponse:
        live, body = live_body(health.snapshot, health.started, health.clock())
        return JSONResponse(body, status_code=200 if live else 503)

    async def sidecar_liveness() -> JSONResponse:
        live, body = sidecar_body(health.snapshot, health.started, health.clock())
        return JSONResponse(body, status_code=200 if live else 503)

    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    kept = history if history is not None else History()

    async def status_page() -> HTMLResponse:
        text = page(about, health.snapshot, kept, health.started, health.clock())
        return HTMLResponse(text, headers=NO_STORE)

    async def debug_history() -> JSONResponse:
        body = history_body(health.snapshot, kept, health.started, health.clock())
        return JSONResponse(body, headers=NO_STORE)

    probe_route(
        app,
        about.health_path,
        readiness,
        "Readiness",
        {
            200: {"description": "Ready: the worker can serve."},
            503: {"description": "Not ready; the body says which rule decided and why."},
        },
    )
    probe_route(
        app,
        about.live_path,
        liveness,
        "Liveness",
        {
            200: {"description": "Live: no sustained hard failure."},
            503: {"description": "Sustained hard failure: restarting the engine may help."},
        },
    )
    probe_route(
        app,
        SIDECAR_LIVE_PATH,
        sidecar_liveness,
        "The sidecar's own liveness",
        {
            200: {"description": "The sidecar's monitor runs."},
            503: {"description": "The monitor has stopped: restart the sidecar (not the engine)."},
        },
    )
    probe_route(
        app,
        METRICS_PATH,
        prometheus,
        "Prometheus metrics",
        {200: {"description": "Prometheus text exposition.", "content": {"text/plain": {}}}},
        response_class=Response,
    )
    for path, handler, summary, cls in (
        (STATUS_PAGE_PATH, status_page, "Status page", HTMLResponse),
        (HISTORY_PATH, debug_history, "Recent canaries and verdict changes", JSONResponse),
    ):
        probe_route(app, path, handler, summary, {}, cls, include_in_schema=False)
    return app
