"""The engine's own health route, where it is not the registration check: a Dynamo worker's
/health on its system server (SIDECAR_TRANSPORT=dynamo).

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
    status_code: int | None = None  # None: no answer (refused, timed out)
    status: str | None = None  # the body's "status" (Dynamo: ready, notready), when it has one
    detail: str = "not asked"
    since: float | None = None  # monotonic time the current answer (ready or not) began

    @property
    def says_ready(self) -> bool | None:
        """The route answers 200 (None: not asked, or no answer)."""
        if not self.asked or self.status_code is None:
            return None
        return self.status_code == 200


def on_engine_health(
    state: EngineHealthState, status_code: int | None, status: str | None, detail: str, at: float
) -> EngineHealthState:
    says = None if status_code is None else status_code == 200
    since = state.since if state.asked and says == state.says_ready else at
    return EngineHealthState(True, status_code, status, detail, since)
