"""A fake Dynamo worker on the real Dynamo runtime, with each backend's role rules and faults.

Run ``python -m fakeengine.dynamo --backend trtllm --mode decode --control-port-file F``
with Dynamo's usual environment (``DYN_FILE_KV``, ``DYN_SYSTEM_PORT``, the loopback host
variables). It is a real worker: it serves ``<namespace>.prefill.generate`` (prefill) or
``<namespace>.backend.generate`` (aggregated, decode) on the real request plane, with the real
system server (``/health``, ``/live``, ``/metrics``) and, with ``--health-check-payload``, the
backend's own canary payload registered so that Dynamo's in-process canary probes it too.

Its handler applies what each real worker's handler does with a request (ai-dynamo 1.6.1):

- trtllm decode raises ``ValueError("Disaggregated params are required for decode mode")``
  unless the request carries a prefill result's ``disaggregated_params``, or the canary marker
  ``_HEALTH_CHECK`` together with ``disaggregated_params`` (then it runs locally), or the
  ``x-bypass-remote-prefill`` annotation;
- sglang decode raises ``RuntimeError("bootstrap_info is required for disaggregated decode but
  was not provided")`` without ``bootstrap_info``; with a bootstrap host other than SGLang's
  fake-transfer sentinel ``2.2.2.2`` it waits for a prefill peer that never sends;
- sglang prefill with a real bootstrap host (or none) waits for a decode peer that never comes:
  with the marker it yields nothing, without it only the bootstrap chunk (``token_ids: []`` and
  ``disaggregated_params``), as the real handler does; it ends when the caller stops it. Without
  the marker but with ``2.2.2.2`` it yields the bootstrap chunk and ends (no tokens);
- vllm runs a plain request locally in every role;
- every prefill answers one token (the real handlers set max_tokens to 1) and adds
  ``disaggregated_params`` to its first chunk, as the mocker does.

An answer to ``stop_conditions.max_tokens`` N is N chunks ``{"token_ids": [t], "finish_reason":
None, "completion_usage": {...}}`` and a last ``{"token_ids": [], "finish_reason": "length",
...}``, its tokens a function of the prompt alone (greedy).

A control server on 127.0.0.1 (its port written to ``--control-port-file``) sets faults and shows
what reached the engine: ``POST /fault`` with a JSON object replaces the fault set (``{}``
clears it; see :class:`Faults`), ``GET /fault`` shows it, ``GET /state`` gives counters and the
last requests. Faults are read live: clearing ``hang`` releases requests held by it. A request
held by a fault, or waiting for a peer, ends within :data:`STOP_POLL_SECONDS` of the caller's
``stop_generating()`` (as a real handler that aborts its engine request does) unless
``ignore_stop`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from fakeengine.cli import bind_socket, write_port_file
from fakeengine.state import FAKE_BOOTSTRAP_HOST

logger = logging.getLogger("fakeengine.dynamo")

Backend = Literal["vllm", "sglang", "trtllm"]
Role = Literal["aggregated", "prefill", "decode"]
Outcome = Literal["running", "completed", "stopped", "error"]

BACKENDS: tuple[str, ...] = ("vllm", "sglang", "trtllm")
ROLES: tuple[str, ...] = ("aggregated", "prefill", "decode")
#: Dynamo's canary marker (``dynamo._core.backend.HEALTH_CHECK_KEY``).
HEALTH_CHECK_KEY = "_HEALTH_CHECK"
#: The annotation that asks a decode worker to run a request locally (conditional disagg).
BYPASS_REMOTE_PREFILL = "x-bypass-remote-prefill"
TRTLLM_DECODE_ERROR = "Disaggregated params are required for decode mode"
SGLANG_DECODE_ERROR = "bootstrap_info is required for disaggregated decode but was not provided"
MISSING_TOKENS_ERROR = "request has no token_ids (a list of integers)"
#: The BOS token id the registered canary payloads carry.
BOS_TOKEN_ID = 1
#: SGLang's default --disaggregation-bootstrap-port, named in its canary payload.
SGLANG_BOOTSTRAP_PORT = 8998
VOCAB_SIZE = 32000
#: How often a held request looks at ``context.is_stopped()`` and at the faults.
STOP_POLL_SECONDS = 0.01
MAX_RECORDED_REQUESTS = 200
CANARY_ID_PREFIX = "canary-"


def canary_payload(backend: str, role: str, bos: int = BOS_TOKEN_ID) -> dict[str, Any]:
    """The canary payload Dynamo's own worker for ``backend`` registers in ``role``."""
    vllm_stop = {
        "max_tokens": 1,
        "stop": None,
        "stop_token_ids": None,
        "include_stop_str_in_output": False,
        "ignore_eos": False,
    }
    if backend == "vllm":
        return {
            "token_ids": [bos],
            "sampling_options": {"temperature": 0.0},
            "stop_conditions": vllm_stop,
            HEALTH_CHECK_KEY: True,
        }
    if backend == "sglang":
        payload: dict[str, Any] = {
            "token_ids": [bos],
            "stop_conditions": {"max_tokens": 1, "ignore_eos": False},
            "sampling_options": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
            "eos_token_ids": [],
            "annotations": [],
        }
        if role != "aggregated":
            payload["bootstrap_info"] = {
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_port": SGLANG_BOOTSTRAP_PORT,
                "bootstrap_room": 0,
            }
            payload[HEALTH_CHECK_KEY] = True
        return payload
    if backend == "trtllm":
        payload = {
            "token_ids": [bos],
            "priority": 1.0,
            "stop_conditions": vllm_stop | {"min_tokens": 0},
            "sampling_options": {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 1,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": None,
            },
            HEALTH_CHECK_KEY: True,
        }
        if role != "aggregated":
            payload["disaggregated_params"] = {"request_type": "context_and_generation"}
        return payload
    raise ValueError(f"unknown backend {backend!r}")


