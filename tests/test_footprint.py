"""Only what the configuration uses is loaded: grpcio with SIDECAR_GRPC_PORT or a grpc://
registration, Dynamo's runtime with SIDECAR_TRANSPORT=dynamo. Checked in a fresh interpreter per
configuration, as the sidecar starts: its composition root builds every part (and, for the
monitor's parts, the coroutine that builds them is what imports)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.harness import ROOT, base_env

pytestmark = pytest.mark.process

LOADED = """
import json, sys
from sidecar.wiring import build, load, resolve
side = build(resolve(load()))
names = ("grpc", "grpc_health", "dynamo.runtime", "google.protobuf", "smg_grpc_proto")
print(json.dumps({m: m in sys.modules for m in names}))
"""


def loaded(env: dict[str, str]) -> dict[str, bool]:
    done = subprocess.run(
        [sys.executable, "-c", LOADED],
        env=base_env() | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("env", "grpc"),
    [
        ({}, False),
        ({"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_BACKEND": "sglang"}, False),
        ({"SIDECAR_GRPC_PORT": "9095"}, True),
    ],
)
def test_grpcio_is_loaded_only_when_configured(env, grpc):
    said = loaded(env)
    assert said["grpc"] is grpc
    assert said["grpc_health"] is grpc
    assert said["dynamo.runtime"] is False
    assert said["smg_grpc_proto"] is False


def test_the_grpc_transports_stubs_wait_for_the_monitor():
    """SIDECAR_TRANSPORT=grpc: the stubs (and protobuf) are imported by the monitor's parts as
    it starts, not by the composition root; an HTTP configuration never imports them."""
    grpc = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "grpc",
        "SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051",
    }
    assert loaded(grpc)["smg_grpc_proto"] is False
    openengine = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "openengine",
        "SIDECAR_BACKEND": "trtllm",
        "SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051",
    }
    assert loaded(openengine)["google.protobuf"] is False  # its declarations: the monitor's
    http = loaded({"DYN_HEALTH_CHECK_ENABLED": "true"})
    assert http["google.protobuf"] is False
    assert http["smg_grpc_proto"] is False
