"""What one exchange with the engine produced: the common currency of the evidence sources."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    """How one exchange ended; the label values of health_sidecar_canary_total."""

    SUCCESS = "success"  # 200 and, for a canary, a well-formed answer
    TIMEOUT = "timeout"  # the whole answer did not arrive within the deadline: a hang
    ERROR = "error"  # an HTTP error status, or the connection broke mid-answer
    REFUSED = "refused"  # nothing accepts connections: the engine is gone or not started
    INVALID = "invalid"  # 200, but the body is not a well-formed answer
    # 200 and well formed, but not the answer this incarnation gave first (greedy decoding of a
    # fixed prompt is reproducible; SIDECAR_CANARY_CHECK_ANSWER)
    WRONG = "wrong_answer"


@dataclass(frozen=True)
class Result:
    """One exchange: a canary or a check of the engine's health route."""

    outcome: Outcome
    reason: str
    started: float  # monotonic seconds
    finished: float  # monotonic seconds
    wall_time: float  # unix seconds at finish
    request_id: str = ""
    status_code: int | None = None
    answer: str | None = None  # a passed canary's answer (what it generated), when known
    # The engine refused the request itself without an HTTP status: a Dynamo worker's handler
    # raised (TensorRT-LLM's decode: "Disaggregated params are required for decode mode").
    rejection: bool = False
    # What answered a registration check, where it can change without a gap: a Dynamo worker's
    # instance (a new one is a new incarnation).
    identity: str | None = None
    # A registration check answered "not serving" as a status, from a server that is up (the
    # engine's gRPC health: NOT_SERVING), not a refusal: the engine says it cannot serve.
    not_serving: bool = False

    @property
    def latency(self) -> float:
        return self.finished - self.started

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.SUCCESS

    @property
    def server_error(self) -> bool:
        """A 5xx answer, or a connection that broke mid-answer."""
        return (
            self.outcome is Outcome.ERROR
            and not self.rejection
            and (self.status_code is None or self.status_code >= 500)
        )

    @property
    def rejected(self) -> bool:
        """The engine refused the request itself (4xx, other than for load: 408, 429; or a
        Dynamo handler's error)."""
        code = self.status_code
        if self.outcome is not Outcome.ERROR:
            return False
        return self.rejection or (code is not None and 400 <= code < 500 and code not in (408, 429))
