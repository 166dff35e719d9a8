"""The gRPC health service (SIDECAR_GRPC_PORT): grpc.health.v1.Health with Check and Watch.

The sidecar runs as users run it (``python -m sidecar``) against the fake engine, both on free
loopback ports; a real gRPC client (grpcio-health-checking's stub) asks it. Every wait polls with
a deadline. Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, retry 1 s,
failure threshold 2 (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.config import ConfigError
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.observations import Registered
from sidecar.core.verdict import HEARTBEAT_STALE
from sidecar.surface.grpchealth import TICK, GrpcHealth
from sidecar.tools.probes import render
from sidecar.wiring import load, resolve
from tests.support.configured import health_of, run_cli, settings_from
from tests.support.harness import LOOPBACK, ROOT, FakeEngine, Sidecar, free_port

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING: Status = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Status = health_pb2.HealthCheckResponse.NOT_SERVING
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}
WAIT, TIMEOUT, RETRY = 1.0, 0.5, 1.0
# From a hang to readiness NOT_SERVING: the wait, two failed canaries a retry apart, slack.
HANG_TO_NOTREADY = WAIT + TIMEOUT + RETRY + TIMEOUT + 1.5
# From the engine released to SERVING: the canary in flight times out, the next one passes.
RELEASE_TO_READY = TIMEOUT + RETRY + 1.5
STEP = 1.0  # a wait for what the sidecar already knows


class Client:
    """grpc.health.v1 over an insecure loopback channel (no proxy)."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(
            f"{LOOPBACK}:{port}", options=[("grpc.enable_http_proxy", 0)]
        )
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def check(self, service: str) -> Status | grpc.StatusCode:
        """The service's status, or the call's error code (NOT_FOUND, UNAVAILABLE ...)."""
        try:
            reply = self.stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=STEP)
        except grpc.RpcError as exc:
            return exc.code()  # a failed call is also a grpc.Call
        return reply.status

    def watch(self, service: str) -> Watch:
        return Watch(self.stub.Watch(health_pb2.HealthCheckRequest(service=service)))

    def close(self) -> None:
        self.channel.close()


