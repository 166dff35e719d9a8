"""The README's first command: ``health-sidecar demo`` shows the sidecar working and cleans up."""

from __future__ import annotations

import re
import signal
import sys

import httpx

from tests.harness import LOOPBACK, Proc, base_env, free_port, wait_until


def test_demo_starts_a_fake_engine_goes_ready_and_ends_it_on_ctrl_c():
    port = free_port()
    nothing_there = f"http://{LOOPBACK}:{free_port()}"
    env = base_env() | {"DYN_SYSTEM_PORT": str(port), "SIDECAR_ENGINE_URL": nothing_there}
    demo = Proc([sys.executable, "-m", "sidecar", "demo"], env, "demo")
    try:
        url = f"http://{LOOPBACK}:{port}"

        def ready() -> bool:
            assert demo.popen.poll() is None, demo.output()
            return httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200

        wait_until(ready, 15, what="the demo to be ready")
        engine = re.search(r"fakeengine listening on (http://\S+)", demo.output())
        assert engine is not None, demo.output()
        assert f"curl -s {url}/health" in demo.output()
        demo.popen.send_signal(signal.SIGINT)  # Ctrl-C: exit now (SIGTERM would drain)
        assert demo.popen.wait(10) == 0
        try:
            httpx.get(f"{engine[1]}/health", timeout=1, trust_env=False)
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("the demo left its fake engine running")
    finally:
        demo.stop()
