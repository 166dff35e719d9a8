"""Command line and process lifecycle: parse flags, load, bind one socket, serve, stop on signal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import uvicorn

from fakeengine import grpcengine, grpchealth
from fakeengine.app import build_app
from fakeengine.backends import BACKENDS
from fakeengine.state import (
    BACKEND_NAMES,
    DEFAULT_TRANSFER_BACKEND,
    MODES,
    NIXL_HANDSHAKE_TIMEOUT,
    OPENENGINE_LOAD_STALE_SECONDS,
    OPENENGINE_PROBE_TIMEOUT,
    SGLANG_HEALTH_CHECK_TIMEOUT,
    TRANSFER_BACKENDS,
    EngineConfig,
    EngineState,
    Faults,
)

logger = logging.getLogger("fakeengine")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: How long in-flight (possibly hung) requests may delay a SIGTERM/SIGINT shutdown.
GRACEFUL_SHUTDOWN_SECONDS = 1
LISTEN_BACKLOG = 2048
#: The backends that can run data-parallel ranks (--dp-size above 1).
DP_BACKENDS = ("vllm", "sglang")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fakeengine",
        description="Fake LLM inference engine speaking vLLM, SGLang, TRT-LLM or llama.cpp HTTP.",
        epilog="Faults are injected at run time with POST /_fake/fault, a JSON object with any of "
        f"{', '.join(Faults.model_fields)} (see Faults in fakeengine/state.py), answered with "
        "the fields it set; GET /_fake/fault shows them all, POST /_fake/reset clears them, "
        "GET /_fake/state and /_fake/requests show what the engine saw.",
    )
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="vllm")
    parser.add_argument("--mode", choices=MODES, default="aggregated")
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 lets the OS pick a port")
    parser.add_argument(
        "--load-seconds",
        type=_non_negative,
        default=0.0,
        help="model loading phase (vllm/trtllm: port closed; sglang/openai: health 503)",
    )
    parser.add_argument(
        "--latency", type=_non_negative, default=0.0, help="seconds each generation takes"
    )
    parser.add_argument(
        "--no-step-counters",
        action="store_true",
        help="publish no counter that moves at every engine step (vllm: prompt, generation and "
        "iteration tokens; sglang: realtime_tokens_total), only those that move as requests "
        "complete, as an older SGLang does",
    )
    parser.add_argument(
        "--prompt-on-arrival",
        action="store_true",
        help="count a request's prompt tokens when it arrives, not once its prefill is done "
        "(sglang's request counter: not once the request finishes)",
    )
    parser.add_argument(
        "--metrics-gzip",
        choices=("auto", "never", "always"),
        default="auto",
        help="auto: gzip the metrics for clients that accept it where the real server does "
        "(sglang, trtllm); always: whatever the client asks",
    )
    parser.add_argument(
        "--dev-mode",
        action="store_true",
        help="vllm only, as VLLM_SERVER_DEV_MODE=1: serve POST /sleep?level=0|1|2&mode=abort|wait|"
        "keep, POST /wake_up and GET /is_sleeping (404 without it); a request sent while asleep "
        "is held until /wake_up",
    )
    parser.add_argument(
        "--ec-storage-path",
        metavar="DIR",
        help="vllm --mode encode only, as ECExampleConnector's shared_storage_path: each encoded "
        "image is written to DIR/<hash>/encoder_cache.safetensors",
    )
    parser.add_argument(
        "--kv-handshake-timeout",
        type=_non_negative,
        default=NIXL_HANDSHAKE_TIMEOUT,
        help="vllm prefill/decode: seconds the NIXL handshake waits for a frozen prefill peer "
        "(kv_transfer_failure=handshake_timeout) before the request fails 500; vLLM has 5 s",
    )
    parser.add_argument(
        "--dp-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="vllm and sglang: N data-parallel ranks (vLLM --data-parallel-size, SGLang "
        '--dp-size). vllm labels every series engine="<rank>" and pins a request to a rank '
        "with the X-data-parallel-rank header, sglang with /generate's data_parallel_rank field "
        "(400 out of range); other requests are balanced round-robin. The hang_ranks fault "
        "wedges ranks",
    )
    parser.add_argument(
        "--health-check-timeout",
        type=_positive,
        default=SGLANG_HEALTH_CHECK_TIMEOUT,
        metavar="SECONDS",
        help="sglang: how long /health (a 1-token generation, as in SGLang 0.5.23) waits for the "
        "engine's output before answering 503; SGLang's SGLANG_HEALTH_CHECK_TIMEOUT, 20 s",
    )
    parser.add_argument(
        "--disaggregation-transfer-backend",
        choices=TRANSFER_BACKENDS,
        help=f"sglang only (default {DEFAULT_TRANSFER_BACKEND}): a prefill server refuses to start "
        "with 'fake', as SGLang's does; decode accepts it",
    )
    parser.add_argument(
        "--grpc-health-port",
        type=int,
        metavar="PORT",
        help="vllm only: also serve grpc.health.v1 on PORT as vLLM's gRPC server does (services "
        "'' and vllm.grpc.engine.VllmEngine, SERVING unless loading, dead or health_status >= "
        "300; see fakeengine/grpchealth.py)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        metavar="PORT",
        help="also serve the backend's gRPC generation service on PORT (0 lets the OS pick; the "
        "line 'fakeengine gRPC listening on HOST:PORT service=NAME' says where), on the same "
        "engine state as HTTP: vllm: vllm.grpc.engine.VllmEngine with grpc.health.v1, sglang: "
        "sglang.grpc.scheduler.SglangScheduler (--smg-grpc-mode), trtllm: trtllm.TrtllmService; "
        "not for --mode encode. Needs smg-grpc-proto (the grpc extra); see "
        "fakeengine/grpcengine.py",
    )
    parser.add_argument(
        "--grpc-service",
        choices=grpcengine.GRPC_SERVICES,
        default="smg",
        help="with --grpc-port: smg (default) serves the backend's SMG service above; "
        "openengine serves openengine.v1.Inference and openengine.v1.Control instead, as "
        "TensorRT-LLM's OpenEngine server does (schema v0.1.0; any of vllm, sglang, trtllm; see "
        "fakeengine/grpc_openengine.py)",
    )
    parser.add_argument(
        "--openengine-probe-timeout",
        type=_positive,
        default=OPENENGINE_PROBE_TIMEOUT,
        metavar="SECONDS",
        help="--grpc-service openengine: the timeout of Health's inference probe (DEGRADED "
        f"after it); TensorRT-LLM's is {OPENENGINE_PROBE_TIMEOUT:g} s",
    )
    parser.add_argument(
        "--openengine-load-stale",
        type=_positive,
        default=OPENENGINE_LOAD_STALE_SECONDS,
        metavar="SECONDS",
        help="--grpc-service openengine: GetLoad answers UNAVAILABLE (its load sample stale) "
        "when requests run and the engine made no step for longer; TensorRT-LLM's is "
        f"{OPENENGINE_LOAD_STALE_SECONDS:g} s",
    )
    parser.add_argument("--port-file", type=Path, help="write the bound port here (atomically)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dev_mode and args.backend != "vllm":
        parser.error("--dev-mode (sleep mode) exists only for --backend vllm")
    if args.dp_size > 1 and args.backend not in DP_BACKENDS:
        parser.error(
            f"--dp-size {args.dp_size}: data-parallel ranks exist only for --backend "
            + " and ".join(DP_BACKENDS)
        )
    if args.ec_storage_path is not None and (args.backend, args.mode) != ("vllm", "encode"):
        parser.error("--ec-storage-path exists only for --backend vllm --mode encode")
    if args.grpc_health_port is not None and args.backend != "vllm":
        parser.error("--grpc-health-port exists only for --backend vllm")
    grpc_refusal = grpcengine.check_supported(args.backend, args.mode, args.grpc_service)
    if args.grpc_port is not None and grpc_refusal is not None:
        parser.error(grpc_refusal)
    if args.grpc_service != "smg" and args.grpc_port is None:
        parser.error(f"--grpc-service {args.grpc_service} needs --grpc-port")
    if args.disaggregation_transfer_backend is not None and args.backend != "sglang":
        parser.error("--disaggregation-transfer-backend exists only for --backend sglang")
    transfer_backend = args.disaggregation_transfer_backend or DEFAULT_TRANSFER_BACKEND
    if args.backend == "sglang" and args.mode == "prefill" and transfer_backend == "fake":
        # SGLang's server-argument check, before anything starts or listens.
        print("Prefill server does not support 'fake' as the transfer backend", file=sys.stderr)
        return 1
    args.disaggregation_transfer_backend = transfer_backend
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    binds_after_loading = BACKENDS[args.backend].binds_after_loading
    config = EngineConfig(
        backend=args.backend,
        mode=args.mode,
        model=args.model_name,
        host=args.host,
        latency=args.latency,
        load_seconds=args.load_seconds,
        prompt_on_arrival=args.prompt_on_arrival,
        step_counters=not args.no_step_counters,
        metrics_gzip=args.metrics_gzip,
        dev_mode=args.dev_mode,
        kv_handshake_timeout=args.kv_handshake_timeout,
        dp_size=args.dp_size,
        health_check_timeout=args.health_check_timeout,
        transfer_backend=args.disaggregation_transfer_backend,
        ec_storage_path=args.ec_storage_path,
        openengine_probe_timeout=args.openengine_probe_timeout,
        openengine_load_stale_seconds=args.openengine_load_stale,
    )
    state = EngineState(config, loading_seconds=0.0 if binds_after_loading else args.load_seconds)
    server = _EngineServer(
        state,
        uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        ),
    )
    stop = _StopOnSignal(server)
    if binds_after_loading and args.load_seconds > 0:
        logger.info("loading the model for %.2fs before opening the port", args.load_seconds)
        if await stop.wait(args.load_seconds):
            return 0
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"fakeengine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    if args.port_file is not None:
        write_port_file(args.port_file, port)
    ranks = f" dp-size={args.dp_size}" if args.dp_size > 1 else ""
    print(
        f"fakeengine listening on http://{_url_host(args.host)}:{port} "
        f"backend={args.backend} mode={args.mode}{ranks}",
        flush=True,
    )
    grpc_server = None
    if args.grpc_health_port is not None:
        try:
            grpc_server = await grpchealth.start(state, args.host, args.grpc_health_port)
        except RuntimeError as exc:
            print(f"fakeengine: cannot serve gRPC health: {exc}", file=sys.stderr)
            return 1
    grpc_engine = None
    if args.grpc_port is not None:
        try:
            grpc_engine = await grpcengine.start(
                state, args.host, args.grpc_port, args.grpc_service
            )
        except (ImportError, RuntimeError) as exc:
            print(f"fakeengine: cannot serve gRPC generation: {exc}", file=sys.stderr)
            if grpc_server is not None:
                await grpc_server.stop(None)
            return 1
        print(
            f"fakeengine gRPC listening on {_url_host(args.host)}:{grpc_engine.port} "
            f"service={grpc_engine.service}",
            flush=True,
        )
    try:
        await server.serve(sockets=[sock])
    finally:
        if grpc_engine is not None:
            await grpc_engine.stop()
        if grpc_server is not None:
            await grpc_server.stop(grpchealth.GRACE)
    return 0


class _EngineServer(uvicorn.Server):
    """Fails hung and parked requests with a 503 as soon as shutdown begins, instead of letting
    uvicorn cancel them (with a traceback) after its graceful-shutdown timeout."""

    def __init__(self, state: EngineState, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._state.stop()
        await super().shutdown(sockets=sockets)


class _StopOnSignal:
    """SIGTERM/SIGINT end the process gracefully with status 0, whether loading or serving.

    uvicorn swaps in its own handlers while serving and, on the way out, restores these and
    re-raises the signal it caught; landing here again is harmless.
    """

    def __init__(self, server: uvicorn.Server) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._server.should_exit = True
        self._loop.call_soon_threadsafe(self._stopped.set)

    async def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if a stop signal arrived meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=seconds)
        return self._stopped.is_set()


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on exactly ``host:port``; SO_REUSEADDR allows an instant restart after SIGKILL."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def write_port_file(path: Path, port: int) -> None:
    """Write then rename, so a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
