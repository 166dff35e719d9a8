"""What every Dynamo canary has in common: the answer as a stream of chunks, and progress read from
the worker's system server.

A Dynamo worker answers a request over its request plane as a stream of ``LLMEngineOutput``
chunks (``token_ids``, ``finish_reason``, ``completion_usage``, ...). A canary passes only when
the whole stream ends within the deadline with the right number of tokens and a finish reason:
Dynamo's own in-process canary judges the first chunk only, and so misses a worker that stalls
after one token.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.evidence.progress import COMPLETED, GENERATION, CanaryCost, ProgressSpec, Series
from sidecar.core.vocabulary import Role
from sidecar.engines.base import Canary, Engine, FakeTransfer, LocalRun, Need, NoCanary
from sidecar.probes.base import Prober
from sidecar.probes.exchange import engine_said

# dynamo._core.backend.HEALTH_CHECK_KEY: the marker Dynamo's handlers look for. TensorRT-LLM's
# decode handler runs a request locally only when it carries the marker and disaggregated_params;
# vLLM's prefill skips the KV hand-off with it.
HEALTH_CHECK_KEY = "_HEALTH_CHECK"
# Bytes of response one canary chunk may add to dynamo_component_response_bytes_total (the mocker's
# chunks, with their usage block, are about 300 bytes).
CHUNK_BYTES = 1024


def greedy_stop(tokens: int) -> dict[str, Any]:
    """Stop conditions for exactly ``tokens`` generated tokens (ignore_eos: an early end of
    sequence would make a healthy answer look short)."""
    return {
        "max_tokens": tokens,
        "stop": None,
        "stop_token_ids": None,
        "include_stop_str_in_output": False,
        "ignore_eos": True,
    }


def _labels(endpoint: str) -> tuple[tuple[str, str], ...]:
    """The labels of the worker's dynamo_component_* series that select the canaried endpoint:
    its name, or its whole path (namespace.component.endpoint)."""
    parts = endpoint.split(".")
    if len(parts) == 3:
        namespace, component, name = parts
        return (
            ("dynamo_namespace", namespace),
            ("dynamo_component", component),
            ("dynamo_endpoint", name),
        )
    return (("dynamo_endpoint", endpoint),)


def dynamo_progress(endpoint: str) -> ProgressSpec:
    """The worker's own request metrics on its system server, a hint as for any engine: requests in
    flight, and counters that advance only when the worker answers (requests_total counts
    arrivals, which a hung worker keeps taking, so it proves nothing)."""
    labels = _labels(endpoint)
    return ProgressSpec(
        path="/metrics",
        running=(Series("dynamo_component_inflight_requests", labels),),
        waiting=(),
        counters={
            GENERATION: (Series("dynamo_component_response_bytes_total", labels),),
            COMPLETED: (Series("dynamo_component_request_duration_seconds_count", labels),),
        },
        # Response bytes are counted as each chunk (a token) streams out.
        per_step=frozenset({GENERATION}),
    )


def _finish(chunk: Any) -> str | None:
    finish = chunk.get("finish_reason") if isinstance(chunk, dict) else None
    return finish if isinstance(finish, str) and finish else None


def stream_problem(chunks: Any, expected_tokens: int | None, *, exact: bool = True) -> str | None:
    """What is wrong with a worker's whole answer (its chunks, in order), or None.

    It needs at least one chunk, every chunk an object, a finish reason on the last one
    ('length' when ``exact``), and, when ``expected_tokens`` is given, exactly that many tokens
    over all chunks (and in ``completion_usage`` where the worker reports it)."""
    if not isinstance(chunks, list) or not chunks:
        return "the stream ended without a chunk"
    if not all(isinstance(c, dict) for c in chunks):
        return "a chunk is not a JSON object"
    for chunk in chunks:
        if chunk.get("error"):
            return f"engine error in a chunk: {engine_said(chunk['error'])}"
    finish = _finish(chunks[-1])
    if finish is None:
        return f"no finish_reason on the last of {len(chunks)} chunk(s)"
    if exact and finish != "length":
        return f"finish_reason {finish!r}, expected 'length'"
    if expected_tokens is None:
        return None
    ids = [c.get("token_ids") for c in chunks]
    if not all(isinstance(i, list) for i in ids):
        return "a chunk has no token_ids list"
    got = sum(len(i) for i in ids if isinstance(i, list))
    if got != expected_tokens:
        return f"{got} token(s) in the stream, expected {expected_tokens}"
    usage = chunks[-1].get("completion_usage")
    reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(reported, int) and reported != expected_tokens:
        return f"completion_usage.completion_tokens {reported}, expected {expected_tokens}"
    return None


def carried(need: Need, request_id: str) -> dict[str, Any]:
    """The payload fields that carry a role's need to a Dynamo worker, as its handlers read them:
    TensorRT-LLM's local run as ``disaggregated_params``, SGLang's fake transfer as
    ``bootstrap_info``."""
    match need:
        case LocalRun():
            return {"disaggregated_params": {"request_type": need.request_type}}
        case FakeTransfer():
            return {
                "bootstrap_info": {
                    "bootstrap_host": need.host,
                    "bootstrap_port": need.port,
                    "bootstrap_room": need.room(request_id),
                }
            }
        case _:
            return {}


class DynamoProber(Prober):
    """One backend's canary over Dynamo's request plane. Subclasses, one per module, say what the
    payload carries per role (``body``)."""

    transport: ClassVar[str] = "dynamo"

    def __init__(
        self, engine: Engine, role: Role, rule: Canary | NoCanary, endpoint: str = "generate"
    ) -> None:
        super().__init__(engine, role, rule)
        self.endpoint = endpoint

    @property
    def path(self) -> str:
        """The endpoint the canary goes to (its instance is found at run time)."""
        return self.endpoint

    @property
    def need(self) -> Need:
        return self.rule.need if isinstance(self.rule, Canary) else None

    def good_answer(self) -> str:
        return f"with {self.tokens} token(s) and finish reason 'length'"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return stream_problem(answer, expected_tokens)

    def generic_problem(self, answer: Any) -> str | None:
        return stream_problem(answer, None, exact=False)

    def answer(self, parsed: Any) -> str | None:
        ids = [t for chunk in parsed for t in chunk.get("token_ids") or ()]
        return " ".join(map(str, ids)) if ids else None

    def cost(self, expected_tokens: int) -> CanaryCost:
        """One canary completes one request and streams at most tokens + 1 chunks; and the one
        before it, stopped on the worker when it timed out, may complete (as cancelled) a few
        milliseconds later, inside this one's window: two canaries' worth."""
        return CanaryCost({COMPLETED: 2, GENERATION: 2 * CHUNK_BYTES * (expected_tokens + 1)})
