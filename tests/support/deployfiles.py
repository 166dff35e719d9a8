"""What the deployment-file tests share: the validators (found on PATH or beside this Python),
running them, the env-file reader, and the Kubernetes versions the files are checked against."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from tests.support.harness import ROOT
from tests.support.prerequisites import missing as prerequisite_missing

OLDEST_K8S = "1.29.0"  # native sidecars: restartPolicy Always on an init container
MAX_LOAD_SECONDS = 7200


def read_env(path: Path) -> dict[str, str]:
    """NAME=value lines; blank lines and # comments skipped (as compose and kustomize read them)."""
    values = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def tool(name: str) -> str | None:
    """A validator on PATH, or installed next to this Python (the venv's bin directory)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else None


def missing(what: str) -> NoReturn:
    """A validator is missing (tests.support.prerequisites)."""
    prerequisite_missing(what)


def need(name: str, install: str) -> str:
    found = tool(name)
    if found is None:
        missing(f"{name} not found on PATH or next to {sys.executable}; {install}")
    return found


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, **kw
    )


@cache
def kustomize() -> list[str] | None:
    if found := tool("kustomize"):
        return [found, "build"]
    if found := tool("kubectl"):
        return [found, "kustomize"]
    return None


@cache
def newest_k8s(validator: str) -> str:
    proc = run([validator, "--help"])
    found = re.search(r"Defaults to (\d+\.\d+\.\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)
