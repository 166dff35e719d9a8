"""What each engine is, whatever carries the canary (``base.py`` says what a value holds): one
module per backend, listed once here. SIDECAR_BACKEND names one of them.

Where is a role's rule written (what TensorRT-LLM decode must carry, SGLang's fake transfer)?
In its backend's module, method ``role_canary``: once, for every transport.
"""

from __future__ import annotations

from sidecar.engines import openai, sglang, trtllm, vllm
from sidecar.engines.base import Engine

#: Every engine by its SIDECAR_BACKEND name.
ENGINES: dict[str, Engine] = {
    e.name: e for e in (vllm.ENGINE, sglang.ENGINE, trtllm.ENGINE, openai.ENGINE)
}

__all__ = ["ENGINES", "Engine"]
