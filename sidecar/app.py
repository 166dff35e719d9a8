"""The HTTP app: /health, /live and /metrics, answered from the current state in microseconds.

No route waits on the engine, reads a request body or query string, or changes any state.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sidecar import __version__
from sidecar.config import Settings
from sidecar.metrics import Metrics
from sidecar.state import Health

PROBE_METHODS = ["GET", "HEAD"]


def create_app(settings: Settings, health: Health, metrics: Metrics) -> FastAPI:
    app = FastAPI(
        title="health-sidecar",
        version=__version__,
        description="Readiness, liveness and metrics of one LLM inference worker.",
        docs_url=None,
        redoc_url=None,
    )

    @app.api_route(
        settings.health_path,
        methods=PROBE_METHODS,
        summary="Readiness",
        responses={
            200: {"description": "Ready: the worker can serve."},
            503: {"description": "Not ready; the body says which rule decided and why."},
        },
    )
    async def readiness() -> JSONResponse:
        ready, body = health.report()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.api_route(
        settings.live_path,
        methods=PROBE_METHODS,
        summary="Liveness",
        responses={
            200: {"description": "Live: no sustained hard failure."},
            503: {"description": "Sustained hard failure: restarting the engine may help."},
        },
    )
    async def liveness() -> JSONResponse:
        live, body = health.live_report()
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
