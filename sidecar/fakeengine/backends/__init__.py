"""One class per real engine flavour; ``BACKENDS`` maps the ``--backend`` value to it."""

from __future__ import annotations

from sidecar.fakeengine.backends.base import Backend
from sidecar.fakeengine.backends.llamacpp import LlamaCppBackend
from sidecar.fakeengine.backends.sglang import SglangBackend
from sidecar.fakeengine.backends.trtllm import TrtllmBackend
from sidecar.fakeengine.backends.vllm import VllmBackend

BACKENDS: dict[str, type[Backend]] = {
    backend.name: backend
    for backend in (VllmBackend, SglangBackend, TrtllmBackend, LlamaCppBackend)
}

__all__ = ["BACKENDS", "Backend"]
