"""The control routes: declare, read and end a maintenance window.

Served by a second HTTP server bound to 127.0.0.1 on SIDECAR_CONTROL_PORT, never by the server
the pod network reaches: only the pod's own containers (a training loop that updates weights, an
operator's ``kubectl exec``) can take the worker out of rotation. With SIDECAR_CONTROL_TOKEN set,
every control request also needs ``Authorization: Bearer <token>``, since every container of the
pod shares its loopback.

- ``PUT /maintenance`` ``{"seconds": 600, "reason": "weight update step 42"}``: the worker is
  notready ("maintenance: ..."), live, and sends no canary until the window ends by itself (at
  most SIDECAR_MAINTENANCE_MAX) or is ended; a new PUT replaces the window.
- ``DELETE /maintenance``: end it now; a canary proves the engine before it is ready again.
- ``GET /maintenance``: the window, if any.

The state is changed on the monitor's thread, its only writer (``submit``).
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, field_validator

from sidecar import __version__
from sidecar.core.observations import MaintenanceDeclared, MaintenanceOver, Observation
from sidecar.surface.report import maintenance_body
from sidecar.surface.view import ControlConfig, HealthView

CONTROL_HOST = "127.0.0.1"
_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f]+")

# Hands an observation to the monitor's thread, the state's only writer, and waits for its step.
Submit = Callable[[Observation], Awaitable[None]]


class Window(BaseModel):
    """A maintenance window as declared (its longest length is checked against the settings)."""

    seconds: float = Field(gt=0, allow_inf_nan=False)
    reason: str = Field(min_length=1, max_length=200)

    @field_validator("reason")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not _PRINTABLE.fullmatch(value):
            raise ValueError("control characters in the reason")
        return value


def _window(health: HealthView) -> dict[str, Any]:
    """The declared window (every endpoint has the same one), as /health shows it."""
    windows = (ep.lifecycle.maintenance for ep in health.snapshot.endpoints.values())
    window = next((w for w in windows if w is not None), None)
    return {"maintenance": maintenance_body(window, health.clock())}


def create_control_app(control: ControlConfig, health: HealthView, submit: Submit) -> FastAPI:
    app = FastAPI(
        title="health-sidecar control",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    token = control.token

    async def authorized(request: Request) -> None:
        """On the event loop, not in FastAPI's thread pool: it only compares two strings."""
        if token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode(), token.encode()
        ):
            raise HTTPException(
                401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"}
            )

    guard = [Depends(authorized)]

    @app.get("/maintenance", dependencies=guard)
    async def get_window() -> dict[str, Any]:
        return _window(health)

    @app.put("/maintenance", dependencies=guard)
    async def put_window(window: Window) -> dict[str, Any]:
        if window.seconds > control.maintenance_max:
            raise HTTPException(
                422,
                f"seconds {window.seconds:g}: longer than SIDECAR_MAINTENANCE_MAX "
                f"({control.maintenance_max:g})",
            )
        await submit(MaintenanceDeclared(window.reason, window.seconds, time.time()))
        return _window(health)

    @app.delete("/maintenance", dependencies=guard)
    async def delete_window() -> dict[str, Any]:
        await submit(MaintenanceOver("ended through the control route"))
        return _window(health)

    return app