def greedy_tokens(prompt: Sequence[int], count: int) -> list[int]:
    """The tokens a greedy engine answers ``prompt`` with: a function of the prompt alone."""
    tokens: list[int] = []
    for _ in range(count):
        digest = hashlib.sha256(repr([*prompt, *tokens]).encode()).digest()
        tokens.append(int.from_bytes(digest[:4], "big") % VOCAB_SIZE)
    return tokens


def wrong_tokens(prompt: Sequence[int], count: int) -> list[int]:
    """Tokens that differ, position by position, from what :func:`greedy_tokens` answers."""
    return [(token + 1 + VOCAB_SIZE // 2) % VOCAB_SIZE for token in greedy_tokens(prompt, count)]


class Faults(BaseModel):
    """The fault set, and the body of ``POST /fault`` (a new set replaces the old one)."""

    model_config = ConfigDict(extra="forbid")

    hang: bool = Field(False, description="no chunk ever; the request ends only when stopped")
    stall_after_first: bool = Field(False, description="one token chunk, then nothing")
    error: str | None = Field(None, description="raise RuntimeError(error) before any chunk")
    latency: float = Field(0.0, ge=0, description="seconds before each chunk")
    wrong_tokens: bool = Field(False, description="answer other tokens than greedy would")
    ignore_stop: bool = Field(False, description="a held request ignores the caller's stop")


@dataclass
class Record:
    """One request that reached the engine."""

    id: str
    payload: Any
    started: float
    outcome: Outcome = "running"
    ended: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "payload": self.payload,
            "outcome": self.outcome,
            "started": self.started,
            "ended": self.ended,
        }


@dataclass
class WorkerState:
    """Faults, counters and the request log of one worker process."""

    backend: str
    role: str
    faults: Faults = field(default_factory=Faults)
    records: deque[Record] = field(default_factory=lambda: deque(maxlen=MAX_RECORDED_REQUESTS))
    in_flight: dict[int, Record] = field(default_factory=dict)
    completed: int = 0
    stopped: int = 0
    errors: int = 0
    closing: bool = False

    def begin(self, context_id: str, payload: Any) -> Record:
        record = Record(id=context_id, payload=payload, started=time.time())
        self.records.append(record)
        self.in_flight[id(record)] = record
        return record

    def end(self, record: Record, outcome: Outcome) -> None:
        record.outcome, record.ended = outcome, time.time()
        self.in_flight.pop(id(record), None)
        if outcome == "completed":
            self.completed += 1
        elif outcome == "stopped":
            self.stopped += 1
        else:
            self.errors += 1

    def snapshot(self) -> dict[str, Any]:
        canaries = sum(r.id.startswith(CANARY_ID_PREFIX) for r in self.in_flight.values())
        return {
            "backend": self.backend,
            "mode": self.role,
            "in_flight": len(self.in_flight),
            "in_flight_canaries": canaries,
            "in_flight_others": len(self.in_flight) - canaries,
            "completed": self.completed,
            "stopped": self.stopped,
            "errors": self.errors,
            "requests": [r.as_json() for r in self.records],
        }


class Stopped(Exception):
    """The caller stopped the request (or the worker is shutting down) while it was held."""


class Engine:
    """The request handler: role rules, faults, the greedy answer."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    async def generate(self, request: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's handler signature: the request dict and the caller's context."""
        record = self.state.begin(str(context.id()), request)
        outcome: Outcome = "stopped"  # also when the runtime drops the stream (GeneratorExit)
        try:
            async with contextlib.aclosing(self._answer(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
            outcome = "stopped" if self._stop_seen(context) else "completed"
        except Stopped:
            outcome = "stopped"
        except Exception:
            outcome = "error"
            raise
        finally:
            self.state.end(record, outcome)

    def _stop_seen(self, context: Any) -> bool:
        if self.state.closing:
            return True
        asked = bool(context.is_stopped()) or bool(context.is_killed())
        return asked and not self.state.faults.ignore_stop

    async def _hold(self, context: Any, until: Callable[[], bool] = lambda: False) -> None:
        """Wait until ``until()`` is true; raise :class:`Stopped` once the caller stops."""
        while not until():
            if self._stop_seen(context):
                raise Stopped
            await asyncio.sleep(STOP_POLL_SECONDS)

    async def _sleep(self, context: Any, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await self._hold(context, lambda: time.monotonic() >= deadline)

    def _not_hung(self) -> bool:
        return not self.state.faults.hang

    def _check_role(self, request: dict[str, Any]) -> None:
        """Raise what the real handler raises for a request its role cannot serve."""
        backend, role = self.state.backend, self.state.role
        if backend == "trtllm" and role == "decode":
            prefill_result = request.get("prefill_result")
            from_prefill = isinstance(prefill_result, dict) and bool(
                prefill_result.get("disaggregated_params")
            )
            canary = request.get(HEALTH_CHECK_KEY) is True and bool(
                request.get("disaggregated_params")
            )
            bypass = BYPASS_REMOTE_PREFILL in (request.get("annotations") or [])
            if not (from_prefill or canary or bypass):
                raise ValueError(TRTLLM_DECODE_ERROR)
        if backend == "sglang" and role == "decode" and not request.get("bootstrap_info"):
            raise RuntimeError(SGLANG_DECODE_ERROR)

    async def _answer(self, request: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
        prompt = _prompt(request)
        self._check_role(request)
        if self.state.faults.error is not None:
            raise RuntimeError(self.state.faults.error)
        backend, role = self.state.backend, self.state.role
        if backend == "sglang" and role != "aggregated":
            fake = _fake_transfer(request.get("bootstrap_info"))
            if role == "prefill" and request.get(HEALTH_CHECK_KEY) is not True:
                # the real handler hands the bootstrap info on at once, then prefills
                yield {
                    "token_ids": [],
                    "text": None,
                    "finish_reason": None,
                    "disaggregated_params": _sglang_bootstrap(request.get("bootstrap_info")),
                }
                await self._hold(context, self._not_hung if fake else lambda: False)
                return
            if not fake:
                await self._hold(context)  # the peer (decode or prefill) never comes
        await self._hold(context, self._not_hung)
        max_tokens = 1 if role == "prefill" else _max_tokens(request)
        pick = wrong_tokens if self.state.faults.wrong_tokens else greedy_tokens
        tokens = pick(prompt, max_tokens)
        for index, token in enumerate(tokens):
            await self._sleep(context, self.state.faults.latency)
            chunk: dict[str, Any] = {
                "token_ids": [token],
                "finish_reason": None,
                "completion_usage": _usage(len(prompt), index + 1),
            }
            if index == 0 and role == "prefill":
                chunk["disaggregated_params"] = self._disaggregated_params(request)
            yield chunk
            if self._stop_seen(context):
                raise Stopped
            if index == 0:
                await self._hold(context, lambda: not self.state.faults.stall_after_first)
        await self._sleep(context, self.state.faults.latency)
        yield {
            "token_ids": [],
            "finish_reason": "length",
            "completion_usage": _usage(len(prompt), len(tokens)),
        }

    def _disaggregated_params(self, request: dict[str, Any]) -> dict[str, Any]:
        """What a prefill hands its decode peer (opaque to the caller; shaped like the real)."""
        if self.state.backend == "sglang":
            return _sglang_bootstrap(request.get("bootstrap_info"))
        if self.state.backend == "trtllm":
            return {"request_type": "context_only", "opaque_state": None}
        return {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "fake-dynamo-worker",
                "remote_host": "127.0.0.1",
                "remote_port": 0,
                "remote_block_ids": [],
            }
        }


def _prompt(request: Any) -> list[int]:
    if not isinstance(request, dict):
        raise ValueError(f"request is not a JSON object: {type(request).__name__}")
    tokens = request.get("token_ids")
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
    ):
        raise ValueError(MISSING_TOKENS_ERROR)
    return tokens


def _max_tokens(request: dict[str, Any]) -> int:
    stop = request.get("stop_conditions") or {}
    value = stop.get("max_tokens") if isinstance(stop, dict) else None
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"stop_conditions.max_tokens must be a positive integer, not {value!r}")
    return value


def _fake_transfer(bootstrap: Any) -> bool:
    return isinstance(bootstrap, dict) and bootstrap.get("bootstrap_host") == FAKE_BOOTSTRAP_HOST


def _sglang_bootstrap(bootstrap: Any) -> dict[str, Any]:
    given = bootstrap if isinstance(bootstrap, dict) else {}
    return {
        "bootstrap_host": given.get("bootstrap_host", "127.0.0.1"),
        "bootstrap_port": given.get("bootstrap_port", SGLANG_BOOTSTRAP_PORT),
        "bootstrap_room": given.get("bootstrap_room", 0),
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 0},
    }


def build_control_app(state: WorkerState) -> FastAPI:
    """``POST /fault``, ``GET /fault``, ``GET /state``."""
    app = FastAPI(title="fake Dynamo worker control", openapi_url=None)

    @app.post("/fault")
    async def set_fault(body: dict[str, Any]) -> dict[str, Any]:
        try:
            state.faults = Faults.model_validate(body)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        return state.faults.model_dump()

    @app.get("/fault")
    async def get_fault() -> dict[str, Any]:
        return state.faults.model_dump()

    @app.get("/state")
    async def get_state() -> dict[str, Any]:
        return state.snapshot()

    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fakeengine.dynamo",
        description="A fake Dynamo worker on the real runtime, with each backend's role rules.",
        epilog="Dynamo's variables (DYN_FILE_KV, DYN_SYSTEM_PORT, DYN_*_HOST) come from the "
        "environment, as for a real worker. The control server: POST /fault with any of "
        f"{', '.join(Faults.model_fields)}; GET /fault; GET /state.",
    )
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--mode", choices=ROLES, default="aggregated")
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--discovery-backend", default="file")
    parser.add_argument("--request-plane", default="tcp")
    parser.add_argument(
        "--health-check-payload",
        action="store_true",
        help="register the backend's canary payload (Dynamo's in-process canary probes it when "
        "DYN_HEALTH_CHECK_ENABLED=true)",
    )
    parser.add_argument(
        "--control-port-file",
        type=Path,
        required=True,
        help="write the control server's port here (atomically) once it listens",
    )
    return parser