class Watch:
    """A Watch stream read on a thread of its own: each status with the time it arrived."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.received: queue.Queue[tuple[float, Status]] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.received.put((time.monotonic(), reply.status))
        except grpc.RpcError:
            pass  # cancelled, or the server went away

    def next(self, timeout: float) -> tuple[float, Status]:
        try:
            return self.received.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no status streamed within {timeout} s") from None

    def until(self, status: Status, timeout: float) -> float:
        """Read the stream until ``status`` arrives; when it did."""
        deadline = time.monotonic() + timeout
        while True:
            at, got = self.next(max(0.0, deadline - time.monotonic()))
            if got == status:
                return at

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(STEP)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``condition`` holds; when it did."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic()


@pytest.fixture
def grpc_client() -> Iterator[Callable[[int], Client]]:
    made: list[Client] = []

    def connect(port: int) -> Client:
        client = Client(port)
        made.append(client)
        return client

    yield connect
    for client in made:
        client.close()


@pytest.fixture
def watches() -> Iterator[list[Watch]]:
    """Watch streams to cancel when the test ends."""
    opened: list[Watch] = []
    yield opened
    for each in opened:
        each.close()


def start(
    engine: Callable[..., FakeEngine],
    sidecar: Callable[..., Sidecar],
    connect: Callable[[int], Client],
    *,
    hang: bool = False,
    **env: str,
) -> tuple[FakeEngine, Sidecar, Client]:
    fake = engine("vllm")
    if hang:
        fake.fault(hang_generation=True)
    port = free_port()
    side = sidecar(
        CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_GRPC_PORT": str(port)} | env
    )
    client = connect(port)
    grpc.channel_ready_future(client.channel).result(timeout=5)
    return fake, side, client


# --- Check ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_check_answers_what_health_and_live_answer(engine, sidecar, grpc_client):
    _fake, side, client = start(engine, sidecar, grpc_client)
    wait_for(lambda: client.check("") == SERVING, 5, "'' SERVING")
    assert side.get("/health").status_code == 200
    assert side.get("/live").status_code == 200
    for service in ("", "readiness", "liveness", "generate"):
        assert client.check(service) == SERVING, service
    assert client.check("no-such-service") == grpc.StatusCode.NOT_FOUND
    assert client.check("generate/rank0") == grpc.StatusCode.NOT_FOUND  # endpoints, not units


@pytest.mark.process
def test_check_before_the_first_verdict_is_not_serving_but_live(engine, sidecar, grpc_client):
    """A hung engine from the start: /health 503 (starting status, then the canary's timeouts),
    /live 200; the services say the same."""
    _fake, side, client = start(engine, sidecar, grpc_client, hang=True)
    assert side.get("/health").status_code == 503
    for service in ("", "readiness", "generate"):
        assert client.check(service) == NOT_SERVING, service
    assert client.check("liveness") == SERVING
    assert side.get("/live").status_code == 200


# --- Watch ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_watch_streams_not_serving_to_serving_as_it_happens(engine, sidecar, grpc_client, watches):
    fake, side, client = start(engine, sidecar, grpc_client, hang=True)
    readiness, endpoint = client.watch("readiness"), client.watch("generate")
    watches += [readiness, endpoint]
    assert readiness.next(STEP)[1] == NOT_SERVING  # the current status first
    assert endpoint.next(STEP)[1] == NOT_SERVING

    fake.fault(hang_generation=False)
    http_at = wait_for(
        lambda: side.get("/health").status_code == 200, RELEASE_TO_READY, "/health 200"
    )
    grpc_at = readiness.until(SERVING, STEP)
    endpoint.until(SERVING, STEP)
    # Streamed when the snapshot changed, not on a timer: within a /health poll or so of it.
    assert abs(grpc_at - http_at) < 0.5, grpc_at - http_at


@pytest.mark.process
def test_watch_sees_a_hang_and_the_recovery(engine, sidecar, grpc_client, watches):
    fake, side, client = start(engine, sidecar, grpc_client)
    readiness = client.watch("")
    watches.append(readiness)
    readiness.until(SERVING, 5)

    fake.fault(hang_generation=True)
    hung_at = time.monotonic()
    readiness.until(NOT_SERVING, HANG_TO_NOTREADY)
    detect = time.monotonic() - hung_at
    assert side.get("/health").status_code == 503
    assert client.check("liveness") == SERVING  # hung for seconds: not yet a restart
    assert client.check("generate") == NOT_SERVING

    fake.fault(hang_generation=False)
    readiness.until(SERVING, RELEASE_TO_READY)
    assert side.get("/health").status_code == 200
    print(f"GRPC watch: NOT_SERVING {detect:.2f} s after the hang")


@pytest.mark.process
def test_liveness_follows_live_as_time_alone_runs_out(engine, sidecar, grpc_client, watches):
    """The liveness clock runs out between canaries: Health's heartbeat tick carries it."""
    window = 2.0
    fake, side, client = start(engine, sidecar, grpc_client, SIDECAR_LIVENESS_WINDOW=str(window))
    wait_for(lambda: client.check("") == SERVING, 5, "'' SERVING")
    liveness = client.watch("liveness")
    watches.append(liveness)
    assert liveness.next(STEP)[1] == SERVING

    fake.fault(hang_generation=True)
    liveness.until(NOT_SERVING, HANG_TO_NOTREADY + window)
    assert side.get("/live").status_code == 503
    fake.fault(hang_generation=False)
    liveness.until(SERVING, RELEASE_TO_READY)
    assert side.get("/live").status_code == 200


@pytest.mark.process
def test_watch_turns_not_serving_when_the_monitor_falls_silent(monkeypatch, grpc_client, watches):
    """A monitor that stopped publishes no snapshot and no event: the server's own tick sees the
    time pass, as /health's stale rule does. In-process, on a clock the test moves."""
    port = free_port()
    settings = settings_from(monkeypatch, SIDECAR_GRPC_PORT=str(port))
    now = [1000.0]
    health = health_of(settings, clock=lambda: now[0])
    unit = next(iter(health.snapshot.endpoints))
    registered = Result(Outcome.SUCCESS, "GET /health -> 200", now[0], now[0], time.time())
    health.observe(Registered(unit, registered))
    server = GrpcHealth(health, LOOPBACK, port)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),))
    thread.start()
    try:
        client = grpc_client(port)
        grpc.channel_ready_future(client.channel).result(timeout=5)
        readiness = client.watch("readiness")
        watches.append(readiness)
        assert readiness.next(STEP)[1] == SERVING
        now[0] += HEARTBEAT_STALE + 1  # from here on the monitor publishes nothing
        readiness.until(NOT_SERVING, TICK + STEP)
    finally:
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        thread.join(5)
        loop.close()


# --- shutdown, and a port already taken ----------------------------------------------------------


@pytest.mark.process
def test_drain_turns_readiness_not_serving_then_the_server_stops(
    engine, sidecar, grpc_client, watches
):
    drain = 2.0
    _fake, side, client = start(engine, sidecar, grpc_client, SIDECAR_DRAIN_TIMEOUT=str(drain))
    wait_for(lambda: client.check("") == SERVING, 5, "'' SERVING")
    readiness = client.watch("readiness")
    watches.append(readiness)
    assert readiness.next(STEP)[1] == SERVING

    side.proc.signal(signal.SIGTERM)  # the engine stays up: the drain runs its whole timeout
    readiness.until(NOT_SERVING, STEP)
    assert side.get("/health").status_code == 503
    assert side.get("/live").status_code == 200
    assert client.check("liveness") == SERVING  # draining is not dying
    # An endpoint keeps its own verdict, as /health's "endpoints" does.
    assert side.health()[1]["endpoints"] == {"generate": "ready"}
    assert client.check("generate") == SERVING

    assert side.proc.popen.wait(drain + 5) == 0
    assert client.check("") == grpc.StatusCode.UNAVAILABLE  # no longer listening
    assert "gRPC health service on 127.0.0.1:" in side.proc.output()


