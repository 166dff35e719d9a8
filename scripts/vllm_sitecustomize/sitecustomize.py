"""Calm NIXL's UCX progress thread in a vLLM started with this directory on PYTHONPATH.

nixl's Python API creates every agent with ``pthrDelay = 0``: the progress thread spins, about one
full core per idle vLLM instance, and two instances on a 2-core machine starve each other (a
decode engine took 270 s to start instead of 25 s). This module, imported by ``site`` at start-up
of every Python process that has its directory on ``PYTHONPATH`` (the API server, EngineCore and
Worker), wraps ``nixlAgent`` of NIXL's compiled bindings as soon as they are imported, so the
agent config carries ``pthrDelay = NIXL_PTHR_DELAY_US`` (default 100000 µs) when the agent is
created. Idle CPU drops to about 1%. Nothing is imported eagerly: processes that never load NIXL
pay only for one entry in ``sys.meta_path``.

Installed by ``scripts/prepare_engines.sh --only vllm`` into ``$VLLM_SITE_DIR``.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from types import ModuleType
from typing import Any

_BINDINGS = tuple(f"{pkg}._bindings" for pkg in ("nixl_cu12", "nixl_cu13", "nixl_rocm"))


def _delay_us() -> int:
    try:
        return max(0, int(os.environ.get("NIXL_PTHR_DELAY_US", "100000")))
    except ValueError:
        return 100000


def _patch(bindings: ModuleType) -> None:
    original = getattr(bindings, "nixlAgent", None)
    if original is None or getattr(original, "_pthr_delay_patched", False):
        return
    delay = _delay_us()

    def nixl_agent(name: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            config.pthrDelay = delay
        except AttributeError:  # a config without the knob: leave it alone
            pass
        else:
            print(
                f"sitecustomize: NIXL agent {name!r} pthrDelay={delay} us (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )
        return original(name, config, *args, **kwargs)

    nixl_agent._pthr_delay_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = nixl_agent


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _BINDINGS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
