"""Dynamo's own variable names (never refused as misspelled: tests/test_variables.py) are those
of the runtime the sidecar is tested with."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.engines import require
from tests.support.harness import ROOT

pytestmark = pytest.mark.engine


def test_dynamos_names_are_those_of_the_runtime_the_sidecar_is_tested_with():
    """sidecar/dynamo_variables.txt is what scripts/dynamo_variables.py reads off the installed
    ai-dynamo and ai-dynamo-runtime 1.6.1 (scripts/prepare_engines.sh makes their venv)."""
    python = require("DYNAMO_PYTHON")["DYNAMO_PYTHON"]
    done = subprocess.run(
        [python, "scripts/dynamo_variables.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
