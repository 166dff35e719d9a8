"""What every backend's canary has in common: the request, the plan, and body checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar

from sidecar.core.endpoint import unit_name
from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    STEPS,
    CanaryCost,
    ProgressSpec,
    Series,
)
from sidecar.core.evidence.transfers import TransferSpec
from sidecar.probes.role import Backend, Mode, ModelType, Role, Transport


class ProbeKind(StrEnum):
    """What probes a unit: each kind's probe is in a file of its own (sidecar/probes/kinds.py)."""

    HTTP = "http"
    DYNAMO = "dynamo"
    GRPC = "grpc"
    TRANSFER = "transfer"

    @property
    def is_canary(self) -> bool:
        """A canary (of an endpoint, or of one rank), not the transfer probe."""
        return self is not ProbeKind.TRANSFER


# Eight ordinary token ids: valid in every real vocabulary, and shorter than one KV block
# (16 tokens in vLLM and SGLang by default), so a prefill never pins a full block.
PROMPT_TOKEN_IDS: tuple[int, ...] = (100, 101, 102, 103, 104, 105, 106, 107)


def token_completion_body(
    model: str | None, max_tokens: int, prompt: Sequence[int] = PROMPT_TOKEN_IDS
) -> dict[str, Any]:
    """A greedy OpenAI-style completion of a token-id prompt (the canary's unless given) that
    generates exactly ``max_tokens`` tokens (vLLM, TensorRT-LLM)."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }


@dataclass(frozen=True)
class CanaryRequest:
    """One canary, exactly as it goes on the wire."""

    method: str
    path: str
    body: dict[str, Any]
    request_id: str
    # Tokens the engine must report generating; None when the body is a user override.
    expected_tokens: int | None
    headers: Mapping[str, str] = field(default_factory=dict)  # besides X-Request-Id


class Prober:
    """One backend's canary: where it goes, what it carries per role, and what a good answer is.

    Subclasses live one per module (vllm.py, sglang.py, trtllm.py, openai.py); a newcomer finds a
    backend's decode canary in its ``body`` method.
    """

    backend: ClassVar[Backend]
    # How the canary reaches the engine: its HTTP API, or Dynamo's request plane (canary/dynamo/).
    transport: ClassVar[Transport] = Transport.HTTP
    generation_path: ClassVar[str]
    # How the canary is sent, and whether its answer is JSON the prober reads (else a 200 is the
    # whole answer: SGLang's encoder's GET /health, whose 200 says it encoded its test image).
    method: ClassVar[str] = "POST"
    reads_body: ClassVar[bool] = True
    # The engine's cheapest "up and model loaded" route, and whether any answer below 500 from it
    # will do (an engine with no cheap route that answers 200: SGLang's encoder).
    registration_path: ClassVar[str]
    registered_by_any_answer: ClassVar[bool] = False
    # Whether the body names the served model (then it is discovered from GET /v1/models).
    needs_model: ClassVar[bool] = True
    # Where the engine publishes Prometheus metrics, and which samples show work and progress.
    progress: ProgressSpec
    # The engine's "are you asleep" route (answers {"is_sleeping": bool}), and the gauge that is
    # 1 while it is awake (0 asleep) in its metrics; none for a backend that cannot sleep.
    sleep_path: ClassVar[str | None] = None
    awake: ClassVar[tuple[Series, ...]] = ()
    # The engine's own fault-tolerance status ({"engines": [{"id": rank, "status": ...}]},
    # sidecar.core.evidence.faults), read with each registration check; none where it has none.
    fault_path: ClassVar[str | None] = None
    # How a request is pinned to one data-parallel rank (a header, or a body field), and the
    # label that tells ranks apart in the engine's metrics; None where the backend has none.
    rank_header: ClassVar[str | None] = None
    rank_field: ClassVar[str | None] = None
    rank_label: ClassVar[str | None] = None
    # The counters of failed KV transfers from prefill peers, and the requests fetching KV now.
    transfers: ClassVar[TransferSpec | None] = None
    # What becomes of a canary whose client gave up (measured on each real engine: see
    # docs/concepts/backends.md, "Timed-out canaries"). By default the engine aborts a request
    # whose connection closes (vLLM), so closing it is the whole stop. Where the engine runs an
    # abandoned request on, the prober names the engine's own abort (``abort``: SGLang), or,
    # with no abort to send, ``keeps_abandoned``: the probe keeps waiting for the one it sent and
    # sends no other while it runs (llama.cpp's llama-server), so at most one is ever there.
    keeps_abandoned: ClassVar[bool] = False
    # For a kept canary: whether closing its connection, once the engine answers again, stops it
    # (llama-server cancels it), so a fresh one is sent; else the probe waits for the kept one to
    # end (SGLang's encoder runs a /health on to its own 30 s timeout whatever its client does).
    stops_on_close: ClassVar[bool] = True
    # Why a kept canary stays on its connection, in the canary's reason.
    kept_because: ClassVar[str] = "the engine would compute it anyway and has no abort"
    # What a canary causes the engine to write and the sidecar removes (:meth:`leftovers`), in
    # words; None where a canary leaves nothing.
    leaves: ClassVar[str | None] = None

    def skip_reason(self, role: Role) -> str | None:
        """Why this role gets no built-in canary, or None when it gets one."""
        if role.mode is Mode.ENCODE and role.model_type is ModelType.TEXT:
            return (
                "an encode worker of a text model (SIDECAR_MODEL_TYPE=text) has no image to "
                "encode, so no canary reaches an encoder; readiness follows registration (set "
                "SIDECAR_MODEL_TYPE=multimodal for an image encoder's canary)"
            )
        if role.mode is Mode.ENCODE:
            return (
                f"no encode canary is known for {self.backend} over {self.transport}; "
                "readiness follows registration (set DYN_HEALTH_CHECK_PAYLOAD to give it one)"
            )
        return None

    def why(self, role: Role) -> str:
        """One sentence on why the built-in body is right for this role."""
        raise NotImplementedError

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        """The built-in canary body for this role and the number of tokens it must generate."""
        raise NotImplementedError

    def good_answer(self, role: Role) -> str:
        """What :meth:`problem` wants of the answer to this role's body, in words."""
        _, tokens = self.body(role, None, "x")
        return f"a finish reason and {tokens} generated token(s) where the engine reports them"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        """What is wrong with a 200 answer's parsed JSON body, or None when it is well formed."""
        return completion_problem(answer, expected_tokens)

    def generic_problem(self, answer: Any) -> str | None:
        """What is wrong with the answer to a user's DYN_HEALTH_CHECK_PAYLOAD, or None."""
        return generic_problem(answer)

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """The engine's own abort of this canary, sent right after it timed out; None where
        closing the connection stops it (or nothing can)."""
        return None

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """Files this canary caused the engine to write that the sidecar removes, relative to the
        directory they are written under (SIDECAR_EC_STORAGE_PATH): from the answer's parsed
        JSON, or, with none (``answer`` None: the canary timed out or failed), what it may
        still cause to be written. Only an encoder's canary leaves any."""
        return ()

    def stamped(self, role: Role, payload: dict[str, Any]) -> dict[str, Any]:
        """A user's DYN_HEALTH_CHECK_PAYLOAD as it goes out (over HTTP: verbatim)."""
        return dict(payload)

    def answer(self, parsed: Any, role: Role) -> str | None:
        """What a well-formed answer generated (its text, and token ids where it carries them),
        for SIDECAR_CANARY_CHECK_ANSWER; None when it cannot be told or is not reproducible."""
        choice = parsed["choices"][0]
        text, ids = choice.get("text"), choice.get("token_ids")
        if not isinstance(text, str):
            return None
        return text if ids is None else f"{text} {ids}"

    # Prompt tokens one canary may add to the engine's counters (its prompt, plus a BOS token).
    prompt_budget: ClassVar[int] = len(PROMPT_TOKEN_IDS) + 1

    def cost(self, expected_tokens: int) -> CanaryCost:
        """What one canary may move in the engine's counters by itself: progress within these
        budgets is no evidence that other work progressed."""
        return CanaryCost(
            {
                PROMPT: self.prompt_budget,
                GENERATION: expected_tokens,
                STEPS: expected_tokens + 1,
                COMPLETED: 1,
            }
        )


