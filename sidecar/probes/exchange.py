"""What a transport hands back: to a probe, what its request received, and when; to the monitor,
what a registration check found. Transports judge nothing; the probe judges
(:mod:`sidecar.probes.judge`).

A transport's channel is any object with ``send(request, deadline) -> Received``
(:class:`Channel`): the engine client over HTTP (``sidecar/runtime/engine.py``), a Dynamo worker
over its request plane, an engine's gRPC server (each in ``sidecar/transports/<transport>/``).
It keeps the deadline over the whole answer and never raises for what the engine does: no
answer is a :class:`NoAnswer` with its reason. Every transport's registration check has one
signature (:class:`Registration`): it answers a :class:`Checked`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.core.evidence.result import Outcome
from sidecar.core.jsontext import loads as loads_json

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result
    from sidecar.probes.base import CanaryRequest

ERROR_TEXT_CHARS = 200


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole (within the byte bound)."""

    status: int
    content_type: str
    body: bytes
    location: str | None = None


@dataclass(frozen=True)
class Streamed:
    """A whole stream (a Dynamo worker's chunks, a gRPC call's messages) in order, or the error
    event it ended with (the handler refused the request)."""

    chunks: tuple[Any, ...]
    error: str | None = None


@dataclass(frozen=True)
class NoAnswer:
    """Why an exchange produced no answer, as the outcome a probe or a check records.
    ``rejection``: the worker's handler raised on the request itself (Dynamo)."""

    outcome: Outcome
    reason: str
    rejection: bool = False
    status: str | None = None  # a gRPC call's status, where one ended it (UNAVAILABLE)


@dataclass(frozen=True)
class Received:
    """What one request received, from when it was sent (monotonic) to when the answer ended
    (monotonic, and wall-clock)."""

    answer: Answer | Streamed | NoAnswer
    started: float
    finished: float
    wall: float


class Channel(Protocol):
    """How a probe reaches the engine."""

    async def send(self, request: CanaryRequest, deadline: float) -> Received: ...

    def redact(self, text: str) -> str:
        """``text`` with the secrets the channel sends (a bearer token) scrubbed."""
        ...


def error_text(body: bytes) -> str:
    """The engine's error message from a JSON error body, or the start of the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = loads_json(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed.get("detail", parsed.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    return engine_said(text) or "(empty body)"


def engine_said(value: object) -> str:
    """What an engine said (its error message, an event's text), as it may go into a reason and
    a log line: one line of at most ERROR_TEXT_CHARS characters, whatever the engine sent."""
    text = " ".join((value if isinstance(value, str) else str(value)).split())
    return text[:ERROR_TEXT_CHARS] + ("..." if len(text) > ERROR_TEXT_CHARS else "")


class Sweeper(Protocol):
    """Removes what canaries caused the engine to write (``sidecar/runtime/leftovers.py``)."""

    async def remove(self, names: Sequence[str], *, later: bool) -> None:
        """Remove ``names``; with ``later``, also when they appear afterwards."""
        ...


def parsed_answer(answer: Answer | Streamed | NoAnswer) -> Any:
    """What a prober reads of a whole answer: a 200 JSON answer's parsed body, or a stream's
    chunks (a list) when it did not end on an error event; else None."""
    if isinstance(answer, Streamed):
        return None if answer.error is not None else list(answer.chunks)
    if not isinstance(answer, Answer) or answer.status != 200:
        return None
    try:
        return loads_json(answer.body)
    except ValueError:
        return None


@dataclass(frozen=True)
class EngineHealth:
    """The engine's own opinion of itself, where it is not the registration check (a Dynamo
    worker's /health, OpenEngine's inference probe): shown beside the verdict, never a gate.
    ``ready`` None: no answer."""

    ready: bool | None
    status: str | None
    detail: str
    code: int | None = None  # the HTTP status, where it answered over HTTP


@dataclass(frozen=True)
class Listed:
    """Whether the discovery the router uses lists the worker's instance (a Dynamo worker);
    ``listed`` None: not asked."""

    listed: bool | None
    instance: str | None
    where: str


@dataclass(frozen=True)
class Checked:
    """What one registration check found: the registration itself, and, where the transport
    asks them with it, the engine's own opinion and whether discovery lists it."""

    registration: Result
    engine_health: EngineHealth | None = None
    listed: Listed | None = None
    # The served model, where the check learns it (model, or None, and why): an engine that
    # serves no GET /v1/models names it over its own API.
    model: tuple[str | None, str] | None = None


class Registration(Protocol):
    """A transport's registration check: one call per registration interval, within its own
    deadline, never raising for what the engine does."""

    async def __call__(self) -> Checked: ...

    async def aclose(self) -> None: ...


class MetricsSource(Protocol):
    """Where the engine's metrics are read: its Prometheus text, or None and why not."""

    async def metrics_text(self, path: str) -> tuple[str | None, str]: ...
