"""One class per real engine flavour; ``BACKENDS`` maps the ``--backend`` value to it."""

from __future__ import annotations

from fakeengine.backends.base import Backend
from fakeengine.backends.llamacpp import LlamaCppBackend
from fakeengine.backends.sglang import SglangBackend
from fakeengine.backends.trtllm import TrtllmBackend
from fakeengine.backends.vllm import VllmBackend

BACKENDS: dict[str, type[Backend]] = {
    backend.name: backend
    for backend in (VllmBackend, SglangBackend, TrtllmBackend, LlamaCppBackend)
}

__all__ = ["BACKENDS", "Backend"]