@dataclass(frozen=True)
class CanaryPlan:
    """What --check-config prints and the monitor follows for one endpoint."""

    endpoint: str
    enabled: bool
    why: str
    prober: Prober
    role: Role
    path: str
    override: dict[str, Any] | None = field(default=None)
    rank: int | None = None  # the data-parallel rank every canary of this plan is pinned to
    # What probes it: a canary (over HTTP, or Dynamo's request plane), or the transfer probe
    # (sidecar/probes/transfer.py) for an endpoint that informs and never fails liveness.
    probe: ProbeKind = ProbeKind.HTTP

    @property
    def unit(self) -> str:
        """What this plan checks: the endpoint, or one rank of it ("generate/rank1")."""
        return unit_name(self.endpoint, self.rank)

    def for_rank(self, rank: int) -> CanaryPlan:
        return replace(self, rank=rank)

    def request(self, model: str | None, request_id: str) -> CanaryRequest:
        if self.override is not None:
            body = self.prober.stamped(self.role, self.override)
            request = CanaryRequest("POST", self.path, body, request_id, None)
        else:
            body, tokens = self.prober.body(self.role, model, request_id)
            request = CanaryRequest(self.prober.method, self.path, body, request_id, tokens)
        return self._pinned(request)

    def _pinned(self, request: CanaryRequest) -> CanaryRequest:
        if self.rank is None:
            return request
        prober = self.prober
        if prober.rank_header is not None:
            return replace(request, headers={prober.rank_header: str(self.rank)})
        assert prober.rank_field is not None, f"{prober.backend} cannot pin a rank"
        return replace(request, body={**request.body, prober.rank_field: self.rank})

    def _scope(self) -> tuple[str | None, str]:
        label = self.prober.rank_label if self.rank is not None else None
        return label, str(self.rank)

    def progress_spec(self, path: str | None = None) -> ProgressSpec:
        """The backend's progress series, of this plan's rank only; ``path`` overrides."""
        spec = self.prober.progress.scoped(*self._scope())
        return spec if path is None else replace(spec, path=path)

    @property
    def awake(self) -> tuple[Series, ...]:
        return tuple(s.scoped(*self._scope()) for s in self.prober.awake)

    @property
    def transfers(self) -> TransferSpec | None:
        spec = self.prober.transfers
        return None if spec is None else spec.scoped(*self._scope())

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if self.override is not None:
            return self.prober.generic_problem(answer)
        return self.prober.problem(answer, expected_tokens)

    def answer(self, parsed: Any) -> str | None:
        """A user's payload has no known answer to check."""
        return None if self.override is not None else self.prober.answer(parsed, self.role)

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """What this canary caused to be written (:meth:`Prober.leftovers`); a user's payload:
        nothing known."""
        return () if self.override is not None else self.prober.leftovers(request, answer)

    def cost(self, request: CanaryRequest) -> CanaryCost:
        """A user's payload may move any token counter: only completed requests beyond its own
        then count as other work."""
        if request.expected_tokens is None:
            return CanaryCost({COMPLETED: 1})
        return self.prober.cost(request.expected_tokens)


