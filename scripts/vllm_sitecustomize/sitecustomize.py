"""Calm NIXL's UCX progress thread in a vLLM started with this directory on PYTHONPATH.

nixl's Python API creates every agent with ``pthrDelay = 0``: the progress thread spins, about one
full core per idle vLLM instance, and two instances on a 2-core machine starve each other (a
decode engine took 270 s to start instead of 25 s). This module, imported by ``site`` at start-up
of every Python process that has its directory on ``PYTHONPATH`` (the API server, EngineCore and
Worker), wraps ``nixlAgent`` of NIXL's compiled bindings as soon as they are imported, so the
agent config carries ``pthrDelay = NIXL_PTHR_DELAY_US`` (default 100000 µs) when the agent is
created. Idle CPU drops to about 1%. Nothing is imported eagerly: processes that never load NIXL
pay only for one entry in ``sys.meta_path``.

Two opt-in parts serve tests of vLLM's fault tolerance, which needs external-LB data parallel
and so a mixture-of-experts model (``scripts/make_tiny_moe_model.py``):

- ``HEALTH_SIDECAR_CPU_MOE_DP=1`` completes vLLM 0.32's CPU communicator for MoE data parallel.
  With ``--data-parallel-size`` above 1 every MoE layer dispatches its tokens to all ranks through
  the all-gather/reduce-scatter all2all manager (``AgRsAll2AllManager``), which calls
  ``all_gatherv`` and ``reduce_scatterv``; ``CpuCommunicator`` has neither (the base class raises
  ``NotImplementedError``: the first forward pass, the profile run, fails). Here they are made of
  the collectives it has: an all-gather of tensors padded to the largest rank's size, and an
  all-reduce then this rank's slice. ``AgRsAll2AllManager.clean_buffers``, which fault recovery
  calls, is a no-op (it has no buffers to clean).
- ``HEALTH_SIDECAR_FT_TRIGGER=<file>`` is a fault trigger, off unless it names a file:
  the EngineCore's next engine step after that file appears raises ``RuntimeError`` (the file is
  deleted when it fires), inside the busy loop that ``fault_tolerant_wrapper``
  (``vllm/v1/fault_tolerance``) guards, as a real fault of a step would. An idle engine blocks
  on its input queue, so the fault fires with the next request. With both variables set (every
  rank must have both), the ranks agree in the MoE all-gather: one rank's trigger makes every
  rank raise at its next step (``_agreed_fault``).

Installed by ``scripts/prepare_engines.sh --only vllm`` into ``$VLLM_SITE_DIR``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
from types import ModuleType
from typing import Any

_BINDINGS = tuple(f"{pkg}._bindings" for pkg in ("nixl_cu12", "nixl_cu13", "nixl_rocm"))
_ENGINE_CORE = "vllm.v1.engine.core"
_CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
_ALL2ALL = "vllm.distributed.device_communicators.all2all"
FT_TRIGGER = "HEALTH_SIDECAR_FT_TRIGGER"
CPU_MOE_DP = "HEALTH_SIDECAR_CPU_MOE_DP"


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


def _fire_file() -> str:
    """The file the engine step raises on: the trigger itself, or with MoE data parallel the
    ``.fire`` file that the Workers write when any rank's trigger was seen (``_agreed_fault``)."""
    trigger = os.environ[FT_TRIGGER]
    return f"{trigger}.fire" if os.environ.get(CPU_MOE_DP) else trigger


def _agreed_fault(communicator: Any) -> None:
    """With MoE data parallel, the ranks agree on a fault: each MoE all-gather also sums
    whether each rank's trigger exists, and then every rank writes its ``.fire`` file, so all
    raise at their next step. A trigger read by each rank on its own would race: a rank that
    looked just before the file appeared would wait forever in this collective for one that
    raised."""
    import torch

    trigger = os.environ.get(FT_TRIGGER)
    if not trigger:
        return
    seen = torch.tensor([1.0 if os.path.exists(trigger) else 0.0])
    communicator.dist_module.all_reduce(seen, group=communicator.device_group)
    if seen.item() > 0:
        with open(f"{trigger}.fire", "w"):
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(trigger)


def _patch_engine_core(core: ModuleType) -> None:
    """Make ``EngineCoreProc._process_engine_step`` raise once the fire file exists."""
    trigger = os.environ.get(FT_TRIGGER)
    proc = getattr(core, "EngineCoreProc", None)
    if not trigger or proc is None or getattr(proc, "_ft_trigger_patched", False):
        return
    original = proc._process_engine_step
    fire = _fire_file()

    def process_engine_step(self: Any) -> Any:
        try:
            os.unlink(fire)
        except FileNotFoundError:
            return original(self)
        print(
            f"sitecustomize: fault trigger {trigger} fired in engine "
            f"{getattr(self, 'engine_index', '?')} (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        raise RuntimeError(f"health-sidecar test fault ({FT_TRIGGER}={trigger})")

    proc._process_engine_step = process_engine_step
    proc._ft_trigger_patched = True


def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    """Concatenate each rank's tensor along dim 0 (``sizes``: each rank's length there)."""
    import torch

    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    _agreed_fault(self)
    world = self.world_size

    def gather(tensor: Any) -> Any:
        lengths = sizes if sizes is not None else [tensor.shape[0]] * world
        longest = max(lengths)
        padded = tensor
        if tensor.shape[0] != longest:
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
        out = torch.empty((world * longest, *tensor.shape[1:]), dtype=tensor.dtype)
        self.dist_module.all_gather_into_tensor(out, padded.contiguous(), group=self.device_group)
        if all(n == longest for n in lengths):
            return out
        parts = out.reshape(world, longest, *tensor.shape[1:])
        return torch.cat([parts[r, :n] for r, n in enumerate(lengths)], dim=0)

    if isinstance(input_, (list, tuple)):
        return [gather(t) for t in input_]
    return gather(input_)


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    """Sum over the ranks, then this rank's part along ``dim`` (``sizes``: each rank's length)."""
    if dim < 0:
        dim += input_.dim()
    whole = input_.movedim(0, dim).contiguous() if dim else input_.clone()
    self.dist_module.all_reduce(whole, group=self.device_group)
    world, rank = self.world_size, self.rank_in_group
    lengths = sizes if sizes is not None else [whole.shape[0] // world] * world
    start = sum(lengths[:rank])
    part = whole[start : start + lengths[rank]]
    return part.movedim(0, dim).contiguous() if dim else part.contiguous()


def _patch_cpu_communicator(module: ModuleType) -> None:
    cls = getattr(module, "CpuCommunicator", None)
    if cls is None or getattr(cls, "_moe_dp_patched", False):
        return
    cls.all_gatherv = _all_gatherv
    cls.reduce_scatterv = _reduce_scatterv
    cls._moe_dp_patched = True


def _patch_all2all(module: ModuleType) -> None:
    cls = getattr(module, "AgRsAll2AllManager", None)
    if cls is not None:
        cls.clean_buffers = lambda self: None


_PATCHES = dict.fromkeys(_BINDINGS, _patch) | {
    _ENGINE_CORE: _patch_engine_core,
    _CPU_COMMUNICATOR: _patch_cpu_communicator,
    _ALL2ALL: _patch_all2all,
}
_OPT_IN = {_ENGINE_CORE: FT_TRIGGER, _CPU_COMMUNICATOR: CPU_MOE_DP, _ALL2ALL: CPU_MOE_DP}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Any) -> None:
        self.inner = inner
        self.patch = patch

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        opt_in = _OPT_IN.get(fullname)
        if opt_in is not None and not os.environ.get(opt_in):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
