"""dynamo.vllm: a plain local request in every role, with the health-check marker; the encode
worker of a multimodal model gets an image of its own (:class:`DynamoVllmEncoderProber`).

A Dynamo vLLM decode worker given no ``prefill_result`` runs prefill and decode locally, so the
plain payload checks its engine; a prefill worker given the marker skips the KV hand-off (without
it, a hand-off is set up that nobody consumes and its blocks stay pinned until NIXL's abort
timeout).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, ClassVar

from sidecar.core.evidence.progress import COMPLETED, GENERATION, CanaryCost
from sidecar.core.jsontext import loads as loads_json
from sidecar.core.vocabulary import EmbeddingTransfer, Mode, Role
from sidecar.engines.base import Canary, Engine, NoCanary
from sidecar.probes.base import CanaryRequest, token_ids
from sidecar.probes.image import data_url, fresh_png
from sidecar.transports.dynamo.base import HEALTH_CHECK_KEY, DynamoProber, greedy_stop


class DynamoVllmProber(DynamoProber):
    def why(self) -> str:
        if self.role.mode is Mode.PREFILL:
            return (
                f"plain local request with the {HEALTH_CHECK_KEY} marker: the prefill worker "
                "skips the KV hand-off"
            )
        if self.role.mode is Mode.DECODE:
            return "plain local request: a dynamo.vllm decode worker prefills it itself"
        return f"plain greedy request with the {HEALTH_CHECK_KEY} marker"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "token_ids": token_ids(),
            "sampling_options": {"temperature": 0.0},
            "stop_conditions": greedy_stop(self.tokens),
            HEALTH_CHECK_KEY: True,
        }

    def stamped(self, payload: dict[str, Any]) -> dict[str, Any]:
        # As dynamo.vllm does with DYN_HEALTH_CHECK_PAYLOAD: the marker is stamped on top.
        return {**payload, HEALTH_CHECK_KEY: True}


#: The file local transfer mode writes per embedding (``LocalEmbeddingSender``, ai-dynamo 1.6.1):
#: ``tempfile.mkstemp(prefix=f"encoder_cache.{sender}_{counter}.", suffix=".safetensors")`` in the
#: worker's TMPDIR. Only a name of this shape is ever removed.
EMBEDDINGS_FILE = re.compile(r"encoder_cache\.[0-9a-f]+_[0-9]+\.[A-Za-z0-9_]+\.safetensors")
# Bytes of answer one encode canary may add to dynamo_component_response_bytes_total: its
# request echoed without the image, with the embeddings' shape and file (about 700 bytes).
ENCODE_ANSWER_BYTES = 4096


def _encoded(chunk: Any) -> Any:
    """A chunk of the encode worker's answer: its handler yields the request as JSON text."""
    if isinstance(chunk, str):
        try:
            return loads_json(chunk)
        except ValueError:
            return None
    return chunk


def _groups(answer: Any) -> list[Any] | str:
    """The answer's multimodal_inputs, or what is wrong with its shape."""
    if not isinstance(answer, list) or len(answer) != 1:
        count = len(answer) if isinstance(answer, list) else 0
        return f"{count} chunk(s), expected the one answer the encode worker yields"
    body = _encoded(answer[0])
    if not isinstance(body, Mapping):
        return "the answer is not a JSON object"
    groups = body.get("multimodal_inputs")
    if not isinstance(groups, list) or not groups:
        return "no multimodal_inputs in the answer"
    return groups


def _shape_problem(group: Any) -> str | None:
    shape = group.get("embeddings_shape") if isinstance(group, Mapping) else None
    if not isinstance(shape, list) or not shape:
        return "no embeddings_shape in the answer: nothing was encoded"
    if not all(isinstance(n, int) and n > 0 for n in shape):
        return f"embeddings_shape {shape} is not a tensor's shape"
    return None


def _file(group: Any) -> str | None:
    """Where local transfer mode wrote the group's embeddings, as the worker names it."""
    transfer = group.get("serialized_request") if isinstance(group, Mapping) else None
    path = transfer.get("serialized_request") if isinstance(transfer, Mapping) else None
    return path if isinstance(path, str) else None