class _ControlServer(uvicorn.Server):
    """Leaves SIGTERM and SIGINT to the worker, which ends the runtime and this server together
    (uvicorn would otherwise take the signals over while it serves)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def endpoint_path(namespace: str, role: str) -> str:
    """Where the real workers serve: prefill on ``prefill``, the others on ``backend``."""
    return f"{namespace}.{'prefill' if role == 'prefill' else 'backend'}.generate"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from dynamo.runtime import DistributedRuntime  # the compiled runtime: only when serving

    loop = asyncio.get_running_loop()
    state = WorkerState(backend=args.backend, role=args.mode)
    runtime = DistributedRuntime(loop, args.discovery_backend, args.request_plane)
    path = endpoint_path(args.namespace, args.mode)
    endpoint = runtime.endpoint(path)
    payload = canary_payload(args.backend, args.mode) if args.health_check_payload else None

    sock = bind_socket("127.0.0.1", 0)
    server = _ControlServer(
        uvicorn.Config(
            build_control_app(state),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
    )
    done = asyncio.Event()

    def shut_down() -> None:
        state.closing = True  # held requests end at once, so shutdown does not wait on them
        server.should_exit = True
        runtime.shutdown()
        done.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, shut_down)

    control = asyncio.create_task(server.serve(sockets=[sock]))
    serving = asyncio.ensure_future(  # a future of the runtime's, not a coroutine
        endpoint.serve_endpoint(Engine(state).generate, health_check_payload=payload)
    )
    while not server.started:
        if control.done() or serving.done():
            break
        await asyncio.sleep(0.01)
    if serving.done() or control.done():
        shut_down()
        for task in (serving, control):
            if task.done() and not task.cancelled() and task.exception() is not None:
                print(f"fake dynamo worker failed: {task.exception()!r}", file=sys.stderr)
        return 1
    write_port_file(args.control_port_file, sock.getsockname()[1])
    print(
        f"fake dynamo worker serving dyn://{path} instance {endpoint.connection_id():x} "
        f"backend={args.backend} mode={args.mode} control=http://127.0.0.1:"
        f"{sock.getsockname()[1]} health_check_payload={'yes' if payload else 'no'}",
        flush=True,
    )
    waiter = asyncio.create_task(done.wait())
    await asyncio.wait({serving, control, waiter}, return_when=asyncio.FIRST_COMPLETED)
    asked = done.is_set()  # a signal, not the runtime or the control server giving up
    shut_down()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.gather(serving, control, return_exceptions=True), 3)
    return 0 if asked else 1


if __name__ == "__main__":
    raise SystemExit(main())