@pytest.mark.process
def test_a_grpc_port_already_taken_stops_the_sidecar(engine, sidecar):
    fake = engine("vllm")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        side = sidecar({"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_GRPC_PORT": str(port)}, wait=False)
        code = side.proc.popen.wait(10)
    assert code == 1, side.proc.output()
    assert f"could not bind 127.0.0.1:{port} (SIDECAR_GRPC_PORT)" in side.proc.output()


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_grpc_port_is_off_by_default(monkeypatch):
    assert settings_from(monkeypatch).grpc_port is None
    assert settings_from(monkeypatch, SIDECAR_GRPC_PORT="50051").grpc_port == 50051
    assert settings_from(monkeypatch, SIDECAR_GRPC_PORT="").grpc_port is None  # empty: unset


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SIDECAR_GRPC_PORT": "0"}, "SIDECAR_GRPC_PORT='0': expected an integer port from 1"),
        ({"SIDECAR_GRPC_PORT": "70000"}, "SIDECAR_GRPC_PORT='70000': expected an integer port"),
        ({"SIDECAR_GRPC_PORT": "grpc"}, "SIDECAR_GRPC_PORT='grpc': expected an integer port"),
        (
            {"SIDECAR_GRPC_PORT": "9090"},
            "SIDECAR_GRPC_PORT=9090: expected a port other than DYN_SYSTEM_PORT's",
        ),
        (
            {"SIDECAR_GRPC_PORT": "9091", "SIDECAR_CONTROL_PORT": "9091"},
            "SIDECAR_GRPC_PORT=9091: expected a port other than SIDECAR_CONTROL_PORT's",
        ),
    ],
)
def test_a_bad_grpc_port_is_one_line_naming_it(monkeypatch, env, expected):
    with pytest.raises(ConfigError) as info:
        settings_from(monkeypatch, **env)
    (line,) = info.value.lines
    assert line.startswith(expected), line


@pytest.mark.process
def test_check_config_shows_the_grpc_service():
    done = run_cli("--check-config", env={"SIDECAR_GRPC_PORT": "50051"})
    assert done.returncode == 0, done.stderr
    assert (
        "grpc           grpc.health.v1.Health (Check, Watch) on 0.0.0.0:50051: '' and readiness "
        "as /health, liveness as /live, generate as its endpoint in /health"
    ) in done.stdout
    off = run_cli("--check-config")
    assert "grpc           no gRPC health service (SIDECAR_GRPC_PORT unset)" in off.stdout
    bad = run_cli("--check-config", env={"SIDECAR_GRPC_PORT": "none"})
    assert bad.returncode == 2
    (line,) = bad.stderr.splitlines()
    assert line.startswith("health-sidecar: configuration error: SIDECAR_GRPC_PORT='none'")


# --- health-sidecar probes --grpc ----------------------------------------------------------------


@pytest.mark.process
def test_probes_grpc_prints_grpc_probes_with_the_same_numbers(monkeypatch):
    profile = str(ROOT / "config" / "vllm-aggregated.env")
    done = run_cli("--env-file", profile, "probes", "--grpc", env={"SIDECAR_GRPC_PORT": "50051"})
    assert done.returncode == 0, done.stderr
    probes = yaml.safe_load(done.stdout)
    port = {"SIDECAR_GRPC_PORT": "50051"}
    http = yaml.safe_load(run_cli("--env-file", profile, "probes", env=port).stdout)
    services = {"startupProbe": "readiness", "livenessProbe": "liveness"}
    assert set(probes) == set(http) == {"startupProbe", "livenessProbe", "readinessProbe"}
    for name, probe in probes.items():
        assert probe["grpc"] == {"port": 50051, "service": services.get(name, "readiness")}
        assert "httpGet" not in probe
        numbers = {k: v for k, v in probe.items() if k != "grpc"}
        assert numbers == {k: v for k, v in http[name].items() if k != "httpGet"}, name
    assert "--grpc` for backend vllm" in done.stdout  # how it was sized, said in its comment
    # The printed text is the function's (tests/test_deploy_dropin.py checks the example on it).
    settings_from(monkeypatch, SIDECAR_GRPC_PORT="50051")  # the only variable set
    assert render(resolve(load(profile)), 7200.0, grpc=True) == done.stdout.rstrip("\n")


@pytest.mark.process
def test_probes_grpc_without_the_port_is_one_line():
    done = run_cli("probes", "--grpc")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "health-sidecar: --grpc: expected SIDECAR_GRPC_PORT set (the gRPC health service is "
        "off without it)"
    ]
    assert done.stdout == ""
