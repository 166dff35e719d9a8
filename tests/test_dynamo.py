"""The Dynamo profile: the sidecar beside a Dynamo mocker worker and its frontend.

The canary goes through the frontend's OpenAI API, as a client's request would. A worker paused
longer than its discovery lease is dropped by the frontend and never re-registers after SIGCONT,
while the worker's own /health says ready and the frontend's /health says healthy. The sidecar
says notready, with the reason, and (the same canary having passed before) fails liveness so that
the worker gets restarted.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.engines import Dynamo
from tests.harness import wait_until

LEASE_DEADLINE = 40  # the file lease expires after about 8 s; give the frontend time to notice


@pytest.fixture
def dynamo() -> Iterator[Dynamo]:
    stack = Dynamo()
    try:
        yield stack.start()
    finally:
        stack.close()


def served_models(dynamo: Dynamo) -> list[str]:
    with httpx.Client(timeout=1, trust_env=False) as client:
        data = client.get(f"{dynamo.frontend_url}/v1/models").json().get("data", [])
    return [m.get("id") for m in data]


def test_worker_paused_past_its_lease_is_notready_while_dynamo_says_ready(dynamo, sidecar):
    side = sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": "openai",
            "SIDECAR_ENGINE_URL": dynamo.frontend_url,
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
            "SIDECAR_LIVENESS_WINDOW": "3",
        }
    )
    side.wait_status(200, 10)
    assert dynamo.worker_health()[0] == 200

    assert dynamo.worker is not None
    dynamo.worker.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    side.wait_status(503, 5)  # the paused worker: canaries time out through the frontend
    wait_until(
        lambda: "tiny" not in served_models(dynamo),
        LEASE_DEADLINE,
        interval=0.25,
        what="the frontend to drop the paused worker",
    )
    dropped_after = time.monotonic() - paused_at
    dynamo.worker.signal(signal.SIGCONT)

    # The worker is back and says so; Dynamo's frontend says healthy; the model is gone for good.
    wait_until(lambda: dynamo.worker_health()[0] == 200, 5, what="the worker's /health")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        worker_status, worker_body = dynamo.worker_health()
        frontend_status, frontend_body = dynamo.frontend_health()
        sidecar_status, sidecar_body = side.health()
        assert worker_status == 200
        assert json.loads(worker_body)["status"] == "ready"
        assert frontend_status == 200
        assert sidecar_status == 503
        time.sleep(0.2)
    assert "tiny" not in served_models(dynamo)
    last = sidecar_body["checks"]["generate"]["last_canary"]
    assert last["outcome"] == "error"
    assert "HTTP 404" in last["reason"]
    print(
        f"DYNAMO dropped after {dropped_after:.1f} s paused; after SIGCONT:\n"
        f"  worker   /health {worker_status} {worker_body}\n"
        f"  frontend /health {frontend_status} {frontend_body[:160]}\n"
        f"  sidecar  /health {sidecar_status} reason: {sidecar_body['reason']}"
    )
    # The same canary passed before in this incarnation: a restart of the worker can fix this.
    side.wait_status(503, 3 + 2, path="/live")
    assert "canary failing hard" in side.get("/live").json()["reason"]
