"""What an engine is, whatever carries the canary to it: one value per backend, each in a module
of its own (``sidecar/engines/<backend>.py``, listed in ``sidecar/engines/__init__.py``).

Two kinds of fact, both measured on the real engines (docs/engines.md):

- its role rules (:meth:`Engine.canary`): what each role's canary must carry for the engine to run
  it whole and locally (a :data:`Need`), how many tokens it must generate, or why the role gets
  no canary at all;
- its own HTTP API (:class:`HttpApi`): the routes the sidecar reads beside the canary
  (registration, metrics and which samples show progress, sleep state, fault tolerance), how a
  request is pinned to one data-parallel rank, and the counters of KV transfers.

A transport's wire (``sidecar/transports/<transport>/``) says how a need goes on its wire (a
body field, a proto field); it never decides which role needs what.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sidecar.core.evidence.progress import ProgressSpec, Series
from sidecar.core.evidence.transfers import TransferSpec
from sidecar.core.vocabulary import Mode, ModelType, Role

#: SGLang's FAKE_BOOTSTRAP_HOST: a request with it runs on a fake KV sender and receiver.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
#: TensorRT-LLM's request type that runs a request whole on one worker.
CONTEXT_AND_GENERATION = "context_and_generation"


@dataclass(frozen=True)
class LocalRun:
    """TensorRT-LLM's disaggregated parameters with request type ``context_and_generation``:
    the worker runs the canary as a local prefill plus decode. A decode worker refuses a request
    without them ("Disaggregated params are required for decode mode": Dynamo's own canary
    crash-looped its decode workers on it, DIS-1737). Never forge ``generation_only`` params:
    newer builds reject unsigned ones."""

    request_type: str = CONTEXT_AND_GENERATION

    @property
    def why(self) -> str:
        return (
            f"request type {self.request_type} runs it as a local prefill plus decode (no peer, "
            "no KV transfer; without it a decode worker refuses it: DIS-1737)"
        )


@dataclass(frozen=True)
class FakeTransfer:
    """SGLang's fake KV transfer: bootstrap host :data:`FAKE_BOOTSTRAP_HOST` makes a prefill or
    decode server run the request with a fake KV sender and receiver, needing no peer and never
    dialling the bootstrap port. A decode server given no bootstrap host crashes its scheduler
    ("'NoneType' object has no attribute 'startswith'"); a prefill server without a room refuses
    (HTTP 400), and with a real host waits for a decode peer that never comes. The room is fresh
    per canary, so canaries spread over the data-parallel ranks."""

    port: int = 8998  # SIDECAR_SGLANG_BOOTSTRAP_PORT: put in the request, never contacted
    host: str = FAKE_BOOTSTRAP_HOST

    @staticmethod
    def room(request_id: str, bits: int = 63) -> int:
        """A room derived from the canary's id: random per canary, reproducible from the logs;
        ``bits`` wide (a service whose field is an int32 takes 31)."""
        return uuid.uuid5(uuid.NAMESPACE_URL, request_id).int % (1 << bits)

    @property
    def why(self) -> str:
        return (
            f"bootstrap host {self.host} selects SGLang's fake KV transfer, so the canary runs "
            "without a peer"
        )


@dataclass(frozen=True)
class NewImage:
    """An image encoder's canary: an image new for every canary (``sidecar/probes/image.py``),
    since an encoder serves an image it has seen from its cache without running the vision tower.
    """

    why: str = "a new image per canary"


#: What a role's canary must carry, beyond a plain greedy request (None).
Need = LocalRun | FakeTransfer | NewImage | None


@dataclass(frozen=True)
class Canary:
    """One role's canary, as the engine needs it: what it carries, the tokens it must generate
    (at least: a wire may ask more), and why that is right for the role."""

    need: Need
    tokens: int
    why: str


@dataclass(frozen=True)
class NoCanary:
    """The role gets no canary: readiness follows registration."""

    why: str


#: Why a text model's encode worker gets no canary, whatever the engine.
TEXT_ENCODER = (
    "an encode worker of a text model (SIDECAR_MODEL_TYPE=text) has no image to encode, so no "
    "canary reaches an encoder; readiness follows registration (set SIDECAR_MODEL_TYPE=multimodal "
    "for an image encoder's canary)"
)


@dataclass(frozen=True)
class RankPin:
    """How a request is pinned to one data-parallel rank (a header, or a body field), and the
    label that tells the ranks apart in the engine's metrics."""

    label: str
    header: str | None = None
    field: str | None = None

    @property
    def how(self) -> str:
        """The pin, as --check-config says it."""
        return (
            f"header {self.header}: <rank>" if self.header else f"body field {self.field}: <rank>"
        )


@dataclass(frozen=True)
class HttpApi:
    """The engine's own HTTP routes the sidecar reads, for one role."""

    # The cheapest "up and model loaded" route, and whether any answer below 500 from it will do
    # (an engine with no cheap route that answers 200: SGLang's encoder).
    registration_path: str
    progress: ProgressSpec  # its Prometheus metrics, and which samples show work and progress
    registered_by_any_answer: bool = False
    # Whether a canary names the served model (then it is discovered from GET /v1/models).
    needs_model: bool = True
    # The "are you asleep" route ({"is_sleeping": bool}) and the gauges that are 1 while awake;
    # none for a backend that cannot sleep.
    sleep_path: str | None = None
    awake: tuple[Series, ...] = ()
    # Its own fault-tolerance status ({"engines": [{"id": rank, "status": ...}]},
    # sidecar.core.evidence.faults); none where it has none.
    fault_path: str | None = None
    pin: RankPin | None = None  # None: a canary cannot be pinned to a rank
    # The counters of failed KV transfers from prefill peers, and the requests fetching KV now.
    transfers: TransferSpec | None = None


class Engine:
    """One backend: its name (SIDECAR_BACKEND), its role rules and its HTTP API. Subclasses, one
    per module, fill in :meth:`role_canary` and :attr:`http`."""

    name: str
    title: str  # as the docs name it
    http: HttpApi
    # The role whose canary is a KV transfer from a prefill peer (SIDECAR_KV_PEER_URL), if any.
    transfer_role: Mode | None = None

    def canary(self, role: Role, *, bootstrap_port: int = 8998) -> Canary | NoCanary:
        """What this role's canary must be, or why it gets none."""
        if role.mode is Mode.ENCODE and role.model_type is ModelType.TEXT:
            return NoCanary(TEXT_ENCODER)
        return self.role_canary(role, bootstrap_port)

    def role_canary(self, role: Role, bootstrap_port: int) -> Canary | NoCanary:
        raise NotImplementedError

    def api(self, role: Role) -> HttpApi:
        """The HTTP API that serves this role (an encoder's may differ)."""
        return self.http
