"""What a real engine does with canaries whose client gave up, read from its own counters.

One run: the engine's computing process is frozen (SIGSTOP), canaries time out against it (sent
by the sidecar, started as users start it, or by a plain client that closes its connection on
the deadline, as the sidecar's engine client does), the sidecar is stopped (so that it sends
nothing after the resume), the engine resumes (SIGCONT), and once its counters stand still the
difference says how many of those canaries it computed and, where it counts them, aborted.

Used by ``tests/test_canary_abort.py`` (the sidecar, with assertions) and
``bench/canary_abort.py`` (both clients, as figures). Every process is started by the callers
through ``tests.support`` and ended by its process group; everything is on 127.0.0.1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.harness import Sidecar, wait_until
from tests.support.vllm_engine import samples, total

Counters = dict[str, float]
#: The sidecar's timings here: a canary times out after TIMEOUT, the next follows WAIT later.
WAIT, TIMEOUT = "1", "0.5"
#: The engine's counters must stand still this long after the resume to be read as final.
QUIET = 1.5
#: SGLang's tokenizer manager notices a closed connection at most this late (it wakes every 4 s):
#: a plain client's canaries are read after it.
SGLANG_NOTICE = 4.5


@dataclass(frozen=True)
class Engine:
    """One engine under test: how to freeze what computes, and how to read its counters."""

    name: str
    url: str  # SIDECAR_ENGINE_URL
    sidecar_env: dict[str, str]  # the sidecar's variables beside it (canaries on)
    freeze: Callable[[], None]
    thaw: Callable[[], None]
    read: Callable[[], Counters]  # the engine's own counters, by name
    computed_keys: tuple[str, ...]  # counters that move once per computed canary (summed)
    aborted_key: str | None  # the engine's counter of aborted requests, if it has one
    settle: float = 0.0  # extra seconds after the resume before counters are final
    # A plain client's canary: (path, body) sent with httpx; None where there is no HTTP API.
    plain: Callable[[int], tuple[str, dict[str, Any]]] | None = None


@dataclass(frozen=True)
class Figures:
    engine: str
    client: str  # "sidecar" or "closing client"
    timed_out: int  # canaries that timed out while the engine was frozen
    computed: int  # of them, computed once it resumed (its own counters)
    aborted: int | None  # its own count of aborted requests (None: it counts none)
    before: Counters
    after: Counters
    note: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "client": self.client,
            "timed_out": self.timed_out,
            "computed": self.computed,
            "aborted": self.aborted,
            "before": self.before,
            "after": self.after,
            "note": self.note,
        }


def sidecar_timeouts(side: Sidecar) -> float:
    """The sidecar's count of canaries that timed out (any endpoint or rank)."""
    text = side.http.get(f"{side.url}/metrics", timeout=5).text
    return total(samples(text), "health_sidecar_canary_total", outcome="timeout")


def _settled(engine: Engine, timeout: float = 30.0) -> Counters:
    """The engine's counters once they stood still for QUIET seconds."""
    time.sleep(engine.settle)
    deadline = time.monotonic() + timeout
    last = engine.read()
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = engine.read()
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= QUIET:
            return now
    return last


def _figures(
    engine: Engine, client: str, timed_out: int, before: Counters, after: Counters, note: str
) -> Figures:
    computed = sum(after.get(k, 0) - before.get(k, 0) for k in engine.computed_keys)
    aborted = None
    if engine.aborted_key is not None:
        aborted = int(after.get(engine.aborted_key, 0) - before.get(engine.aborted_key, 0))
    return Figures(engine.name, client, timed_out, int(computed), aborted, before, after, note)


def by_sidecar(
    engine: Engine,
    start_sidecar: Callable[[dict[str, str]], Sidecar],
    count: int,
    *,
    ready_timeout: float = 30.0,
) -> Figures:
    """``count`` canaries timed out by the sidecar against the frozen engine, then the resume."""
    timings = {"DYN_CANARY_WAIT_TIME": WAIT, "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": TIMEOUT}
    side = start_sidecar(timings | engine.sidecar_env)
    side.wait_status(200, ready_timeout)
    start = sidecar_timeouts(side)
    before = engine.read()
    engine.freeze()
    try:
        got = wait_until(
            lambda: sidecar_timeouts(side) - start >= count and sidecar_timeouts(side),
            count * 5.0 + 10,
            interval=0.1,
            what=f"{count} canary timeouts against the frozen {engine.name}",
        )
        timed_out = int(got - start)
    finally:
        side.close()  # nothing more from the sidecar after the resume (its starter ends it too)
        engine.thaw()
    after = _settled(engine)
    return _figures(engine, "sidecar", timed_out, before, after, "")


def by_closing_client(engine: Engine, count: int, timeout: float = 1.0) -> Figures:
    """``count`` canaries from a plain HTTP client that closes its connection on the deadline."""
    assert engine.plain is not None, f"{engine.name} has no plain HTTP canary"
    before = engine.read()
    engine.freeze()
    timed_out = 0
    try:
        with httpx.Client(trust_env=False) as client:
            for index in range(count):
                path, body = engine.plain(index)
                try:
                    client.post(f"{engine.url}{path}", json=body, timeout=timeout)
                except httpx.TimeoutException:
                    timed_out += 1
    finally:
        engine.thaw()
    after = _settled(engine)
    return _figures(engine, "closing client", timed_out, before, after, "")


# --- reading counters ---------------------------------------------------------------------------
def prometheus_reader(
    url: str, wanted: Mapping[str, tuple[str, dict[str, str]]]
) -> Callable[[], Counters]:
    """A reader of ``url``'s exposition: {key: the sum of samples ``name`` with ``labels``}."""

    def read() -> Counters:
        with httpx.Client(trust_env=False, timeout=5) as client:
            parsed = samples(client.get(url).text)
        return {key: total(parsed, name, **labels) for key, (name, labels) in wanted.items()}

    return read
