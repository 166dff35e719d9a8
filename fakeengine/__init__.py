"""A protocol-faithful fake LLM inference engine for tests and demos.

Run ``python -m fakeengine --backend vllm --mode decode --port 8000``. It speaks the HTTP
dialect of vLLM, SGLang, TensorRT-LLM or llama.cpp's llama-server (``--backend openai``),
including their prefill/decode/encode role rules, and adds a ``/_fake`` control API for fault
injection (hangs, latency, errors, garbage bodies, wrong answers, failed NIXL KV transfers,
death) and request inspection. ``--dev-mode`` adds vLLM's sleep-mode routes (``/sleep``,
``/wake_up``, ``/is_sleeping``). ``--dp-size N`` (vllm, sglang) runs N data-parallel ranks that
requests can be pinned to and that the ``hang_ranks`` fault wedges one by one.
"""

from __future__ import annotations

from fakeengine.state import BACKEND_NAMES, FAKE_BOOTSTRAP_HOST, MODES

__all__ = ["BACKEND_NAMES", "FAKE_BOOTSTRAP_HOST", "MODES"]
