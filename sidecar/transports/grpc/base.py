"""What every canary over an engine's gRPC generation service has in common: the call, the
answer as its messages, and the judgement of a whole generation.

The services are SGLang Model Gateway's (``smg-grpc-proto``), as the gateway itself sends them:
tokenized input, a server-streaming ``Generate`` answered by ``chunk`` messages (the tokens of a
step) and one ``complete`` (the finish reason and counts), an ``Abort`` by request id. The
channel (``sidecar/runtime/grpcchannel.py``) maps the body onto the request message and each
message of the answer back into a dict, so a prober here speaks dicts with the proto's field
names. Each prober names
its stubs by importing them in :meth:`GrpcProber.messages` (loaded only with this transport).

A pass needs status OK and a ``complete`` with finish reason ``length`` or ``stop`` and exactly
the expected number of tokens. Tokens are counted as the servers stream them: with chunks, the
sum of their deltas (the streamed ``complete`` repeats the last delta, or holds them all, and is
not added); without, the ``complete``'s own ids. ``abort`` or ``error`` inside an OK status is a
failure: the engine gave up on the canary. Every canary asks two tokens: a stall after the first
token fails it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.engines.base import Canary, Need
from sidecar.probes.base import CanaryRequest, Prober

#: Finish reasons of a complete generation (``abort`` and ``error`` are not).
FINISHED = ("length", "stop")


def _complete(messages: Any) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]], str]:
    """(the ``complete`` message, the chunks, what is wrong when there is no complete)."""
    if not isinstance(messages, list) or not messages:
        return None, [], "the call ended without a message"
    chunks = [m["chunk"] for m in messages if isinstance(m.get("chunk"), Mapping)]
    last = messages[-1].get("complete")
    if not isinstance(last, Mapping):
        return None, chunks, f"no complete message after {len(chunks)} chunk(s)"
    return last, chunks, ""


def generation_problem(messages: Any, expected_tokens: int | None, ids_field: str) -> str | None:
    """What is wrong with a Generate call's messages, or None (``expected_tokens`` None: a
    user's payload, any count)."""
    complete, chunks, missing = _complete(messages)
    if complete is None:
        return missing
    finish = complete.get("finish_reason")
    if not isinstance(finish, str) or not finish:
        return "no finish_reason in the complete message"
    if finish not in FINISHED:
        return f"finish_reason {finish!r}: the engine did not finish the canary"
    if expected_tokens is None:
        return None
    if chunks:
        got = sum(len(c.get("token_ids") or ()) for c in chunks)
        where = f"over {len(chunks)} chunk(s)"
    else:
        got = len(complete.get(ids_field) or ())
        where = f"in {ids_field}"
    if got != expected_tokens:
        return f"{got} token(s) {where}, expected {expected_tokens}"
    reported = complete.get("completion_tokens")
    if isinstance(reported, int) and reported != expected_tokens:
        return f"completion_tokens {reported}, expected {expected_tokens}"
    return None


class GrpcProber(Prober):
    """One backend's canary over its gRPC service. Subclasses, one per module, name the service
    and its stubs and build the request (``body``); what the role needs is the engine's rule,
    put in the message's fields by :meth:`carried`."""

    transport: ClassVar[str] = "grpc"
    method: ClassVar[str] = "gRPC"
    min_tokens: ClassVar[int] = 2
    service: ClassVar[str]  # the service's full name
    # The grpc.health.v1 service name the registration check asks for, where the server has
    # that service; None: a GetModelInfo call answered OK registers the engine.
    health_service: ClassVar[str | None] = None
    # The complete message's field of generated token ids.
    ids_field: ClassVar[str] = "output_ids"
    # Its metrics, where it serves them (SIDECAR_METRICS_URL), with the colons of the engine's
    # names escaped (OpenMetrics, as SGLang's --smg-grpc-mode side server serves them).
    metrics_escaped: ClassVar[bool] = False

    @staticmethod
    def messages() -> None:
        """Register the service's messages in protobuf's default pool (import its stubs)."""
        raise NotImplementedError

    @property
    def path(self) -> str:
        return f"/{self.service}/Generate"

    @property
    def registration(self) -> str:
        """The method a registration check calls where the server has no grpc.health.v1."""
        return f"/{self.service}/GetModelInfo"

    @property
    def need(self) -> Need:
        return self.rule.need if isinstance(self.rule, Canary) else None

    def carried(self, request_id: str) -> dict[str, Any]:
        """The message fields that carry the role's need (none: a plain request)."""
        return {}

    def good_answer(self) -> str:
        return f"status OK, a complete with finish reason length or stop and {self.tokens} token(s)"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return generation_problem(answer, expected_tokens, self.ids_field)

    def answer(self, parsed: Any) -> str | None:
        complete, chunks, _ = _complete(parsed)
        if chunks:
            ids = [t for c in chunks for t in c.get("token_ids") or ()]
        else:
            ids = list((complete or {}).get(self.ids_field) or ())
        return " ".join(map(str, ids)) if ids else None

    def abort_body(self, request_id: str) -> dict[str, Any]:
        """The service's Abort request for one request id."""
        return {"request_id": request_id}

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """The engine's Abort of a timed-out canary by its request id, as SMG sends it when its
        client drops a stream (a user's payload without a request_id is never aborted)."""
        request_id = request.body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            return None
        body = self.abort_body(request_id)
        return CanaryRequest("gRPC", f"/{self.service}/Abort", body, request.request_id, None)
