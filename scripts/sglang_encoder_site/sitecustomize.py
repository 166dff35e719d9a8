"""Import-time fixes that let SGLang 0.5.23's encoder server (``--encoder-only``) start on this
CPU, for processes with the encoder site directory (``$SGLANG_MM_SITE_DIR``) on ``PYTHONPATH``.

The encoder needs everything the aggregated server needs, plus one fix of its own:

1. The project's SGLang fixes, ``scripts/sglang_site``: the ``sgl_kernel`` stand-in package and
   its sitecustomize (torchvision without its C ops, the mooncake sender, the DP controller's
   wait). Python imports only the first ``sitecustomize`` on ``sys.path``, so that one cannot
   simply be a second ``PYTHONPATH`` entry. ``scripts/prepare_engines.sh --only sglang-encode``
   installs one self-contained directory instead: this file as ``sitecustomize.py``, the
   project's as ``_sglang_sitecustomize.py`` beside it (imported from here, first) and a copy
   of the ``sgl_kernel`` stand-in. One ``PYTHONPATH`` entry then carries everything, the copies
   are checked against their sources by the preparation, and neither an environment variable
   naming the other file nor the cache's layout (where ``$SGLANG_SITE_DIR`` lies relative to
   this directory) has to be right at run time.
2. ``torch.ops.sgl_kernel.<name>_cpu``: the encoder's import chain
   (``disaggregation/encoder/preprocessor.py`` -> ``multimodal/processors/qwen_vl.py`` ->
   ``models/interns2_mobius.py`` -> ``models/qwen3_5.py``) looks up
   ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`` at module level, unconditionally. Without a
   CPU build of sgl_kernel no op of that namespace is registered, and start-up dies with
   ``AttributeError: '_OpNamespace' 'sgl_kernel' object has no attribute
   'fused_sigmoid_mul_cpu'``. The aggregated server never imports that chain, which is why the
   project's site directory has no such fix. After this module, a name of that namespace that
   no library registered and that ends in ``_cpu`` resolves to a function that raises
   ``NotImplementedError``, naming the op, when called (on a CPU without AMX, SGLang takes its
   torch-native paths and calls none). Only ``_cpu`` names: SGLang probes the CUDA ops' names
   with ``hasattr`` (``register_fake_if_exists("sgl_kernel::gptq_marlin_repack")`` in
   ``quantization/gptq.py`` and others) and then registers a fake implementation, which dies
   (``RuntimeError: operator sgl_kernel::gptq_marlin_repack does not exist``) when ``hasattr``
   says yes for an op that is not registered. Registered ops are found first, as before; other
   namespaces are untouched.

The patch is installed when ``torch._ops`` is first imported (a finder in ``sys.meta_path``
wraps its loader); nothing is imported eagerly.

Installed by ``scripts/prepare_engines.sh --only sglang-encode`` into ``$SGLANG_MM_SITE_DIR``.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import _sglang_sitecustomize  # noqa: F401  (the project's SGLang fixes, installed beside this)

TORCH_OPS = "torch._ops"
NAMESPACE = "sgl_kernel"
SUFFIX = "_cpu"


def _missing_op(name: str) -> Callable[..., Any]:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torch.ops.{NAMESPACE}.{name} was called, but no CPU sgl_kernel is installed "
            "(a stand-in of scripts/sglang_encoder_site/sitecustomize.py)"
        )

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def _stub_cpu_ops(module: ModuleType) -> None:
    namespace_class = getattr(module, "_OpNamespace", None)
    if namespace_class is None:
        print(
            f"sitecustomize (sglang encoder): {TORCH_OPS} has no _OpNamespace: nothing patched",
            file=sys.stderr,
            flush=True,
        )
        return
    if getattr(namespace_class, "_sglang_cpu_stubs", False):
        return
    original = namespace_class.__getattr__

    def __getattr__(self: Any, op_name: str) -> Any:
        try:
            return original(self, op_name)
        except AttributeError:
            if getattr(self, "name", None) != NAMESPACE or not op_name.endswith(SUFFIX):
                raise
            stub = _missing_op(op_name)
            setattr(self, op_name, stub)  # as torch caches a resolved op
            return stub

    namespace_class.__getattr__ = __getattr__
    namespace_class._sglang_cpu_stubs = True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _stub_cpu_ops(module)


class _SglangEncoderFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TORCH_OPS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


if TORCH_OPS in sys.modules:
    _stub_cpu_ops(sys.modules[TORCH_OPS])
elif not any(type(f).__name__ == "_SglangEncoderFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _SglangEncoderFinder())
