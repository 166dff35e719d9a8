"""Real engines for integration tests: llama.cpp's llama-server and NVIDIA Dynamo's mocker.

``scripts/prepare_engines.sh`` builds and caches them and writes their paths to
``$HEALTH_SIDECAR_CACHE/engines.env`` (default ``~/.cache/health-sidecar``). When an engine is
missing, tests that need it skip with a message naming the script; under CI (``CI`` set) they
fail instead, since ``.ci/run`` prepares the engines first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import httpx

from tests.support.dynamo_worker import SystemServer, dynamo_env, endpoint_instances
from tests.support.prerequisites import missing as prerequisite_missing
from tests.support.processes import (
    LOOPBACK,
    Command,
    Process,
    base_env,
    free_port,
    log_dir,
    wait_until,
)

PREPARE = "scripts/prepare_engines.sh"


def cache_dir() -> Path:
    return Path(os.environ.get("HEALTH_SIDECAR_CACHE", Path.home() / ".cache" / "health-sidecar"))


def engine_paths() -> dict[str, str]:
    env_file = cache_dir() / "engines.env"
    if not env_file.is_file():
        return {}
    paths = {}
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            paths[key.strip()] = value.strip()
    return paths


def require(*keys: str) -> dict[str, str]:
    """The paths of the named artefacts, or skip (fail under CI) naming the script."""
    paths = engine_paths()
    missing = [k for k in keys if not paths.get(k) or not Path(paths[k]).exists()]
    if missing:
        prerequisite_missing(f"real engine missing ({', '.join(missing)}): run {PREPARE}")
    return paths


class LlamaServer(Process):
    """llama.cpp's llama-server on a free loopback port; restartable on the same port."""

    name = "llama-server"
    http_timeout = 1.0
    ready_interval = 0.02

    def __init__(self, model: str, *extra: str) -> None:
        self.paths = require("LLAMA_SERVER_BIN", "TINY_GGUF", "BIG_GGUF")
        super().__init__()
        self.model = self.paths.get(model, model)
        self.extra = list(extra)
        self._model_path = self.model

    def argv(self) -> list[str]:
        argv = [self.paths["LLAMA_SERVER_BIN"], "-m", self._model_path, "--alias", "tiny"]
        argv += ["--host", LOOPBACK, "--port", str(self.port), "-c", "512", "-t", "1"]
        return [*argv, "-np", "1", "--metrics", *self.extra]

    def ready(self) -> bool:
        return self.http.get(f"{self.url}/health").status_code == 200

    def start(self, *, wait: bool = True, model: str | None = None) -> LlamaServer:
        self._model_path = self.paths.get(model, model) if model else self.model
        return super().start(wait=wait)


