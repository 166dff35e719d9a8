"""The sidecar as a real process against the fake engine as a real process, over loopback: what
only real processes show. The wiring (the command line, the environment, uvicorn, real HTTP) per
backend and role; real SIGSTOP, SIGCONT and SIGKILL of the engine; probes answered while the
monitor's thread waits on a frozen engine; SIGTERM to the sidecar. Every decision is tested
in-process on a virtual clock: tests/test_roles.py, test_engine_states.py, test_http_answers.py,
test_verdicts_inprocess.py, test_busy.py and test_ranks_inprocess.py.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, other knobs at their
defaults (retry 1 s, failure threshold 2, success threshold 1, registration every 1 s).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.exposition import metric

pytestmark = pytest.mark.process

WAIT, TIMEOUT = 1.0, 0.5
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}
ROLES = [(b, m) for b in ("vllm", "sglang", "trtllm") for m in ("aggregated", "prefill", "decode")]


def canaries(fake) -> list[dict]:
    return [r for r in fake.requests() if r["path"] in ("/v1/completions", "/generate")]


@pytest.mark.parametrize(("backend", "mode"), ROLES)
def test_each_backend_and_role_is_wired_end_to_end(engine, sidecar, backend, mode):
    """``python -m sidecar`` reads its environment (a JSON list included), reaches the engine
    over loopback with the role-aware canary, and serves /health and /metrics with uvicorn.
    What it then decides: tests/test_roles.py."""
    fake = engine(backend, mode)
    env = CANARY_ON | {
        "SIDECAR_BACKEND": backend,
        "SIDECAR_DISAGGREGATION_MODE": mode,
        "SIDECAR_ENGINE_URL": fake.url,
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }
    side = sidecar(env)
    side.wait_status(200, 5)
    _status, body = side.health()
    assert body["status"] == "ready"
    assert body["endpoints"] == {"generate": "ready"}
    assert body["rule"] == "listed_endpoints"
    assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

    # What reached the engine: the role-aware body, never a rejected one.
    sent = canaries(fake)
    assert sent, "no canary reached the engine"
    first = sent[0]
    assert first["headers"]["x-request-id"].startswith("canary-")
    if backend == "trtllm" and mode != "aggregated":
        assert first["json"]["disaggregated_params"] == {"request_type": "context_and_generation"}
    if backend == "sglang" and mode != "aggregated":
        assert first["json"]["bootstrap_host"] == "2.2.2.2"
        assert isinstance(first["json"]["bootstrap_room"], int)
    if backend == "vllm":
        assert "kv_transfer_params" not in first["json"]
    text = side.metrics()
    passed = metric(text, "health_sidecar_canary_total", endpoint="generate", outcome="success")
    assert (passed or 0) >= 1
    assert metric(text, "health_sidecar_canary_total", endpoint="generate", outcome="error") == 0


def test_sigstop_sigcont_and_kill_restart(engine, sidecar):
    """Real signals to a real engine: the kernel still accepts connections to a stopped process
    and the sidecar's deadline must fire on a socket that never answers; a killed one refuses
    (ECONNREFUSED, and the pool's kept-alive connections die); a new process on the same port
    is found again without restarting the sidecar. The exact bounds of the same sequence, on
    the modelled link: tests/test_engine_states.py."""
    fake = engine("openai", "aggregated")
    env = CANARY_ON | {"SIDECAR_BACKEND": "openai", "SIDECAR_ENGINE_URL": fake.url}
    side = sidecar(env)
    side.wait_status(200, 5)

    fake.proc.signal(signal.SIGSTOP)
    # Frozen whole: the health check's timeout sends a canary at once; two canary timeouts in
    # a row (retry 1 s apart) decide.
    detect = side.wait_status(503, WAIT + TIMEOUT + 1.0 + TIMEOUT + 0.5)
    fake.proc.signal(signal.SIGCONT)
    recover = side.wait_status(200, 3)
    print(f"SIGSTOP detect {detect:.2f} s, SIGCONT recover {recover:.2f} s")

    fake.proc.kill()
    side.wait_status(503, 3)
    _, body = side.health()
    assert "engine not registered" in body["reason"]
    assert side.get("/live").status_code == 200  # gone is not hung: the runtime restarts it
    fake.start()
    side.wait_status(200, 5)


def test_probes_answer_in_milliseconds_while_the_engine_is_frozen(engine, sidecar):
    """Wall-clock latency of the real server while the monitor's own thread and loop wait on a
    frozen engine: that the HTTP server never shares their wait is a matter of threads, which
    no single-loop in-process test can show (that the answers come from memory, without I/O:
    tests/test_engine_states.py). The sidecar's own probe reads the monitor thread's heartbeat
    meanwhile."""
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.proc.signal(signal.SIGSTOP)
    try:
        slowest = 0.0
        for _ in range(50):
            start = time.monotonic()
            side.get("/health")
            side.get("/live")
            slowest = max(slowest, time.monotonic() - start)
        assert slowest < 0.25, slowest  # two requests; never a canary's 0.5 s timeout
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the engine frozen: the sidecar stays alive
            answer = side.get("/sidecar/live")
            assert answer.status_code == 200
            assert answer.json()["monitor_heartbeat_age_seconds"] < 2
            time.sleep(0.05)
    finally:
        fake.proc.signal(signal.SIGCONT)


def test_sigterm_drains_until_the_engine_is_gone_then_exits_zero(engine, sidecar):
    """SIGTERM to the sidecar's process: its signal handling, draining until the engine's
    process is gone, and its exit status."""
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DRAIN_TIMEOUT": "30"})
    side.wait_status(200, 5)
    side.proc.signal(signal.SIGTERM)
    side.wait_status(503, 1)
    _status, body = side.health()
    assert body["rule"] == "draining"
    assert side.get("/live").status_code == 200
    assert metric(side.metrics(), "health_sidecar_draining") == 1
    assert side.proc.popen.poll() is None  # still serving while the engine drains
    fake.proc.kill()
    assert side.proc.popen.wait(3) == 0


def test_sigterm_exits_zero_when_the_grace_period_ends(engine, sidecar):
    """SIGTERM with the engine still up: the process exits 0 when its grace period ends, and
    its log says why."""
    fake = engine("vllm", "aggregated")
    side = sidecar({"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DRAIN_TIMEOUT": "1"})
    side.wait_status(200, 5)
    side.proc.signal(signal.SIGTERM)
    assert side.proc.popen.wait(4) == 0
    assert "drain: 1 s passed with the engine still up" in side.proc.output()


def test_not_live_exits_with_the_pod_restart_code(engine, sidecar):
    """SIDECAR_POD_RESTART_EXIT_CODE as users set it: a hung engine, the liveness clock runs out,
    and the process's exit status is the code (what a restartPolicyRules entry matches)."""
    fake = engine("vllm", "aggregated")
    env = {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_POD_RESTART_EXIT_CODE": "88"}
    side = sidecar(CANARY_ON | env | {"SIDECAR_LIVENESS_WINDOW": "2"})
    side.wait_status(200, 5)
    fake.fault(hang_generation=True)
    # wait + retry + window = 4 s at the longest (Policy.to_notlive), and two to exit.
    assert side.proc.popen.wait(6) == 88
    assert "exiting with 88 (SIDECAR_POD_RESTART_EXIT_CODE)" in side.proc.output()
