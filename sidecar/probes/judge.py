"""The one judgement of a canary's answer, whatever its transport: what the channel received in,
the canary's :class:`~sidecar.core.evidence.result.Result` out.

======================================  ========  ===============================================
received                                outcome   reason
======================================  ========  ===============================================
no answer (timeout, refused, broken)    its own   the transport's reason
HTTP 3xx                                error     a redirect, not followed
HTTP other than 200                     error     the status and the engine's error text
HTTP 200 to a canary whose body is not  success   the engine's own check passed
read (Prober.reads_body false)
HTTP 200, not JSON (type or body)       invalid   what is wrong
a stream that ended on an error event   error     the worker's error (a rejection of the request)
an error event inside a whole stream    error     the engine's error (a rejection where it says so)
well formed, but not a good answer      invalid   what the backend's prober finds wrong
a good answer                           success   complete, well-formed answer
======================================  ========  ===============================================

What a good answer is belongs to the backend's prober (``CanaryPlan.problem``): the number of
tokens, the finish reason, the shape of its body or chunks.
"""

from __future__ import annotations

from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.jsontext import loads as loads_json
from sidecar.probes.base import CanaryPlan, CanaryRequest
from sidecar.probes.exchange import Answer, NoAnswer, Received, Streamed, engine_said, error_text


def judge(plan: CanaryPlan, request: CanaryRequest, received: Received) -> Result:
    """The canary's result, from the whole of what it received."""
    answer = received.answer
    if isinstance(answer, NoAnswer):
        outcome, reason, status, said = answer.outcome, answer.reason, None, None
        rejection = answer.rejection
    elif isinstance(answer, Streamed):
        outcome, reason, said, rejection = _stream(plan, request, answer)
        status = None
    else:
        outcome, reason, said = _http(plan, request, answer)
        status, rejection = answer.status, False
    return Result(
        outcome,
        reason,
        received.started,
        received.finished,
        received.wall,
        request.request_id,
        status,
        said,
        rejection=rejection,
    )


def _http(
    plan: CanaryPlan, request: CanaryRequest, answer: Answer
) -> tuple[Outcome, str, str | None]:
    status = answer.status
    if 300 <= status < 400:
        where = f" to {answer.location}" if answer.location else ""
        return Outcome.ERROR, f"HTTP {status} redirect{where} (not followed)", None
    if status != 200:
        return Outcome.ERROR, f"HTTP {status}: {error_text(answer.body)}", None
    if not plan.prober.reads_body:
        return Outcome.SUCCESS, f"HTTP 200 from {request.method} {request.path}", None
    if "json" not in answer.content_type.lower():
        shown = answer.content_type or "none"
        return Outcome.INVALID, f"content-type {shown}, expected JSON", None
    try:
        parsed = loads_json(answer.body)
    except ValueError:
        return Outcome.INVALID, f"body is not valid JSON ({len(answer.body)} bytes)", None
    problem = plan.problem(parsed, request.expected_tokens)
    if problem is not None:
        return Outcome.INVALID, problem, None
    return Outcome.SUCCESS, "complete, well-formed answer", plan.answer(parsed)


def _stream(
    plan: CanaryPlan, request: CanaryRequest, answer: Streamed
) -> tuple[Outcome, str, str | None, bool]:
    if answer.error is not None:
        return Outcome.ERROR, f"worker error: {engine_said(answer.error)}", None, True
    chunks = list(answer.chunks)
    failed = plan.prober.failure(chunks)
    if failed is not None:
        return Outcome.ERROR, failed[0], None, failed[1]
    problem = plan.problem(chunks, request.expected_tokens)
    if problem is not None:
        return Outcome.INVALID, problem, None, False
    answered = plan.answer(chunks)
    return Outcome.SUCCESS, f"complete answer in {len(chunks)} chunk(s)", answered, False
