"""Dynamo workers and a Dynamo client for tests: the fake worker and a runtime client process.

:class:`FakeDynamoWorker` starts ``python -m fakeengine.dynamo``, a real Dynamo worker on
the real runtime (file discovery in a test's private directory, TCP request plane, everything
on loopback) whose handler applies a backend's role rules and takes faults from a control port.
:class:`DynamoClient` starts ``python -m tests.support.dynamo_worker client``: a long-lived process
holding a Dynamo runtime client, serving ``POST /call`` on loopback, so that tests can send a
request straight to one instance (``client.direct``) and see what a runtime client sees.

The client runs in a process of its own, not in pytest's: the runtime's threads are created
once per process, in the network namespace of the thread that first creates a runtime, and stay
there. A second test module, in a fresh namespace, could no longer reach its own workers from
an in-process client (measured: ``Unavailable: TCP connection to 127.0.0.1:PORT failed``).

Dynamo's event plane listens on 0.0.0.0: start these only inside a private network namespace
(``tests.support.netns``: the module fixture ``isolated`` or ``private_network()``).

``python -m tests.support.dynamo_worker call ENDPOINT '<json payload>' [--instance-id N]`` sends one
request from the command line (DYN_FILE_KV and the host variables from the environment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import LOOPBACK, Process, base_env, read_port_file

#: Start-up deadline of a worker or a client (they take 0.4-0.6 s on an idle machine).
START_TIMEOUT = 30.0
#: Keep the runtime's own INFO lines out of the logs (its per-request span events stay).
QUIET = {"DYN_LOG": "warn"}
_METRIC_LABELS = re.compile(r"^dynamo_component_\w+\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def dynamo_env(kv_dir: str | Path) -> dict[str, str]:
    """The variables that keep a Dynamo process (worker, frontend, client, sidecar) on loopback
    and its file discovery in ``kv_dir`` (two runs sharing a directory see each other)."""
    return {
        "DYN_FILE_KV": str(kv_dir),
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
        "DYN_EVENT_PLANE_HOST": LOOPBACK,
        "DYN_HTTP_RPC_HOST": LOOPBACK,
        "DYN_SYSTEM_HOST": LOOPBACK,
    }


def sidecar_env(
    system_url: str,
    kv_dir: str | Path,
    backend: str = "vllm",
    mode: str = "aggregated",
    **extra: str,
) -> dict[str, str]:
    """The sidecar as a user starts it beside a Dynamo worker: canaries on, over the request
    plane, the worker's system server as its engine URL, the worker's file discovery."""
    return (
        dynamo_env(kv_dir)
        | {
            "SIDECAR_TRANSPORT": "dynamo",
            "SIDECAR_ENGINE_URL": system_url,
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": backend,
            "SIDECAR_DISAGGREGATION_MODE": mode,
        }
        | extra
    )


def endpoint_instances(metrics: str, endpoint_path: str) -> list[int]:
    """The instance ids (``worker_id``, hex) that a system server's metrics name for
    ``endpoint_path`` ("ns.comp.ep")."""
    namespace, component, endpoint = endpoint_path.split(".")
    found: list[int] = []
    for match in _METRIC_LABELS.finditer(metrics):
        labels = dict(_LABEL.findall(match.group(1)))
        if (
            labels.get("dynamo_namespace") == namespace
            and labels.get("dynamo_component") == component
            and labels.get("dynamo_endpoint") == endpoint
            and "worker_id" in labels
        ):
            instance = int(labels["worker_id"], 16)
            if instance not in found:
                found.append(instance)
    return found


class SystemServer:
    """A Dynamo worker's names for its port and URL: its system server (``DYN_SYSTEM_PORT``:
    /health, /live, /metrics), on a port below 32768 (Dynamo parses it as an i16)."""

    port: int
    url: str

    @property
    def system_port(self) -> int:
        return self.port

    @property
    def system_url(self) -> str:
        return self.url


class FakeDynamoWorker(SystemServer, Process):
    """``python -m fakeengine.dynamo``: a real Dynamo worker with a backend's role rules,
    its system server on a free port below 32768, its control server on another (the one it
    binds and writes to its port file)."""

    start_timeout = START_TIMEOUT
    ready_interval = 0.05

    def __init__(
        self,
        backend: str,
        mode: str = "aggregated",
        *,
        kv_dir: str | Path,
        namespace: str = "dynamo",
        health_check_payload: bool = False,
        env_extra: dict[str, str] | None = None,
    ) -> None:
        super().__init__()  # its system server's port: below 32768, Dynamo parses it as an i16
        self.backend, self.mode, self.namespace = backend, mode, namespace
        self.name = f"fakedynamo-{backend}-{mode}"
        self.kv_dir = Path(kv_dir)
        self.health_check_payload = health_check_payload
        self.env_extra = dict(env_extra or {})
        self.control_port: int | None = None
        self._instance_id: int | None = None

    @property
    def component(self) -> str:
        return "prefill" if self.mode == "prefill" else "backend"

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}.{self.component}.generate"

    @property
    def control_url(self) -> str:
        assert self.control_port is not None, "start() first"
        return f"http://{LOOPBACK}:{self.control_port}"

    @property
    def instance_id(self) -> int:
        assert self._instance_id is not None, "start() first"
        return self._instance_id

    @property
    def port_file(self) -> Path:
        return self.workdir / "control-port"

    def env(self) -> dict[str, str]:
        return (
            base_env()
            | dynamo_env(self.kv_dir)
            | QUIET
            | {"DYN_SYSTEM_PORT": str(self.port), "TMPDIR": str(self.workdir)}
            | self.env_extra
        )

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "fakeengine.dynamo", "--backend", self.backend]
        argv += ["--mode", self.mode, "--namespace", self.namespace]
        argv += ["--control-port-file", str(self.port_file)]
        if self.health_check_payload:
            argv.append("--health-check-payload")
        return argv

    def ready(self) -> bool:
        """Its control port written, and its system server's metrics naming an instance of the
        generate endpoint."""
        self.control_port = read_port_file(self.port_file)
        if self.control_port is None:
            return False
        instances = endpoint_instances(self.metrics(), self.endpoint_path)
        if instances:
            self._instance_id = instances[0]
        return bool(instances)

    def launch(self) -> FakeDynamoWorker:
        """Start the process without waiting (see :meth:`wait_started`)."""
        self.port_file.unlink(missing_ok=True)
        self.control_port, self._instance_id = None, None
        return super().start(wait=False)

    def wait_started(self, timeout: float = START_TIMEOUT) -> FakeDynamoWorker:
        """Wait until the control port is written and the system server's metrics name an
        instance of the generate endpoint."""
        self.wait_ready(timeout)
        return self

    def start(self, timeout: float = START_TIMEOUT, *, wait: bool = True) -> FakeDynamoWorker:
        self.launch()
        return self.wait_started(timeout) if wait else self

    def metrics(self) -> str:
        return self.http.get(f"{self.system_url}/metrics").text

    def health(self) -> tuple[int | None, dict[str, Any] | str]:
        """The worker's own (Dynamo's) ``/health``: (status, body), or (None, error name)."""
        try:
            answer = self.http.get(f"{self.system_url}/health", timeout=1.0)
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        try:
            return answer.status_code, answer.json()
        except ValueError:
            return answer.status_code, answer.text

    def fault(self, **faults: Any) -> dict[str, Any]:
        """Replace the fault set (no arguments: clear it); return the one now in force."""
        answer = self.http.post(f"{self.control_url}/fault", json=faults)
        answer.raise_for_status()
        return answer.json()

    def state(self) -> dict[str, Any]:
        answer = self.http.get(f"{self.control_url}/state")
        answer.raise_for_status()
        return answer.json()


class DynamoClient(Process):
    """``python -m tests.support.dynamo_worker client``: one Dynamo runtime client in its own
    process, sending requests straight to an instance on behalf of the test (``POST /call``)."""

    name = "dynclient"
    start_timeout = START_TIMEOUT
    ready_interval = 0.05
    http_timeout = 10.0

    def __init__(self, kv_dir: str | Path, env_extra: dict[str, str] | None = None) -> None:
        super().__init__()
        self.kv_dir = Path(kv_dir)
        self.env_extra = dict(env_extra or {})

    @property
    def port_file(self) -> Path:
        return self.workdir / "port"

    def env(self) -> dict[str, str]:
        env = base_env() | dynamo_env(self.kv_dir) | QUIET | {"DYN_SYSTEM_PORT": "-1"}
        return env | {"TMPDIR": str(self.workdir)} | self.env_extra

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tests.support.dynamo_worker", "client"]
        return [*argv, "--port", str(self.port), "--port-file", str(self.port_file)]

    def ready(self) -> bool:
        return read_port_file(self.port_file) == self.port

    def start(self, timeout: float = START_TIMEOUT, *, wait: bool = True) -> DynamoClient:
        self.port_file.unlink(missing_ok=True)
        return super().start(wait=wait, timeout=timeout)

    def call(
        self,
        endpoint_path: str,
        payload: Any,
        *,
        instance_id: int | None = None,
        context_id: str | None = None,
        timeout: float = 1.0,
    ) -> dict[str, Any]:
        """Send ``payload`` to ``instance_id`` (default: the first instance discovered) with a
        whole-answer deadline of ``timeout`` seconds; on the deadline the client calls
        ``stop_generating()``, as a canary must.

        Returns ``chunks`` (each chunk's data), ``error`` (``str`` of what the client's
        iteration raised, or an annotated error event's comment), ``error_type``,
        ``timed_out``, ``stopped_at`` (``time.time()`` of the stop), ``elapsed_s``,
        ``first_chunk_s`` and ``context_id``."""
        body = {
            "endpoint": endpoint_path,
            "payload": payload,
            "instance_id": instance_id,
            "context_id": context_id,
            "timeout": timeout,
        }
        answer = self.http.post(f"{self.url}/call", json=body, timeout=timeout + 10)
        answer.raise_for_status()
        return answer.json()

    def instances(self, endpoint_path: str, timeout: float = 5.0) -> list[int]:
        """The instance ids the client's discovery lists for ``endpoint_path``."""
        answer = self.http.get(
            f"{self.url}/instances",
            params={"endpoint": endpoint_path, "wait": timeout},
            timeout=timeout + 10,
        )
        answer.raise_for_status()
        return answer.json()


# The client process (runs the Dynamo runtime; imported only there).


DISCOVERY_WAIT = 5.0  # seconds a call waits for its instance to be discovered


class _Caller:
    """One runtime and one endpoint client per endpoint path, on the process's event loop."""

    def __init__(self, discovery: str, request_plane: str) -> None:
        from dynamo.runtime import DistributedRuntime

        self.runtime = DistributedRuntime(asyncio.get_running_loop(), discovery, request_plane)
        self._clients: dict[str, Any] = {}

    async def client(self, endpoint_path: str) -> Any:
        if endpoint_path not in self._clients:
            self._clients[endpoint_path] = await self.runtime.endpoint(endpoint_path).client()
        return self._clients[endpoint_path]

    async def instances(self, endpoint_path: str, wait_s: float) -> list[int]:
        client = await self.client(endpoint_path)
        try:
            await asyncio.wait_for(client.wait_for_instances(), wait_s)
        except TimeoutError:
            return []
        return [int(i) for i in client.instance_ids()]

    async def call(
        self,
        endpoint_path: str,
        payload: Any,
        instance_id: int | None,
        context_id: str | None,
        deadline_s: float,
    ) -> dict[str, Any]:
        from dynamo.runtime import Context

        ctx = Context(id=context_id) if context_id else Context()
        chunks: list[Any] = []
        result: dict[str, Any] = {
            "context_id": ctx.id(),
            "instance_id": instance_id,
            "chunks": chunks,
            "error": None,
            "error_type": None,
            "timed_out": False,
            "stopped_at": None,
            "first_chunk_s": None,
        }
        client = await self.client(endpoint_path)
        target = instance_id
        if target is None:
            target = (await asyncio.wait_for(client.wait_for_instances(), DISCOVERY_WAIT))[0]
            result["instance_id"] = target
        else:  # a fresh client's discovery watch may not list it yet: wait, outside the deadline
            listed = time.monotonic() + DISCOVERY_WAIT
            while time.monotonic() < listed:  # the binding offers no event for one instance
                if target in {int(i) for i in client.instance_ids()}:
                    break
                await asyncio.sleep(0.02)
        start = time.monotonic()

        async def consume() -> None:
            stream = await client.direct(payload, target, annotated=True, context=ctx)
            async for item in stream:
                if result["first_chunk_s"] is None:
                    result["first_chunk_s"] = time.monotonic() - start
                if item.event() == "error":
                    result["error_type"] = "event"
                    result["error"] = item.comment()
                chunks.append(item.data())

        try:
            await asyncio.wait_for(consume(), deadline_s)
        except TimeoutError:
            ctx.stop_generating()
            result["timed_out"], result["stopped_at"] = True, time.time()
        except Exception as exc:
            result["error_type"], result["error"] = type(exc).__name__, str(exc)
        result["elapsed_s"] = time.monotonic() - start
        return result


async def _serve_client(args: argparse.Namespace) -> int:
    import uvicorn
    from fastapi import FastAPI

    from fakeengine.cli import bind_socket, write_port_file

    caller = _Caller(args.discovery_backend, args.request_plane)
    app = FastAPI(openapi_url=None)

    @app.post("/call")
    async def call(body: dict[str, Any]) -> dict[str, Any]:
        return await caller.call(
            body["endpoint"],
            body["payload"],
            body.get("instance_id"),
            body.get("context_id"),
            float(body.get("timeout", 1.0)),
        )

    @app.get("/instances")
    async def instances(endpoint: str, wait: float = 5.0) -> list[int]:
        return await caller.instances(endpoint, wait)

    sock = bind_socket(LOOPBACK, args.port)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while True:  # uvicorn has no event for it
        if server.started or serving.done():
            break
        await asyncio.sleep(0.01)
    if server.started:
        write_port_file(args.port_file, sock.getsockname()[1])
    await serving
    caller.runtime.shutdown()
    return 0


async def _call_once(args: argparse.Namespace) -> int:
    caller = _Caller(args.discovery_backend, args.request_plane)
    result = await caller.call(
        args.endpoint, json.loads(args.payload), args.instance_id, args.context_id, args.timeout
    )
    print(json.dumps(result), flush=True)
    caller.runtime.shutdown()
    return 0 if result["error"] is None and not result["timed_out"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.dynamo_worker")
    parser.add_argument("--discovery-backend", default="file")
    parser.add_argument("--request-plane", default="tcp")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("client", help="serve POST /call and GET /instances on loopback")
    serve.add_argument("--port", type=int, default=0, help="0 lets the OS pick one")
    serve.add_argument("--port-file", type=Path, required=True)
    once = commands.add_parser("call", help="send one request, print the result as JSON")
    once.add_argument("endpoint", help="ns.comp.ep")
    once.add_argument("payload", help="the request as JSON")
    once.add_argument("--instance-id", type=lambda text: int(text, 0))
    once.add_argument("--context-id")
    once.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args(argv)
    if os.environ.get("DYN_SYSTEM_PORT") is None:
        os.environ["DYN_SYSTEM_PORT"] = "-1"  # a client needs no system server of its own
    if args.command == "client":
        return asyncio.run(_serve_client(args))
    return asyncio.run(_call_once(args))


if __name__ == "__main__":
    raise SystemExit(main())
