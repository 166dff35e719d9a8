"""Loaded by every Python process the tests start (this directory is first on their PYTHONPATH):
watch what the process makes in the temporary directory (``_health_sidecar_residue``), then run
the ``sitecustomize`` this one shadows, if the interpreter has one."""

import importlib.util
import os
import sys

import _health_sidecar_residue

_health_sidecar_residue.install_from_environment()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(os.path.abspath(_entry or os.curdir), "sitecustomize.py")
    if os.path.dirname(_candidate) != _here and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _candidate)
        if _spec is not None and _spec.loader is not None:
            _module = importlib.util.module_from_spec(_spec)
            sys.modules["_shadowed_sitecustomize"] = _module
            _spec.loader.exec_module(_module)
        break
