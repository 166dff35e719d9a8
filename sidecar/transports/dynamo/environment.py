"""The environment Dynamo's runtime client sees inside the sidecar.

The runtime reads Dynamo's variables from the process environment, and strictly. The sidecar
reads some of the same names for itself: ``DYN_SYSTEM_PORT`` is the port the *sidecar* serves
/health on (a runtime that saw it would start a second system server there), and the runtime
refuses a fractional ``DYN_CANARY_WAIT_TIME`` that the sidecar accepts ("invalid type: found float
1, expected u64"). So once the sidecar has read its settings, the runtime gets only what a
client needs: its transport and discovery variables, no system server, no canary of its own.

:func:`client_environment` is pure (tested); :func:`apply` installs its result. It must run in
the main thread before any other thread starts (setenv is not thread-safe) and before the runtime
is created.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from sidecar.config import DiscoveryBackend
from sidecar.transports.dynamo.settings import PlaneConfig

# Passed through as the worker's: how to reach the request plane and discovery.
PASSED = ("DYN_TCP_", "DYN_HTTP_RPC_", "DYN_NATS_", "NATS_", "ETCD_", "DYN_ETCD_")
PASSED_NAMES = (
    "DYN_LOG",
    "DYN_LOGGING_JSONL",
    "DYN_SDK_DISABLE_ANSI_LOGGING",
    "DYN_RUNTIME_NUM_WORKER_THREADS",
)
# The client's own system server: off.
NO_SYSTEM_SERVER = "-1"
# The worker streams answers back to an address the client names: in a pod the worker is on the
# same network namespace, so loopback reaches it and keeps the answers inside the pod.
RESPONSE_STREAM_HOST = "127.0.0.1"
# The runtime logs a line per request at info; the sidecar logs state changes only (but at DEBUG).
RUNTIME_LOG_DEBUG = "info"
RUNTIME_LOG_DEFAULT = "error"


def client_environment(
    config: PlaneConfig, environ: Mapping[str, str], *, file_kv: str | None = None
) -> dict[str, str]:
    """The process environment for the runtime client: ``environ`` without Dynamo's variables
    except those a client needs, with the client's own settings. ``file_kv``: the file-discovery
    directory the client reads (the worker's, or the sidecar's private one)."""
    env = {
        k: v
        for k, v in environ.items()
        if not k.startswith("DYN_") or k.startswith(PASSED) or k in PASSED_NAMES
    }
    env["DYN_SYSTEM_PORT"] = NO_SYSTEM_SERVER
    env.setdefault("DYN_TCP_RESPONSE_STREAM_HOST", RESPONSE_STREAM_HOST)
    env.setdefault("DYN_LOG", RUNTIME_LOG_DEBUG if config.debug else RUNTIME_LOG_DEFAULT)
    env.setdefault("DYN_SDK_DISABLE_ANSI_LOGGING", "1")  # its lines go to the sidecar's log
    env["DYN_DISCOVERY_BACKEND"] = config.discovery.value
    env["DYN_REQUEST_PLANE"] = config.plane.value
    if file_kv is not None:
        env["DYN_FILE_KV"] = file_kv
    return env


def apply(env: Mapping[str, str]) -> None:
    """Make ``env`` the process environment (main thread, before other threads start)."""
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    os.environ.update(env)


def prepare(config: PlaneConfig) -> str | None:
    """Give the process the runtime client's environment. Under Kubernetes discovery, also make
    the private file-discovery directory the client reads (in TMPDIR: an emptyDir in a pod whose
    root filesystem is read-only) and return it."""
    private = None
    file_kv = config.file_kv
    if config.discovery is DiscoveryBackend.KUBERNETES:
        private = file_kv = tempfile.mkdtemp(prefix="health-sidecar-discovery-")
    apply(client_environment(config, os.environ, file_kv=file_kv))
    return private