class DynamoVllmEncoderProber(DynamoProber):
    """Dynamo's vLLM encode worker (``--disaggregation-mode encode``, ``<ns>.encode.generate``):
    the ``vLLMMultimodalRequest`` a prefill worker sends it for one image, the image new for
    every canary (:mod:`sidecar.probes.image`; a repeated one may be served from the worker's
    embedding cache). A pass needs the whole answer: one chunk, the request back with
    ``embeddings_shape`` for its one image, within the deadline.

    Only in local transfer mode (DYN_VLLM_EMBEDDING_TRANSFER_MODE=local): the embeddings go to a
    file in the worker's TMPDIR, named in the answer, which the sidecar removes where that
    directory is mounted in it too (SIDECAR_EC_STORAGE_PATH). In the NIXL modes an embedding is
    held until a consumer reads it, and the worker awaits each transfer in order: a canary's,
    never read, would hold every later one (read in ai-dynamo 1.6.1, not run).

    Its handler never reads its context: a canary stopped on its deadline still runs to its end
    when the worker resumes, and writes a file whose name (``mkstemp``'s random part) nobody can
    know beforehand. So a timed-out canary is kept: its stream stays open, no other is sent while
    it runs, and the file its late answer names is removed.
    """

    encodes: ClassVar[bool] = True
    keeps_abandoned: ClassVar[bool] = True
    stops_on_close: ClassVar[bool] = False
    kept_because: ClassVar[str] = (
        "Dynamo's encode handler runs it to its end whatever its caller does, and names the file "
        "it writes only in its answer"
    )
    leaves: ClassVar[str | None] = (
        "its embeddings file in local transfer mode (encoder_cache.<sender>_<n>.<random>"
        ".safetensors in the worker's TMPDIR)"
    )

    def __init__(
        self,
        engine: Engine,
        role: Role,
        rule: Canary | NoCanary,
        endpoint: str = "generate",
        transfer: EmbeddingTransfer = EmbeddingTransfer.LOCAL,
    ) -> None:
        super().__init__(engine, role, rule, endpoint)
        self.transfer = transfer

    @property
    def refusal(self) -> str | None:
        if self.transfer is EmbeddingTransfer.LOCAL:
            return super().refusal
        return (
            f"Dynamo's encode worker in {self.transfer} mode (DYN_VLLM_EMBEDDING_TRANSFER_MODE; "
            "nixl-write when unset) holds each embedding until a consumer reads it and completes "
            "them in order: a canary's, never read, would hold every later one; readiness "
            "follows registration (local mode gets a canary)"
        )

    def why(self) -> str:
        return (
            "a new image per canary in the vLLMMultimodalRequest a prefill worker sends (local "
            "transfer mode): the answer must carry embeddings_shape for it"
        )

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        image = {"image_url": data_url(fresh_png(request_id))}
        return {
            "engine_prompt": {"prompt_token_ids": []},
            "sampling_params": {},
            "request_id": request_id,
            "multimodal_inputs": [{"multimodal_input": image}],
        }

    def good_answer(self) -> str:
        return "one chunk: the request back with embeddings_shape for its one image"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        groups = _groups(answer)
        if isinstance(groups, str):
            return groups
        if len(groups) != 1:
            return f"{len(groups)} multimodal_inputs in the answer, expected 1"
        return _shape_problem(groups[0])

    def generic_problem(self, answer: Any) -> str | None:
        """A user's payload may carry several images: each needs its embeddings_shape."""
        groups = _groups(answer)
        if isinstance(groups, str):
            return groups
        return next((p for g in groups if (p := _shape_problem(g)) is not None), None)

    def answer(self, parsed: Any) -> str | None:
        return None  # an encoder generates no text

    def cost(self, expected_tokens: int) -> CanaryCost:
        """One canary completes one request with one answer; a kept one may complete inside the
        next canary's window: two canaries' worth."""
        return CanaryCost({COMPLETED: 2, GENERATION: 2 * ENCODE_ANSWER_BYTES})

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """The embeddings files the answer names, by file name (the worker's TMPDIR is mounted
        in the sidecar at SIDECAR_EC_STORAGE_PATH, perhaps under another path); none without an
        answer: the name is unknown until the worker gives it (a timed-out canary is kept)."""
        groups = _groups(answer)
        if isinstance(groups, str):
            return ()
        names = (PurePosixPath(path).name for g in groups if (path := _file(g)) is not None)
        return tuple(name for name in names if EMBEDDINGS_FILE.fullmatch(name))
