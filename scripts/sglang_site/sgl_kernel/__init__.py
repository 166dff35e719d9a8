"""A stand-in for ``sgl_kernel`` so that SGLang 0.5.23's CPU engine imports on a CPU without AMX.

PyPI publishes ``sgl_kernel`` (``sgl-kernel``, ``sglang-kernel``) only as CUDA wheels, with no CPU
ops and no sdist, yet ``SGLANG_USE_CPU_ENGINE=1`` imports the package at start-up. On a CPU
without Intel AMX the CPU engine takes its torch-native paths and never calls a kernel; the
imports only have to succeed.

Every public top-level name is a function that raises ``NotImplementedError`` when called (made
on first access), so ``from sgl_kernel import x`` succeeds and any real use fails loudly, naming
the kernel. There are no submodules: ``import sgl_kernel.x`` fails with ``ModuleNotFoundError``,
which SGLang catches and falls back from (a stand-in that faked submodules broke SGLang's
optional-kernel probes). Dunder names stay missing, so ``hasattr(sgl_kernel, "__version__")`` is
false, and ``torch.ops.sgl_kernel`` stays empty (no AMX backend is detected). Nothing public is
defined here but by ``__getattr__``: the helpers are private.

Installed by ``scripts/prepare_engines.sh --only sglang`` into ``$SGLANG_SITE_DIR``.
"""

_WHY = "this sgl_kernel is a stand-in without kernels (scripts/sglang_site; SGLang's CPU engine"
_WHY += " on a CPU without AMX needs none)"


def _kernel(name):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} was called, but {_WHY}")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def __getattr__(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    kernel = _kernel(name)
    globals()[name] = kernel
    return kernel