class Dynamo:
    """Dynamo's mocker worker and frontend: file discovery in a private directory, TCP request
    plane, everything bound to loopback."""

    def __init__(self) -> None:
        self.paths = require("DYNAMO_PYTHON", "DYNAMO_MODEL_DIR")
        self.workdir = Path(tempfile.mkdtemp(prefix="dynamo-", dir=log_dir()))
        self.system_port = free_port()  # below 32768: Dynamo parses it as an i16
        self.frontend_port = free_port()
        self.worker: Process | None = None
        self.frontend: Process | None = None

    @property
    def frontend_url(self) -> str:
        return f"http://{LOOPBACK}:{self.frontend_port}"

    @property
    def worker_url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}"

    def _env(self) -> dict[str, str]:
        return base_env() | {
            "DYN_FILE_KV": str(self.workdir / "kv"),
            "DYN_TCP_RPC_HOST": LOOPBACK,
            "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,  # else it binds the host's eth0 address
            "DYN_EVENT_PLANE_HOST": LOOPBACK,
            "TMPDIR": str(self.workdir),
        }

    def start(self) -> Dynamo:
        python, model = self.paths["DYNAMO_PYTHON"], self.paths["DYNAMO_MODEL_DIR"]
        worker_env = self._env() | {
            "DYN_SYSTEM_HOST": LOOPBACK,
            "DYN_SYSTEM_PORT": str(self.system_port),
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        }
        planes = ["--discovery-backend", "file", "--request-plane", "tcp"]
        mocker = [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", "tiny"]
        self.worker = Command(
            "dynamo-mocker", [*mocker, *planes], worker_env, port=self.system_port
        ).start(wait=False)
        frontend = [python, "-m", "dynamo.frontend", "--http-host", LOOPBACK]
        frontend += ["--http-port", str(self.frontend_port), *planes]
        self.frontend = Command(
            "dynamo-frontend", frontend, self._env(), port=self.frontend_port
        ).start(wait=False)
        wait_until(self.model_served, 60, interval=0.1, what="the frontend to serve model tiny")
        return self

    def model_served(self) -> bool:
        for process in (self.worker, self.frontend):
            assert process is not None
            process._check_alive()
        assert self.frontend is not None
        models = self.frontend.http.get(f"{self.frontend_url}/v1/models", timeout=1)
        return any(m.get("id") == "tiny" for m in models.json().get("data", []))

    @staticmethod
    def _health(process: Process | None) -> tuple[int | None, str]:
        assert process is not None
        try:
            answer = process.http.get(f"{process.url}/health", timeout=1)
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        return answer.status_code, answer.text

    def worker_health(self) -> tuple[int | None, str]:
        """What the Dynamo worker's own /health answers: (status, body), or (None, error)."""
        return self._health(self.worker)

    def frontend_health(self) -> tuple[int | None, str]:
        return self._health(self.frontend)

    def close(self) -> None:
        for process in (self.frontend, self.worker):
            if process is not None:
                process.close()


class MockerWorker(SystemServer, Process):
    """One Dynamo mocker worker (``python -m dynamo.mocker``, the real worker of ai-dynamo with a
    simulated engine) on the request plane: file discovery in ``kv_dir`` (workers sharing it are
    one deployment), TCP request plane, its system server on a free port below 32768. Dynamo's
    event plane listens on 0.0.0.0: start it only in a private network namespace
    (``tests.support.netns``)."""

    start_timeout = 60.0
    http_timeout = 1.0

    def __init__(self, kv_dir: str | Path, name: str = "mocker", *extra: str) -> None:
        self.paths = require("DYNAMO_PYTHON", "DYNAMO_MODEL_DIR")
        super().__init__()  # its system server's port: below 32768, Dynamo parses it as an i16
        self.kv_dir = Path(kv_dir)
        self.name = f"dynamo-mocker-{name}"
        self.extra = list(extra)
        self.instance_id: int | None = None
        self.endpoint_path = "dynamo.backend.generate"

    def env(self) -> dict[str, str]:
        return (
            base_env()
            | dynamo_env(self.kv_dir)
            | {"DYN_LOG": "warn", "DYN_SYSTEM_PORT": str(self.port)}
        )

    def argv(self) -> list[str]:
        python, model = self.paths["DYNAMO_PYTHON"], self.paths["DYNAMO_MODEL_DIR"]
        argv = [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", "tiny"]
        argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        return argv + self.extra

    def ready(self) -> list[int]:
        """Its generate endpoint's instance, listed on its system server's /metrics."""
        instances = endpoint_instances(
            self.http.get(f"{self.url}/metrics").text, self.endpoint_path
        )
        if instances:
            self.instance_id = instances[0]
        return instances

    def unhealthy(self, timeout: float | None = None) -> str | None:
        """As any process's, and its record still in file discovery (frozen past its lease, a
        worker stays alive and listed on its own /metrics, but no request can reach it)."""
        why = super().unhealthy(timeout)
        if why is None and not self.record().exists():
            why = "its record is gone from file discovery"
        return why

    def health(self) -> tuple[int | None, str]:
        """What the worker's own /health answers: (status, body), or (None, error)."""
        try:
            answer = self.http.get(f"{self.system_url}/health")
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        return answer.status_code, answer.text

    def record(self) -> Path:
        """Its generate endpoint's record in file discovery."""
        assert self.instance_id is not None
        name = f"dynamo%2Fbackend%2Fgenerate%2F{self.instance_id:x}"
        return self.kv_dir / "v1" / "instances" / name
