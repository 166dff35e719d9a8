"""Dynamo's canary loop, reproduced in-process: the fault benchmark's baseline prober.

What it reproduces (``../shared/reference/dynamo-health.md`` sections 2.4 and 2.5, runtime
generations G2 and G3), for one endpoint:

- It starts notready (``DYN_SYSTEM_STARTING_HEALTH_STATUS`` notready; an endpoint with a canary
  target is seeded NotReady).
- One loop waits on two things: a sleep of ``wait`` (``DYN_CANARY_WAIT_TIME``, 10 s) and the
  activity notifier. The sleep is created anew on every turn, so every notification restarts the
  full wait.
- Activity: each successful, non-error chunk of real traffic and each completed stream notify it
  (one coalescing permit, like ``tokio::sync::Notify``); the notified loop sets the endpoint ready
  (G2+) and records progress (G3).
- When the sleep wins and no request is in flight, a canary is *dispatched* (a task of its own)
  and the loop sleeps a full ``wait`` again: a failing endpoint is re-probed every 10 s.
- When the sleep wins while requests are in flight (G3), no canary is sent: it would only queue
  behind the work. With requests in flight and no progress for ``busy_stall``
  (``DYN_HEALTH_CHECK_BUSY_STALL``, 60 s) the endpoint turns notready. Registration (the start
  of this loop) is the first progress mark. The stall is flagged exactly at the deadline (the
  best case for the baseline: Dynamo does not document how often it checks).
- ``busy_stall=None`` is the G2 loop: no in-flight rule, so a canary goes out after ``wait``
  without a chunk even while requests are in flight (and queues behind them), and no stall rule.
- The canary is a streaming completion (``"stream": true``, ``max_tokens`` 1) judged on its
  first chunk only: ready if a first data chunk without an error arrives within ``timeout``
  (``DYN_HEALTH_CHECK_REQUEST_TIMEOUT``, 3 s) of the send; notready on a timeout, an HTTP error
  status, an error chunk, an empty stream or a transport error. One result flips the verdict:
  no thresholds. The rest of the stream is read afterwards, off the verdict's path (Dynamo drains
  it in a detached task; here with a bound so that nothing leaks).

What it does not reproduce: Dynamo sends its canary in-process to the engine (the local endpoint
registry); this one is an HTTP request to the URL the sidecar also probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

DRAIN_LIMIT = 30.0  # seconds: bound on reading the rest of a canary's stream after its verdict


@dataclass(frozen=True)
class Change:
    at: float  # monotonic seconds
    ready: bool
    reason: str


@dataclass
class Timeline:
    """A prober's verdict over time: only its changes are kept."""

    changes: list[Change] = field(default_factory=list)

    def record(self, at: float, ready: bool, reason: str) -> None:
        if not self.changes or self.changes[-1].ready != ready:
            self.changes.append(Change(at, ready, reason))

    @property
    def current(self) -> bool | None:
        return self.changes[-1].ready if self.changes else None

    def state_at(self, at: float) -> bool | None:
        state = None
        for change in self.changes:
            if change.at > at:
                break
            state = change.ready
        return state

    def first(self, ready: bool, since: float) -> Change | None:
        """Since when (at or after ``since``) the verdict is ``ready``; None if never."""
        if self.state_at(since) is ready:
            reason = next(c.reason for c in reversed(self.changes) if c.at <= since)
            return Change(since, ready, reason)
        return next((c for c in self.changes if c.at >= since and c.ready is ready), None)

    def flips(self, ready: bool, start: float, end: float) -> list[Change]:
        return [c for c in self.changes if start <= c.at <= end and c.ready is ready]


