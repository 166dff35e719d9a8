"""The engine's own opinion of itself, where it is not the registration check: a Dynamo worker's
/health on its system server (SIDECAR_TRANSPORT=dynamo), an OpenEngine server's own inference
probe (SIDECAR_TRANSPORT=openengine).

Shown beside the sidecar's verdict, never a gate, since it can be wrong both ways: 200 for a
worker whose engine hangs (its in-process canary off, or judging the first chunk only), and 503
forever for a healthy worker that registers no canary payload (Dynamo's mocker, or any Python
worker without one: the second seed's bug, still in 1.6.1). Where the engine's health route is
the registration check (vLLM's /health over HTTP), registration already says what it answers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineHealthState:
    asked: bool = False
    ready: bool | None = None  # what it says of itself; None: no answer (refused, timed out)
    status: str | None = None  # its word for it (Dynamo: ready, notready; OpenEngine: READY)
    detail: str = "not asked"
    since: float | None = None  # monotonic time the current answer (ready or not) began
    status_code: int | None = None  # the HTTP status, where it answered over HTTP

    @property
    def says_ready(self) -> bool | None:
        """It says it is ready (None: not asked, or no answer)."""
        return self.ready if self.asked else None


def on_engine_health(
    state: EngineHealthState,
    ready: bool | None,
    status: str | None,
    detail: str,
    at: float,
    status_code: int | None = None,
) -> EngineHealthState:
    since = state.since if state.asked and ready == state.says_ready else at
    return EngineHealthState(True, ready, status, detail, since, status_code)
