"""Import-time fixes that let SGLang 0.5.23 run on the CPU, for processes with this directory on
``PYTHONPATH`` (the server and its scheduler and detokenizer children inherit it).

``site`` imports this module at start-up. It installs one finder in ``sys.meta_path`` that patches
three modules right after they are imported; nothing is imported eagerly:

1. ``torchvision._meta_registrations`` and ``torchvision._autograd_registrations``: PyPI's
   torchvision 0.28.0 is built against the CUDA torch, so its compiled ops are not registered
   beside the CPU torch and these two modules fail with ``RuntimeError: operator
   torchvision::nms does not exist``, which breaks ``import torchvision`` as a whole. SGLang
   imports only ``torchvision.transforms``, which needs none of those ops: such a failure is
   tolerated (the module stays as far as it got) and everything else in torchvision imports.
   Any other error is raised.
2. ``sglang.srt.disaggregation.mooncake.conn``: ``MooncakeKVSender.supports_host_tensor_indices``
   is set to False. With it True, a prefill server copies the KV page indices into a pinned
   host tensor (``pin_memory=True``), which needs an accelerator and kills the prefill scheduler
   on the CPU (``prefill.py``); False takes SGLang's plain CPU path for the indices.
3. ``sglang.srt.managers.data_parallel_controller``: with ``--dp-size`` > 1 the controller that
   hands requests to the ranks polls its socket in a loop without any wait, one core at 100 %
   even with ``--sleep-on-idle`` (which only calms the schedulers): half of a 2-core machine.
   Its ``event_loop`` gets a ``zmq.Poller`` wait of up to 1 s before each drain of the socket;
   a request wakes it at once, so dispatch is as before and idle CPU drops to about 0 %.

Installed by ``scripts/prepare_engines.sh --only sglang`` into ``$SGLANG_SITE_DIR``, beside the
``sgl_kernel`` stand-in package.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

TORCHVISION_REGISTRATIONS = (
    "torchvision._meta_registrations",
    "torchvision._autograd_registrations",
)
MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
DP_CONTROLLER_WAIT_MS = 1000  # the schedulers' --sleep-on-idle wait, too


def _log(message: str) -> None:
    print(f"sitecustomize (sglang, pid {os.getpid()}): {message}", file=sys.stderr, flush=True)


def _tolerate_missing_ops(inner: importlib.abc.Loader, module: ModuleType) -> None:
    try:
        inner.exec_module(module)
    except RuntimeError as exc:
        text = str(exc)
        if "torchvision::" not in text or "does not exist" not in text:
            raise
        _log(f"{module.__name__}: {text} (torchvision's C ops are absent; tolerated)")


def _no_host_tensor_indices(inner: importlib.abc.Loader, module: ModuleType) -> None:
    inner.exec_module(module)
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is None:
        _log(f"{MOONCAKE_CONN} has no MooncakeKVSender: nothing patched")
        return
    sender.supports_host_tensor_indices = False


def _waiting_dp_controller(inner: importlib.abc.Loader, module: ModuleType) -> None:
    inner.exec_module(module)
    controller = getattr(module, "DataParallelController", None)
    zmq = getattr(module, "zmq", None)
    sock_recv = getattr(module, "sock_recv", None)
    if controller is None or zmq is None or sock_recv is None:
        _log(f"{DP_CONTROLLER}: not the expected module; its busy loop is left as it is")
        return

    def event_loop(self: Any) -> None:
        # SGLang 0.5.23's loop with one change: wait on the socket instead of spinning.
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        while True:
            poller.poll(DP_CONTROLLER_WAIT_MS)
            while True:
                self.soft_watchdog.feed()
                try:
                    recv_req = sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._request_dispatcher(recv_req)

    controller.event_loop = event_loop


# module name -> how to execute it (given the real loader and the new module)
_FIXES: dict[str, Callable[[importlib.abc.Loader, ModuleType], None]] = {
    **dict.fromkeys(TORCHVISION_REGISTRATIONS, _tolerate_missing_ops),
    MOONCAKE_CONN: _no_host_tensor_indices,
    DP_CONTROLLER: _waiting_dp_controller,
}


class _FixingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, run: Callable[[Any, ModuleType], None]) -> None:
        self.inner = inner
        self.run = run

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.run(self.inner, module)


class _SglangFixingFinder(importlib.abc.MetaPathFinder):
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


if not any(type(f).__name__ == "_SglangFixingFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _SglangFixingFinder())
