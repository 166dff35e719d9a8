"""What every canary has in common, whatever its wire: the request as it goes out, the wire's
prober, what the sidecar reads of the engine beside it, and the plan one endpoint follows.

A :class:`Prober` is one transport's wire for one engine and role: the body it sends, what a good
answer is, how a timed-out canary is stopped. It takes the engine's rule for the role (its
:class:`~sidecar.engines.base.Canary`: what the role needs, how many tokens) and only says how
that goes on its wire. Each transport's probers live in its own package
(``sidecar/transports/<transport>/``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from sidecar.core.endpoint import unit_name
from sidecar.core.evidence.load import LoadSpec
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
from sidecar.core.vocabulary import Role
from sidecar.engines.base import Canary, Engine, NewImage, NoCanary, RankPin

#: The probe kind of the KV transfer probe (``sidecar/probes/transfer.py``); every other kind is
#: a transport's canary, named as the transport.
TRANSFER = "transfer"

# Eight ordinary token ids: valid in every real vocabulary, and shorter than one KV block
# (16 tokens in vLLM and SGLang by default), so a prefill never pins a full block.
PROMPT_TOKEN_IDS: tuple[int, ...] = (100, 101, 102, 103, 104, 105, 106, 107)


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
    """One wire's canary for one engine and role. Subclasses, one per backend where the wire's
    bodies differ, fill in :meth:`body` (where a decode canary is built) and, where its answer
    differs, :meth:`problem`."""

    # The transport's name, as the reasons say it.
    transport: ClassVar[str]
    # How the canary is sent, and whether its answer is JSON the prober reads (else a 200 is the
    # whole answer: SGLang's encoder's GET /health, whose 200 says it encoded its test image).
    method: ClassVar[str] = "POST"
    reads_body: ClassVar[bool] = True
    # What becomes of a canary whose client gave up (measured on each real engine: see
    # docs/concepts/backends.md, "Timed-out canaries"). By default closing the connection (the
    # deadline) stops it. Where the engine runs an abandoned request on, the prober names the
    # engine's own abort (:meth:`abort`), or, with no abort to send, ``keeps_abandoned``: the
    # probe keeps waiting for the one it sent and sends no other while it runs, so at most one
    # is ever there.
    keeps_abandoned: ClassVar[bool] = False
    # For a kept canary: whether closing its connection, once the engine answers again, stops it
    # (llama-server cancels it), so a fresh one is sent; else the probe waits for the kept one.
    stops_on_close: ClassVar[bool] = True
    # Why a kept canary stays on its connection, in the canary's reason.
    kept_because: ClassVar[str] = "the engine would compute it anyway and has no abort"
    # What a canary causes the engine to write and the sidecar removes (:meth:`leftovers`), in
    # words; None where a canary leaves nothing.
    leaves: ClassVar[str | None] = None
    # Prompt tokens one canary may add to the engine's counters (its prompt, plus a BOS token).
    prompt_budget: ClassVar[int] = len(PROMPT_TOKEN_IDS) + 1
    # The fewest tokens this wire's canary generates (a wire may ask more than the role needs).
    min_tokens: ClassVar[int] = 0
    # It sends an image encoder's canary (a new image each time: the role's NewImage need).
    encodes: ClassVar[bool] = False

    def __init__(self, engine: Engine, role: Role, rule: Canary | NoCanary) -> None:
        self.engine = engine
        self.role = role
        self.rule = rule

    @property
    def path(self) -> str:
        """Where the canary goes (a route, a method, an endpoint)."""
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        """The tokens the built-in canary must generate."""
        wanted = self.rule.tokens if isinstance(self.rule, Canary) else 0
        return max(wanted, self.min_tokens) if wanted else 0

    @property
    def refusal(self) -> str | None:
        """Why this role gets no built-in canary over this wire, or None."""
        if isinstance(self.rule, NoCanary):
            return self.rule.why
        if isinstance(self.rule.need, NewImage) and not self.encodes:
            return (
                f"no encode canary is known for {self.engine.name} over {self.transport}; "
                "readiness follows registration (set DYN_HEALTH_CHECK_PAYLOAD to give it one)"
            )
        return None

    def why(self) -> str:
        """One sentence on why the built-in request is right for this role."""
        assert isinstance(self.rule, Canary)
        return self.rule.why

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        """The built-in canary body for this role."""
        raise NotImplementedError

    def good_answer(self) -> str:
        """What :meth:`problem` wants of the answer, in words."""
        return f"a finish reason and {self.tokens} generated token(s) where the engine reports them"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        """What is wrong with a well-formed answer (its parsed body, or its chunks or messages),
        or None."""
        raise NotImplementedError

    def generic_problem(self, answer: Any) -> str | None:
        """What is wrong with the answer to a user's DYN_HEALTH_CHECK_PAYLOAD, or None."""
        return self.problem(answer, None)

    def failure(self, answer: Any) -> tuple[str, bool] | None:
        """A failure the engine declared inside an answer that arrived whole (an error event in
        a stream that ended OK): what it says, and whether it refuses the request itself (a
        rejection, not a hang); None where there is none."""
        return None

    def answer(self, parsed: Any) -> str | None:
        """What a well-formed answer generated, for SIDECAR_CANARY_CHECK_ANSWER; None when it
        cannot be told or is not reproducible."""
        return None

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """The engine's own abort of this canary, sent right after it timed out; None where
        closing the connection stops it (or nothing can)."""
        return None

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """Files this canary caused the engine to write that the sidecar removes, relative to the
        directory they are written under (SIDECAR_EC_STORAGE_PATH): from the answer, or, with
        none (``answer`` None), what it may still cause to be written."""
        return ()

    def stamped(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A user's DYN_HEALTH_CHECK_PAYLOAD as it goes out (by default: verbatim)."""
        return dict(payload)

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
class Reads:
    """What the sidecar reads of the engine beside one endpoint's canary, as its transport
    resolved it: the metrics and the samples that show progress (read only when the schedule
    says so), the sleep and fault-tolerance routes (None: not asked), the rank pin (None: a
    canary is not pinned), the KV-transfer counters, and whether the served model is
    discovered (GET /v1/models)."""

    progress: ProgressSpec
    sleep_path: str | None = None
    awake: tuple[Series, ...] = ()
    fault_path: str | None = None
    pin: RankPin | None = None
    transfers: TransferSpec | None = None
    needs_model: bool = False
    # The engine's own load report in the same read (OpenEngine's GetLoad), where it gives one.
    load: LoadSpec | None = None

    def every(self) -> tuple[Series, ...]:
        """Every series a read of the engine's metrics is parsed for."""
        transfers = self.transfers.every() if self.transfers is not None else ()
        load = self.load.every() if self.load is not None else ()
        return (*self.progress.every(), *transfers, *self.awake, *load)


@dataclass(frozen=True)
class CanaryPlan:
    """What --check-config prints and the monitor follows for one endpoint."""

    endpoint: str
    enabled: bool
    why: str
    prober: Prober
    reads: Reads
    override: dict[str, Any] | None = None
    rank: int | None = None  # the data-parallel rank every canary of this plan is pinned to
    # What probes it: the transport's canary (its name), or the transfer probe (TRANSFER) for an
    # endpoint that informs and never fails liveness.
    probe: str = "http"

    @property
    def role(self) -> Role:
        return self.prober.role

    @property
    def path(self) -> str:
        return self.prober.path

    @property
    def is_canary(self) -> bool:
        """A canary (of an endpoint, or of one rank), not the transfer probe."""
        return self.probe != TRANSFER

    @property
    def unit(self) -> str:
        """What this plan checks: the endpoint, or one rank of it ("generate/rank1")."""
        return unit_name(self.endpoint, self.rank)

    @property
    def wants_model(self) -> bool:
        """Its requests name the served model."""
        return self.enabled and self.override is None and self.reads.needs_model

    def for_rank(self, rank: int) -> CanaryPlan:
        return replace(self, rank=rank)

    def request(self, model: str | None, request_id: str) -> CanaryRequest:
        prober = self.prober
        if self.override is not None:
            body = prober.stamped(self.override)
            request = CanaryRequest("POST", prober.path, body, request_id, None)
        else:
            body = prober.body(model, request_id)
            request = CanaryRequest(prober.method, prober.path, body, request_id, prober.tokens)
        return self._pinned(request)

    def _pinned(self, request: CanaryRequest) -> CanaryRequest:
        pin = self.reads.pin
        if self.rank is None:
            return request
        assert pin is not None, f"{self.prober.engine.name} cannot pin a rank"
        if pin.header is not None:
            return replace(request, headers={pin.header: str(self.rank)})
        assert pin.field is not None
        return replace(request, body={**request.body, pin.field: self.rank})

    def _scope(self) -> tuple[str | None, str]:
        pin = self.reads.pin
        label = pin.label if pin is not None and self.rank is not None else None
        return label, str(self.rank)

    def progress_spec(self) -> ProgressSpec:
        """The progress series, of this plan's rank only."""
        return self.reads.progress.scoped(*self._scope())

    @property
    def awake(self) -> tuple[Series, ...]:
        return tuple(s.scoped(*self._scope()) for s in self.reads.awake)

    @property
    def transfers(self) -> TransferSpec | None:
        spec = self.reads.transfers
        return None if spec is None else spec.scoped(*self._scope())

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if self.override is not None:
            return self.prober.generic_problem(answer)
        return self.prober.problem(answer, expected_tokens)

    def answer(self, parsed: Any) -> str | None:
        """A user's payload has no known answer to check."""
        return None if self.override is not None else self.prober.answer(parsed)

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


def token_ids(prompt: Sequence[int] = PROMPT_TOKEN_IDS) -> list[int]:
    """The canary's prompt as a list (every wire sends the same ids)."""
    return list(prompt)