def body_error(answer: dict[str, Any]) -> str | None:
    """The error an OpenAI-style JSON body carries, or None."""
    error = answer.get("error")
    if error is None or error == {}:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def completion_problem(
    answer: Any, expected_tokens: int | None, *, exact: bool = True
) -> str | None:
    """Check an OpenAI-style completion: a choice with a finish reason and, when reported, the
    number of generated tokens (exactly ``expected_tokens`` when ``exact``, else at most)."""
    if not isinstance(answer, dict):
        return "body is not a JSON object"
    if (err := body_error(answer)) is not None:
        return f"engine error in body: {err}"
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices in body"
    finish = choices[0].get("finish_reason")
    if not isinstance(finish, str) or not finish:
        return "no finish_reason in first choice"
    if exact and finish != "length":
        return f"finish_reason {finish!r}, expected 'length'"
    usage = answer.get("usage")
    if expected_tokens is not None and isinstance(usage, dict) and "completion_tokens" in usage:
        got = usage["completion_tokens"]
        if not isinstance(got, int) or got < 0:
            return f"usage.completion_tokens {got!r} is not a count"
        if (exact and got != expected_tokens) or got > expected_tokens:
            return f"usage.completion_tokens {got}, expected {expected_tokens}"
    return None


def generic_problem(answer: Any) -> str | None:
    """Shape check for a user-supplied payload's answer: JSON, no error, and a finish reason
    wherever the engine's answer shape has one."""
    if not isinstance(answer, dict):
        return "body is not a JSON object"
    if (err := body_error(answer)) is not None:
        return f"engine error in body: {err}"
    if "choices" in answer:
        return completion_problem(answer, None, exact=False)
    meta = answer.get("meta_info")
    if isinstance(meta, dict) and not meta.get("finish_reason"):
        return "no meta_info.finish_reason in body"
    return None
