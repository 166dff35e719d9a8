"""Maintenance windows through the control routes, and who may declare them.

What the routes decide (a window pauses canaries, keeps the worker live, ends by itself or
through the route; the token; bad windows; no routes without a port) is shown in-process on a
virtual clock: the whole sidecar (``tests/support/inprocess.py``) against the fake engine's app,
the control routes beside it (``tests/support/control.py``). What only a real process shows stays
in the process tier: the control server listening on 127.0.0.1 alone, and a window declared on
that port reaching the monitor's thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from sidecar.wiring import build, resolve
from sidecar.wiring.build import log_serving
from tests.support.control import control_client
from tests.support.engineprocess import ProcessLink
from tests.support.exposition import metric
from tests.support.harness import LOOPBACK, free_port
from tests.support.inprocess import InProcessSidecar, run_virtually, running, settings_of, until

TOKEN = "s3cret-control-token"
URL = "http://engine:8000"
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}
WITH_CONTROL = CANARY_ON | {"SIDECAR_CONTROL_PORT": "9091"}


async def canaries(engine: ProcessLink) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == "/v1/completions"]


async def clear_requests(engine: ProcessLink) -> None:
    (await engine.admin.delete("/_fake/requests")).raise_for_status()


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


async def maintenance_in(side: InProcessSidecar) -> dict[str, Any] | None:
    _, body = await side.health_body()
    return body["checks"]["generate"]["lifecycle"]["maintenance"]  # type: ignore[no-any-return]


@pytest.mark.unit
def test_a_window_pauses_canaries_keeps_the_worker_live_and_ends_by_itself(caplog):
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        engine = ProcessLink("vllm")
        env = WITH_CONTROL | {"SIDECAR_CONTROL_TOKEN": TOKEN}
        async with running(env, {URL: engine}) as side, control_client(side, TOKEN) as control:
            await side.wait_status(200, 5)
            window = {"seconds": 2.5, "reason": "weights, step 42"}
            answer = await control.put("/maintenance", json=window)
            assert answer.status_code == 200, answer.text
            assert answer.json()["maintenance"]["reason"] == "weights, step 42"
            await clear_requests(engine)
            status, body = await side.health_body()
            assert status == 503
            assert body["reason"].startswith("generate: maintenance: weights, step 42 (ends in ")
            assert (await maintenance_in(side))["reason"] == "weights, step 42"
            assert (await side.get("/live")).status_code == 200
            paused = metric(
                await side.metrics(),
                "health_sidecar_endpoint_paused",
                endpoint="generate",
                state="maintenance",
            )
            assert paused == 1.0
            # Ends by itself; a canary proves the engine before it is ready again.
            took = await side.wait_status(200, 5)
            assert took >= 2.5 - 0.05, took
            assert await canaries(engine), "no canary proved the engine after the window"
            assert (await control.get("/maintenance")).json() == {"maintenance": None}
            assert any("maintenance ended: its 2.5 s are up" in line for line in side.log)

            # Ended early through the control route.
            await control.put("/maintenance", json={"seconds": 600, "reason": "long one"})
            await side.wait_status(503, 2)
            assert (await control.delete("/maintenance")).json() == {"maintenance": None}
            await side.wait_status(200, 3)
            assert TOKEN not in "\n".join(side.log)

    run_virtually(main)
    assert TOKEN not in caplog.text


@pytest.mark.unit
def test_no_canary_reaches_the_engine_during_a_window():
    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(WITH_CONTROL, {URL: engine}) as side, control_client(side) as control:
            await side.wait_status(200, 5)
            window = {"seconds": 3, "reason": "rl"}
            assert (await control.put("/maintenance", json=window)).status_code == 200
            await clear_requests(engine)

            # Three canary waits (DYN_CANARY_WAIT_TIME=1) pass inside the window.
            async def last_half_second() -> bool:
                return (await maintenance_in(side))["ends_in_seconds"] < 0.5

            await until(last_half_second, 5, what="the window's last half second")
            assert await canaries(engine) == []

    run_virtually(main)


@pytest.mark.unit
def test_the_control_routes_want_the_token_and_a_good_window():
    """The server the pod network reaches has no control route; the control routes refuse a
    container of the pod without the token, and bad windows whoever asks."""
    window = {"seconds": 60, "reason": "from outside"}

    async def main() -> None:
        engine = ProcessLink("vllm")
        env = WITH_CONTROL | {"SIDECAR_CONTROL_TOKEN": TOKEN}
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            for method in ("PUT", "DELETE", "GET"):
                answer = await side.http.request(method, "/maintenance", json=window)
                assert answer.status_code in (404, 405), (method, answer.status_code)
            async with control_client(side) as anyone:
                assert (await anyone.put("/maintenance", json=window)).status_code == 401
            async with control_client(side, "not-the-token") as wrong:
                assert (await wrong.put("/maintenance", json=window)).status_code == 401
                assert (await wrong.get("/maintenance")).status_code == 401
                assert (await wrong.delete("/maintenance")).status_code == 401
            assert (await side.health_body())[0] == 200
            async with control_client(side, TOKEN) as right:
                for bad in ({"seconds": 0, "reason": "x"}, {"seconds": 3601, "reason": "x"},
                            {"reason": "x"}, {"seconds": 5, "reason": ""},
                            {"seconds": 5, "reason": "a\nb"}):  # fmt: skip
                    answer = await right.put("/maintenance", json=bad)
                    assert answer.status_code == 422, (bad, answer.text)
            assert (await side.health_body())[0] == 200
            assert await maintenance_in(side) is None

    run_virtually(main)


@pytest.mark.unit
def test_no_control_routes_without_a_port(caplog):
    """No SIDECAR_CONTROL_PORT: no control server is built (no port is opened), none is said,
    and the HTTP server has no such route."""
    caplog.set_level(logging.INFO)
    blueprint = resolve(settings_of(CANARY_ON))
    sidecar = build(blueprint)
    try:
        assert sidecar.servers.control is None
        assert len(sidecar.servers.all()) == 1
    finally:
        sidecar.monitor.loop.close()  # the monitor's loop, never started
    log_serving(blueprint)
    assert "health-sidecar serving" in caplog.text
    assert "control routes" not in caplog.text

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(CANARY_ON, {URL: engine}) as side:
            answer = await side.http.put("/maintenance", json={"seconds": 5, "reason": "x"})
            assert answer.status_code in (404, 405)

    run_virtually(main)


@pytest.mark.process
def test_the_control_server_listens_on_loopback_only_and_reaches_the_monitor(engine, sidecar):
    """The control server binds 127.0.0.1 alone (from any other address it is unreachable),
    wants its token there, and a window declared on it crosses to the monitor's thread."""
    fake = engine("vllm")
    port = free_port()
    side = sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_CONTROL_PORT": str(port),
            "SIDECAR_CONTROL_TOKEN": TOKEN,
        }
    )
    side.wait_status(200, 5)
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    url = f"http://{LOOPBACK}:{port}/maintenance"
    window = {"seconds": 60, "reason": "from the pod"}
    assert side.http.put(url, json=window).status_code == 401
    answer = side.http.put(url, json=window, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["maintenance"]["reason"] == "from the pod"
    assert side.health()[1]["reason"].startswith("generate: maintenance: from the pod")
    assert side.get("/live").status_code == 200
    ended = side.http.delete(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ended.json() == {"maintenance": None}
    side.wait_status(200, 3)
    assert "control routes on http://127.0.0.1:" in side.proc.output()
    assert TOKEN not in side.proc.output()
