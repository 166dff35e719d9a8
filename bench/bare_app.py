"""The ceiling of the stack: a bare FastAPI app served exactly as the sidecar serves its own.

One async route, ``GET``/``HEAD /health``, returns a constant JSON body of the size of the
sidecar's ``/health`` (about 850 bytes) through ``JSONResponse``, as the sidecar's route does.
uvicorn gets the sidecar's options (``sidecar/runtime/server.py``: ``log_config=None``,
``access_log=False``, ``lifespan="off"``, ``server_header=False``, httptools chosen by
``http="auto"``) and runs on uvloop through ``asyncio.Runner``, as ``sidecar.runtime.server.run``
does.
Whatever the sidecar's ``/health`` costs beyond this app is the sidecar's own work.

    python -m bench.bare_app --port 9191
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI
from fastapi.responses import JSONResponse

#: Shaped like the sidecar's ready /health body (851 bytes serialized), constant.
BODY: dict[str, Any] = {
    "status": "ready",
    "uptime": {"secs": 42, "nanos": 125000000},
    "endpoints": {"generate": "ready"},
    "rule": "listed_endpoints",
    "rule_text": "ready iff every endpoint in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS is ready",
    "reason": "generate: canary passed in 306 ms",
    "checks": {
        "generate": {
            "reason": "canary passed in 306 ms",
            "registered": True,
            "registration": "GET /health -> 200",
            "canary": "enabled",
            "canary_why": "plain 1-token greedy completion",
            "model": "tiny",
            "consecutive_failures": 0,
            "consecutive_successes": 1,
            "hard_failure_seconds": None,
            "last_canary": {
                "outcome": "success",
                "reason": "complete, well-formed answer",
                "latency_seconds": 0.305564,
                "time": "2026-11-30T07:53:21.723Z",
                "request_id": "canary-7a304ab8-c1a2-422b-8036-36ef3bdbbed8",
            },
            "engine_health_agrees": True,
            "in_flight": 0.0,
            "stalled": False,
            "last_progress_time": None,
            "last_success_time": "2026-11-30T07:53:21.723Z",
        }
    },
}


def create_app() -> FastAPI:
    app = FastAPI(title="bare", docs_url=None, redoc_url=None)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        return JSONResponse(BODY)

    return app


async def serve(host: str, port: int) -> None:
    config = uvicorn.Config(
        create_app(),
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    await uvicorn.Server(config).serve()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_app", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
