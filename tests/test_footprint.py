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
from sidecar.config import load_settings
from sidecar.wiring import build
side = build(load_settings())
print(json.dumps({m: m in sys.modules for m in ("grpc", "grpc_health", "dynamo.runtime")}))
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
