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

from tests.support.harness import (
    LOOPBACK,
    Owned,
    Proc,
    base_env,
    free_port,
    wait_until,
)
from tests.support.prerequisites import missing as prerequisite_missing

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


class LlamaServer(Owned):
    """llama.cpp's llama-server on a free loopback port; restartable on the same port."""

    def __init__(self, model: str, *extra: str) -> None:
        self.paths = require("LLAMA_SERVER_BIN", "TINY_GGUF", "BIG_GGUF")
        self.model = self.paths.get(model, model)
        self.extra = list(extra)
        self.port = free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, *, wait: bool = True, model: str | None = None) -> LlamaServer:
        model_path = self.paths.get(model, model) if model else self.model
        argv = [self.paths["LLAMA_SERVER_BIN"], "-m", model_path, "--alias", "tiny"]
        argv += ["--host", LOOPBACK, "--port", str(self.port), "-c", "512", "-t", "1"]
        argv += ["-np", "1", "--metrics", *self.extra]
        self.spawn(argv, base_env(), "llama-server")
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.popen.poll() is not None:
                raise AssertionError(f"llama-server exited: {self.proc.output()[-2000:]}")
            with httpx.Client(timeout=1, trust_env=False) as client:
                return client.get(f"{self.url}/health").status_code == 200

        wait_until(ready, timeout, what="llama-server to load")


class Dynamo:
    """Dynamo's mocker worker and frontend: file discovery in a private directory, TCP request
    plane, everything bound to loopback."""

    def __init__(self) -> None:
        self.paths = require("DYNAMO_PYTHON", "DYNAMO_MODEL_DIR")
        self.workdir = Path(tempfile.mkdtemp(prefix="dynamo-"))
        self.system_port = free_port()  # below 32768: Dynamo parses it as an i16
        self.frontend_port = free_port()
        self.worker: Proc | None = None
        self.frontend: Proc | None = None

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
        self.worker = Proc(
            [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", "tiny", *planes],
            worker_env,
            "dynamo-mocker",
        )
        port = str(self.frontend_port)
        self.frontend = Proc(
            [
                python,
                "-m",
                "dynamo.frontend",
                "--http-host",
                LOOPBACK,
                "--http-port",
                port,
                *planes,
            ],
            self._env(),
            "dynamo-frontend",
        )
        wait_until(self.model_served, 60, interval=0.1, what="the frontend to serve model tiny")
        return self

    def model_served(self) -> bool:
        for proc in (self.worker, self.frontend):
            assert proc is not None
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.name} exited: {proc.output()[-2000:]}")
        with httpx.Client(timeout=1, trust_env=False) as client:
            models = client.get(f"{self.frontend_url}/v1/models").json().get("data", [])
        return any(m.get("id") == "tiny" for m in models)

    def worker_health(self) -> tuple[int | None, str]:
        """What the Dynamo worker's own /health answers: (status, body), or (None, error)."""
        try:
            with httpx.Client(timeout=1, trust_env=False) as client:
                answer = client.get(f"{self.worker_url}/health")
                return answer.status_code, answer.text
        except httpx.HTTPError as exc:
            return None, type(exc).__name__

    def frontend_health(self) -> tuple[int | None, str]:
        try:
            with httpx.Client(timeout=1, trust_env=False) as client:
                answer = client.get(f"{self.frontend_url}/health")
                return answer.status_code, answer.text
        except httpx.HTTPError as exc:
            return None, type(exc).__name__

    def close(self) -> None:
        for proc in (self.frontend, self.worker):
            if proc is not None:
                proc.stop()


class MockerWorker(Owned):
    """One Dynamo mocker worker (``python -m dynamo.mocker``, the real worker of ai-dynamo with a
    simulated engine) on the request plane: file discovery in ``kv_dir`` (workers sharing it are
    one deployment), TCP request plane, its system server on a free port below 32768. Dynamo's
    event plane listens on 0.0.0.0: start it only in a private network namespace
    (``tests.support.netns``)."""

    def __init__(self, kv_dir: str | Path, name: str = "mocker", *extra: str) -> None:
        from tests.support.dynamo_worker import dynamo_env

        self.paths = require("DYNAMO_PYTHON", "DYNAMO_MODEL_DIR")
        self.kv_dir = Path(kv_dir)
        self.name = name
        self.extra = list(extra)
        self.env = base_env() | dynamo_env(self.kv_dir) | {"DYN_LOG": "warn"}
        self.system_port = free_port()  # below 32768: Dynamo parses it as an i16
        self.proc: Proc | None = None
        self.instance_id: int | None = None
        self.endpoint_path = "dynamo.backend.generate"

    @property
    def system_url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}"

    def start(self, timeout: float = 60) -> MockerWorker:
        from tests.support.dynamo_worker import endpoint_instances

        python, model = self.paths["DYNAMO_PYTHON"], self.paths["DYNAMO_MODEL_DIR"]
        argv = [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", "tiny"]
        argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        env = self.env | {"DYN_SYSTEM_PORT": str(self.system_port)}
        self.spawn([*argv, *self.extra], env, f"dynamo-mocker-{self.name}")

        def served() -> list[int]:
            assert self.proc is not None
            if self.proc.popen.poll() is not None:
                raise AssertionError(f"{self.proc.name} exited: {self.proc.output()[-2000:]}")
            with httpx.Client(timeout=1, trust_env=False) as client:
                text = client.get(f"{self.system_url}/metrics").text
            return endpoint_instances(text, self.endpoint_path)

        self.instance_id = wait_until(served, timeout, interval=0.1, what=f"{self.name} served")[0]
        return self

    def health(self) -> tuple[int | None, str]:
        """What the worker's own /health answers: (status, body), or (None, error)."""
        try:
            with httpx.Client(timeout=1, trust_env=False) as client:
                answer = client.get(f"{self.system_url}/health")
                return answer.status_code, answer.text
        except httpx.HTTPError as exc:
            return None, type(exc).__name__

    def record(self) -> Path:
        """Its generate endpoint's record in file discovery."""
        assert self.instance_id is not None
        name = f"dynamo%2Fbackend%2Fgenerate%2F{self.instance_id:x}"
        return self.kv_dir / "v1" / "instances" / name