async def _notified(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for the event; True if it was set (and consume it)."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
    if event.is_set():
        event.clear()
        return True
    return False


def _first_item_problem(line: str) -> str | None:
    """None if this SSE data line is a good first item; else why the canary fails."""
    payload = line.removeprefix("data:").strip()
    if payload == "[DONE]":
        return "empty stream"
    try:
        item = json.loads(payload)
    except ValueError:
        return "first chunk is not JSON"
    if isinstance(item, dict) and item.get("error"):
        return "error chunk"
    return None


class DynamoCanaryLoop:
    """One endpoint's G2/G3 canary loop against an OpenAI-compatible ``/v1/completions``."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        wait: float = 10.0,
        timeout: float = 3.0,
        busy_stall: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.wait, self.timeout, self.busy_stall = wait, timeout, busy_stall
        self.clock = clock
        self.timeline = Timeline()
        self.timeline.record(clock(), False, "starting: notready until a canary passes")
        self.sent: list[float] = []  # dispatch times of the canaries
        self.in_flight = 0
        self.last_progress = clock()  # registration is the first progress mark
        self._stalled = False
        self._activity = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(base_url=url, trust_env=False, timeout=None)

    # --- hooks for real traffic (the ingress) -------------------------------------------------
    def request_started(self) -> None:
        self.in_flight += 1

    def progressed(self) -> None:
        """A successful, non-error chunk of real traffic, or a completed stream."""
        self.last_progress = self.clock()
        self._activity.set()

    def request_finished(self) -> None:
        self.in_flight -= 1

    # --- the loop -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.timeline.current)

    def canaries_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.sent if start <= t <= end)

    def _set(self, ready: bool, reason: str) -> None:
        self.timeline.record(self.clock(), ready, reason)

    async def run(self) -> None:
        """Run until cancelled."""
        while True:
            await self._one_wait()

    @property
    def _watching_stall(self) -> bool:
        return self.busy_stall is not None and bool(self.in_flight) and not self._stalled

    async def _one_wait(self) -> None:
        """One turn: a full ``wait`` that activity restarts, then a canary if idle."""
        deadline = self.clock() + self.wait
        while True:
            wake = deadline
            if self.busy_stall is not None and self._watching_stall:
                wake = min(wake, self.last_progress + self.busy_stall)
            if await _notified(self._activity, wake - self.clock()):
                self._stalled = False
                self._set(True, "real traffic: a successful chunk")
                return
            now = self.clock()
            if self.busy_stall is not None and self._watching_stall:
                self._check_stall(now, self.busy_stall)
            if now >= deadline:
                if self.busy_stall is None or not self.in_flight:
                    self._dispatch()
                return

    def _check_stall(self, now: float, budget: float) -> None:
        if now - self.last_progress >= budget:
            self._stalled = True
            self._set(False, f"busy stall: requests in flight, no progress for {budget:g} s")

    def _dispatch(self) -> None:
        self.sent.append(self.clock())
        task = asyncio.create_task(self._canary())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _canary(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Say OK.",
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
        }
        request = self._http.build_request("POST", "/v1/completions", json=body)
        response: httpx.Response | None = None
        lines: AsyncIterator[str] | None = None
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._http.send(request, stream=True)
                lines = response.aiter_lines()
                problem = await self._first_item(response, lines)
        except TimeoutError:
            problem = f"canary timeout: no first chunk within {self.timeout:g} s"
        except httpx.HTTPError as exc:
            problem = f"canary generate error: {type(exc).__name__}"
        self._set(problem is None, problem or "canary passed (first chunk)")
        await self._drain(response, lines)

    async def _first_item(self, response: httpx.Response, lines: AsyncIterator[str]) -> str | None:
        if response.status_code != 200:
            return f"canary error: HTTP {response.status_code}"
        async for line in lines:
            if line.startswith("data:"):
                return _first_item_problem(line)
        return "empty stream"

    @staticmethod
    async def _drain(response: httpx.Response | None, lines: AsyncIterator[str] | None) -> None:
        if response is None:
            return
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            async with asyncio.timeout(DRAIN_LIMIT):
                if lines is not None and not response.is_closed:
                    async for _ in lines:
                        pass
        await response.aclose()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._http.aclose()
