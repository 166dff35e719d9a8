"""The canary over OpenEngine's ``Inference/Generate``: one prober for every engine that serves
the contract (it is vendor-neutral), the role's need put in the contract's fields.

- A plain request: ``token_ids`` (the canary's 8 ids), ``sampling`` {``temperature`` 0},
  ``stopping`` {``max_tokens``, ``ignore_eos``}: ``max_tokens`` must be set (TensorRT-LLM's server
  sends no limit otherwise), ``request_id`` the canary's id and ``model`` the served model (both
  required non-empty).
- TensorRT-LLM's local run (:class:`~sidecar.engines.base.LocalRun`, DIS-1737) goes as
  ``extra`` {``request_type``: ``context_and_generation``}, which its server accepts and runs
  whole on the worker, for prefill and decode alike. A prefill canary never asks for the context
  phase only (``context_only``): its server keeps a context-only request's KV blocks until a
  decode leg pulls them, or the process exits, and nothing reclaims them (Abort by session is
  unimplemented). A decode canary never carries a ``kv.session``: a made-up one points at no
  context worker and can block the engine's executor loop.
- SGLang's fake transfer has no field in the contract (``kv.session`` names a real prefill's KV):
  SGLang's prefill and decode workers get no canary over OpenEngine. An encoder's new image has
  ``media``, which TensorRT-LLM's server refuses (UNIMPLEMENTED): no encode canary either.

Judged on the whole stream: status OK, no ``error`` event (an ``EngineError`` inside an OK
stream is the engine's refusal or failure), a last ``finished`` event with reason LENGTH or
STOP, exactly the expected tokens over the ``token`` events (deltas) and in ``usage`` where it is
reported. A ``prefill_ready`` is a server that ran the context phase only. On a timeout the
deadline cancels the call (the server aborts the request), and the probe sends
``Control/Abort{request_id}``: ABORTED and ALREADY_FINISHED are both a stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.engines.base import Canary, FakeTransfer, LocalRun, NewImage
from sidecar.probes.base import CanaryRequest, Prober, token_ids
from sidecar.probes.exchange import engine_said

INFERENCE = "openengine.v1.Inference"
CONTROL = "openengine.v1.Control"
#: What is sent as ``model`` when the served model is not known yet (both are required).
NO_MODEL = "default"
FINISHED = ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
#: The EngineError codes that refuse the request itself (a configuration problem, not a hang).
REJECTIONS = (
    "ERROR_CODE_INVALID_ARGUMENT",
    "ERROR_CODE_UNSUPPORTED_FEATURE",
    "ERROR_CODE_ROLE_MISMATCH",
    "ERROR_CODE_MODEL_NOT_FOUND",
    "ERROR_CODE_KV_SESSION_NOT_FOUND",
)


def _events(messages: Any) -> list[Mapping[str, Any]]:
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


class OpenEngineProber(Prober):
    transport: ClassVar[str] = "openengine"
    method: ClassVar[str] = "gRPC"
    min_tokens: ClassVar[int] = 2  # two steps: a stall after the first token fails it

    @property
    def path(self) -> str:
        return f"/{INFERENCE}/Generate"

    @property
    def refusal(self) -> str | None:
        need = self.rule.need if isinstance(self.rule, Canary) else None
        if isinstance(need, FakeTransfer):
            return (
                "the OpenEngine contract has no field for SGLang's fake KV transfer (kv.session "
                "names a real prefill's KV): no canary over OpenEngine for SGLang's "
                f"{self.role.mode} worker; readiness follows registration"
            )
        if isinstance(need, NewImage):
            return (
                "no encode canary over OpenEngine (its media field is refused by TensorRT-LLM's "
                "server: UNIMPLEMENTED); readiness follows registration"
            )
        return super().refusal

    def why(self) -> str:
        need = self.rule.need if isinstance(self.rule, Canary) else None
        if isinstance(need, LocalRun):
            return (
                f"{self.role.mode} worker: extra request_type {need.request_type} runs it whole, "
                "locally (never context_only: its KV would stay pinned; never a made-up "
                "kv.session)"
            )
        return "plain greedy generation: a request without kv.session runs locally"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": request_id,
            "model": model or NO_MODEL,
            "token_ids": {"ids": token_ids()},
            "sampling": {"temperature": 0.0},
            "stopping": {"max_tokens": self.tokens, "ignore_eos": True},
        }
        need = self.rule.need if isinstance(self.rule, Canary) else None
        if isinstance(need, LocalRun):
            body["extra"] = {"request_type": need.request_type}
        return body

    def good_answer(self) -> str:
        return (
            f"status OK, no error event, and a finished event (LENGTH or STOP) after "
            f"{self.tokens} token(s)"
        )

    def failure(self, answer: Any) -> tuple[str, bool] | None:
        """An ``EngineError`` event inside the OK stream: what it says, and whether it refuses
        the request itself."""
        for event in _events(answer):
            error = event.get("error")
            if isinstance(error, Mapping):
                code = str(error.get("code", "ERROR_CODE_UNSPECIFIED"))
                said = engine_said(f"{code}: {error.get('message', '')}".rstrip(": "))
                return f"engine error {said}", code in REJECTIONS
        return None

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        events = _events(answer)
        if not events:
            return "the stream ended without an event"
        last = events[-1]
        if isinstance(last.get("prefill_ready"), Mapping):
            return "prefill_ready: the server ran the context phase only (a prefill-only server)"
        finished = last.get("finished")
        tokens = [e["token"] for e in events if isinstance(e.get("token"), Mapping)]
        if not isinstance(finished, Mapping):
            return f"no finished event after {len(tokens)} token event(s)"
        reason = finished.get("reason", "FINISH_REASON_UNSPECIFIED")
        if reason not in FINISHED:
            said = f" ({finished['message']})" if finished.get("message") else ""
            return f"finish reason {reason}{said}: the engine did not finish the canary"
        if expected_tokens is None:
            return None
        got = sum(len(t.get("tokens") or ()) for t in tokens)
        if got != expected_tokens:
            return f"{got} token(s) over {len(tokens)} token event(s), expected {expected_tokens}"
        usage = last.get("usage")
        reported = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
        if reported is not None and reported != expected_tokens:
            return f"usage.completion_tokens {reported}, expected {expected_tokens}"
        return None

    def answer(self, parsed: Any) -> str | None:
        ids = [
            t.get("token_id", 0)
            for e in _events(parsed)
            if isinstance(e.get("token"), Mapping)
            for t in e["token"].get("tokens") or ()
        ]
        return " ".join(map(str, ids)) if ids else None

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """``Control/Abort`` by the canary's request id (a user's payload without one is never
        aborted: ``all_requests`` would take every user's request with it)."""
        request_id = request.body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            return None
        body = {"request_id": request_id}
        return CanaryRequest("gRPC", f"/{CONTROL}/Abort", body, request.request_id, None)
