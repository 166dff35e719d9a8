"""What every canary over an engine's own HTTP API has in common: its route (SIDECAR_CANARY_PATH
overrides it), an OpenAI-style answer read by default, and how a role's need goes in the body.

A need goes on this wire as its engine's API names it: TensorRT-LLM's local run as
``"disaggregated_params": {"request_type": "context_and_generation"}``, SGLang's fake transfer as
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` beside the request's fields.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.vocabulary import Role
from sidecar.engines.base import Canary, Engine, FakeTransfer, LocalRun, Need, NoCanary
from sidecar.probes.base import Prober
from sidecar.probes.completions import completion_problem, generic_problem


def carried(need: Need, request_id: str) -> dict[str, Any]:
    """The body fields that carry a role's need over HTTP."""
    match need:
        case LocalRun():
            return {"disaggregated_params": {"request_type": need.request_type}}
        case FakeTransfer():
            return {
                "bootstrap_host": need.host,
                "bootstrap_port": need.port,
                "bootstrap_room": need.room(request_id),
            }
        case _:
            return {}


class HttpProber(Prober):
    """One backend's canary over its HTTP API."""

    transport: ClassVar[str] = "http"
    route: ClassVar[str]  # the backend's generation route

    def __init__(
        self, engine: Engine, role: Role, rule: Canary | NoCanary, path: str | None = None
    ) -> None:
        super().__init__(engine, role, rule)
        self._path = path

    @property
    def path(self) -> str:
        return self._path or self.route

    @property
    def need(self) -> Need:
        return self.rule.need if isinstance(self.rule, Canary) else None

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return completion_problem(answer, expected_tokens)

    def generic_problem(self, answer: Any) -> str | None:
        return generic_problem(answer)

    def answer(self, parsed: Any) -> str | None:
        choice = parsed["choices"][0]
        text, ids = choice.get("text"), choice.get("token_ids")
        if not isinstance(text, str):
            return None
        return text if ids is None else f"{text} {ids}"
