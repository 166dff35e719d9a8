"""SGLang over its HTTP API: ``POST /generate`` with ``input_ids``; prefill and decode carry the
fake-transfer bootstrap fields (:mod:`sidecar.engines.sglang` says why); its encoder is checked by
its own ``GET /health`` (:class:`SglangEncoderProber`).

A canary whose client gave up runs on: SGLang's tokenizer manager notices a closed connection
only when its wait for the answer next wakes (every 4 s), so a scheduler that resumes before
that computes it (measured on 0.5.23: 2 of 5 timed-out canaries computed after SIGCONT). The
canary carries its own ``rid`` (the canary's request id) and the probe sends SGLang's
``POST /abort_request {"rid": ...}`` right after the timeout: 5 of 5 aborted, none computed.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.vocabulary import Mode
from sidecar.probes.base import CanaryRequest, token_ids
from sidecar.probes.exchange import engine_said
from sidecar.transports.http.base import HttpProber, carried

ABORT_PATH = "/abort_request"


class SglangProber(HttpProber):
    route: ClassVar[str] = "/generate"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "input_ids": token_ids(),
            "sampling_params": {
                "max_new_tokens": self.tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            "rid": request_id,
            "stream": False,
        } | carried(self.need, request_id)

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """SGLang's abort of one request by its ``rid`` (a user's payload without one is never
        aborted: ``abort_all`` would take every user's request with it)."""
        rid = request.body.get("rid")
        if not isinstance(rid, str) or not rid:
            return None
        return CanaryRequest("POST", ABORT_PATH, {"rid": rid}, request.request_id, None)

    def answer(self, parsed: Any) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        if self.role.mode is Mode.DECODE:
            return None
        text = parsed.get("text")
        return text if isinstance(text, str) else None

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if not isinstance(answer, dict):
            return "body is not a JSON object"
        if answer.get("error"):
            return f"engine error in body: {engine_said(answer['error'])}"
        meta = answer.get("meta_info")
        if not isinstance(meta, dict):
            return "no meta_info in body"
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if not kind:
            return "no meta_info.finish_reason.type in body"
        if kind != "length":
            return f"finish_reason {kind!r}, expected 'length'"
        got = meta.get("completion_tokens")
        if expected_tokens is not None and got is not None and got != expected_tokens:
            return f"meta_info.completion_tokens {got!r}, expected {expected_tokens}"
        return None


class SglangEncoderProber(SglangProber):
    """SGLang's encoder (``--encoder-only``, the E of E/P/D): its own ``GET /health``, which
    encodes a 32x32 test image on every data-parallel rank and answers 200 (503 after its 30 s
    timeout, or at once when a rank has died), under the sidecar's deadline. While the encoder
    hangs it gives no answer at all: a single-process encoder runs HTTP and the vision model on
    one event loop. Measured on SGLang 0.5.23 with a tiny Qwen2-VL (docs/engines.md).

    A ``/health`` runs on when its client leaves (a blocked loop cannot see it go, and a frozen
    rank's share waits for SGLang's own 30 s timeout): the probe keeps a timed-out one waiting on
    its connection and sends no other until it ends, so at most one is ever on the encoder.
    While ``POST /encode`` requests wait to send their embeddings, SGLang answers ``/health``
    200 without encoding: a busy encoder is trusted, as by SGLang's own check."""

    encodes: ClassVar[bool] = True
    route: ClassVar[str] = "/health"
    method: ClassVar[str] = "GET"
    reads_body: ClassVar[bool] = False
    keeps_abandoned: ClassVar[bool] = True
    stops_on_close: ClassVar[bool] = False
    kept_because: ClassVar[str] = "SGLang runs a /health to its end whatever its client does"

    def why(self) -> str:
        return (
            "SGLang's own encode check (GET /health encodes a 32x32 test image on every rank), "
            "under the sidecar's deadline: it gives no answer while the encoder hangs"
        )

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {}

    def good_answer(self) -> str:
        return "HTTP 200 (the encoder encoded its own test image)"

    def answer(self, parsed: Any) -> str | None:
        return None
