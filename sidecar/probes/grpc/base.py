"""What every canary over an engine's gRPC generation service has in common: the call, the
answer as its messages, and the judgement of a whole generation.

The services are SGLang Model Gateway's (``smg-grpc-proto``), as the gateway itself sends them:
tokenized input, a server-streaming ``Generate`` answered by ``chunk`` messages (the tokens of a
step) and one ``complete`` (the finish reason and counts), an ``Abort`` by request id. The
channel (:mod:`sidecar.runtime.grpcengine`) maps the body onto the request message and each
message of the answer back into a dict, so a prober here speaks dicts with the proto's field
names.

A pass needs status OK and a ``complete`` with finish reason ``length`` or ``stop`` and exactly
the expected number of tokens. Tokens are counted as the servers stream them: with chunks, the
sum of their deltas (the streamed ``complete`` repeats the last delta, or holds them all, and is
not added); without, the ``complete``'s own ids. ``abort`` or ``error`` inside an OK status is a
failure: the engine gave up on the canary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from sidecar.probes.base import CanaryRequest, Prober, Role
from sidecar.probes.role import Transport

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
    """One backend's canary over its gRPC service. Subclasses, one per module, name the service,
    its stubs, the engine's own HTTP prober (whose role rules and metrics names hold whatever
    carries the request), and build the request per role (``body``)."""

    transport: ClassVar[Transport] = Transport.GRPC
    method: ClassVar[str] = "gRPC"
    needs_model: ClassVar[bool] = False
    # The stub module that registers the service's messages, and the service's full name.
    grpc_module: ClassVar[str]
    service: ClassVar[str]
    # The grpc.health.v1 service name the registration check asks for, where the server has
    # that service; None: a GetModelInfo call answered OK registers the engine.
    health_service: ClassVar[str | None] = None
    # The complete message's field of generated token ids.
    ids_field: ClassVar[str] = "output_ids"
    # The engine's HTTP prober: its role rules and its metrics' names.
    http: ClassVar[type[Prober]]

    @property
    def generation_path(self) -> str:  # type: ignore[override]
        return f"/{self.service}/Generate"

    @property
    def registration_path(self) -> str:  # type: ignore[override]
        """The registration check, as reasons and --check-config name it."""
        if self.health_service is not None:
            return f"grpc.health.v1 Check({self.health_service!r})"
        return f"/{self.service}/GetModelInfo"

    @property
    def progress(self):  # type: ignore[override]
        return self.http.progress

    def skip_reason(self, role: Role) -> str | None:
        if role.mode.value == "encode":
            return super().skip_reason(role)
        return self.http().skip_reason(role)

    def good_answer(self, role: Role) -> str:
        _, tokens = self.body(role, None, "x")
        return f"status OK, a complete with finish reason length or stop and {tokens} token(s)"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return generation_problem(answer, expected_tokens, self.ids_field)

    def generic_problem(self, answer: Any) -> str | None:
        return generation_problem(answer, None, self.ids_field)

    def answer(self, parsed: Any, role: Role) -> str | None:
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
