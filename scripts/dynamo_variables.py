"""Write sidecar/dynamo_variables.txt: the names of Dynamo's own environment variables, which the
sidecar shares a pod with and must never refuse as misspelled (sidecar/config.py, the unknown
variables check).

The names are read from an installed ai-dynamo and ai-dynamo-runtime (their Python sources and the
strings of their compiled extension), plus those Dynamo's Kubernetes operator sets in a worker's
pod spec. Run it with the Python of a venv that has both (scripts/prepare_engines.sh makes one):

    ~/.cache/health-sidecar/dynamo-1.6.1-venv/bin/python scripts/dynamo_variables.py

tests/test_variables.py checks the file against the installed runtime when one is prepared.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "sidecar" / "dynamo_variables.txt"
NAME = re.compile(rb"DYN_[A-Z0-9_]+")
# What Dynamo's operator puts in a worker's pod spec (its component defaults and snapshot
# restore: deploy/cloud/operator, ai-dynamo 1.6), beside what the runtime itself reads.
OPERATOR = (
    "DYN_COMPONENT",
    "DYN_DISCOVERY_BACKEND",
    "DYN_EVENT_PLANE",
    "DYN_HEALTH_CHECK_ENABLED",
    "DYN_NAMESPACE",
    "DYN_NAMESPACE_PREFIX",
    "DYN_NAMESPACE_WORKER_SUFFIX",
    "DYN_PARENT_DGD_K8S_NAME",
    "DYN_PARENT_DGD_K8S_NAMESPACE",
    "DYN_REQUEST_PLANE",
    "DYN_SNAPSHOT_CONTROL_DIR",
    "DYN_SNAPSHOT_RESTORE_PLACEHOLDER",
    "DYN_SYSTEM_ENABLED",
    "DYN_SYSTEM_PORT",
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS",
)
# Read by the runtime under a prefix it completes at run time (DYN_CANARY_ + WAIT_TIME, ...), so
# absent from its string table: from Dynamo's documentation of its health checks and HTTP
# settings (shared/reference/dynamo-health.md).
DOCUMENTED = (
    "DYN_CANARY_WAIT_TIME",
    "DYN_EVENT_PLANE_HOST",
    "DYN_HEALTH_CHECK_BUSY_STALL",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT",
    "DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS",
    "DYN_HTTP_BACKEND_TTFT_STREAM_TIMEOUT_SECS",
    "DYN_HTTP_SSE_INACTIVITY_TIMEOUT_SECS",
    "DYN_HTTP_SVC_HEALTH_PATH",
    "DYN_HTTP_SVC_LIVE_PATH",
    "DYN_RUNTIME_INHIBITED_DURATION_SECS",
    "DYN_TCP_REQUEST_TIMEOUT",
)


def names_in(blob: bytes) -> set[str]:
    """Every DYN_ name in a file; names a compiled string table ran together are split apart."""
    found = set()
    for match in NAME.findall(blob):
        for part in match.split(b"DYN_")[1:]:
            name = "DYN_" + part.decode()
            if not name.endswith("_") and len(name) > len("DYN_") + 1:
                found.add(name)
    return found


def installed() -> tuple[set[str], str]:
    names: set[str] = set()
    versions = []
    for dist in ("ai-dynamo-runtime", "ai-dynamo"):
        meta = importlib.metadata.distribution(dist)
        versions.append(f"{dist} {meta.version}")
        for file in meta.files or ():
            if file.suffix in (".py", ".so"):
                names |= names_in(Path(meta.locate_file(file)).read_bytes())
    return names, ", ".join(versions)


def main(argv: list[str]) -> int:
    """Write the file; with --check, exit 1 if it differs from what would be written."""
    names, versions = installed()
    names |= set(OPERATOR) | set(DOCUMENTED)
    header = (
        f"# Dynamo's own environment variables: {versions}, its operator's pod spec and its docs.\n"
        "# Written by scripts/dynamo_variables.py; never refused as misspelled.\n"
    )
    text = header + "".join(f"{n}\n" for n in sorted(names))
    if "--check" in argv:
        same = OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'differs from the installed runtime'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"{OUT}: {len(names)} names ({versions})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
