"""Maintenance windows through the control routes, and who may declare them: the sidecar and the
fake engine as real processes over loopback."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.harness import LOOPBACK, free_port, wait_until

TOKEN = "s3cret-control-token"


def canaries(fake) -> list[dict]:
    return [r for r in fake.requests() if r["path"] == "/v1/completions"]


def clear_requests(fake) -> None:
    fake.http.delete(f"{fake.url}/_fake/requests").raise_for_status()


def env(fake, port: int, **extra: str) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_ENGINE_URL": fake.url,
        "SIDECAR_CONTROL_PORT": str(port),
    } | extra


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_a_window_pauses_canaries_keeps_the_worker_live_and_ends_by_itself(engine, sidecar):
    fake = engine("vllm")
    port = free_port()
    side = sidecar(env(fake, port, SIDECAR_CONTROL_TOKEN=TOKEN))
    side.wait_status(200, 5)
    control = httpx.Client(
        base_url=f"http://{LOOPBACK}:{port}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        trust_env=False,
        timeout=1,
    )
    with control:
        answer = control.put("/maintenance", json={"seconds": 2.5, "reason": "weights, step 42"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["maintenance"]["reason"] == "weights, step 42"
        clear_requests(fake)
        status, body = side.health()
        assert status == 503
        assert body["reason"].startswith("generate: maintenance: weights, step 42 (ends in ")
        assert (
            body["checks"]["generate"]["lifecycle"]["maintenance"]["reason"] == "weights, step 42"
        )
        assert side.get("/live").status_code == 200
        metrics = side.metrics()
        assert 'health_sidecar_endpoint_paused{endpoint="generate",state="maintenance"} 1.0' in (
            metrics
        )
        # Ends by itself; a canary proves the engine before it is ready again.
        side.wait_status(200, 5)
        assert canaries(fake), "no canary proved the engine after the window"
        assert control.get("/maintenance").json() == {"maintenance": None}
        output = side.proc.output()
        assert "maintenance ended: its 2.5 s are up" in output
        assert TOKEN not in output

        # Ended early through the control route.
        control.put("/maintenance", json={"seconds": 600, "reason": "long one"})
        side.wait_status(503, 2)
        assert control.delete("/maintenance").json() == {"maintenance": None}
        side.wait_status(200, 3)


def test_no_canary_reaches_the_engine_during_a_window(engine, sidecar):
    fake = engine("vllm")
    port = free_port()
    side = sidecar(env(fake, port))
    side.wait_status(200, 5)
    with httpx.Client(base_url=f"http://{LOOPBACK}:{port}", trust_env=False, timeout=1) as c:
        assert c.put("/maintenance", json={"seconds": 3, "reason": "rl"}).status_code == 200
        clear_requests(fake)

        # Three canary waits (DYN_CANARY_WAIT_TIME=1) pass inside the window.
        def ends_in() -> float:
            window = side.get("/health").json()["checks"]["generate"]["lifecycle"]["maintenance"]
            return window["ends_in_seconds"]

        wait_until(lambda: ends_in() < 0.5, 5, what="the window's last half second")
        assert canaries(fake) == []


def test_the_control_routes_are_not_served_to_the_pod_network(engine, sidecar):
    fake = engine("vllm")
    port = free_port()
    side = sidecar(env(fake, port, SIDECAR_CONTROL_TOKEN=TOKEN))
    side.wait_status(200, 5)
    # The server the pod network reaches (DYN_SYSTEM_HOST 0.0.0.0) has no such route.
    window = {"seconds": 60, "reason": "from outside"}
    for method in ("PUT", "DELETE", "GET"):
        answer = side.http.request(method, f"{side.url}/maintenance", json=window)
        assert answer.status_code in (404, 405), (method, answer.status_code)
    # The control server listens on 127.0.0.1 only: from any other address it is unreachable.
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    # On loopback, a container of the pod without the token is refused.
    url = f"http://{LOOPBACK}:{port}/maintenance"
    assert side.http.put(url, json=window).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert side.http.put(url, json=window, headers=wrong).status_code == 401
    assert side.http.get(url, headers=wrong).status_code == 401
    assert side.get("/health").status_code == 200
    # Bad windows are refused whoever asks.
    right = {"Authorization": f"Bearer {TOKEN}"}
    for bad in ({"seconds": 0, "reason": "x"}, {"seconds": 3601, "reason": "x"}, {"reason": "x"},
                {"seconds": 5, "reason": ""}, {"seconds": 5, "reason": "a\nb"}):  # fmt: skip
        assert side.http.put(url, json=bad, headers=right).status_code == 422, bad
    assert side.get("/health").status_code == 200


def test_no_control_routes_without_a_port(engine, sidecar):
    fake = engine("vllm")
    side = sidecar({"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    assert "control routes" not in side.proc.output()
    answer = side.http.put(f"{side.url}/maintenance", json={"seconds": 5, "reason": "x"})
    assert answer.status_code in (404, 405)
