"""A stateful property test of the decision core: hypothesis drives random sequences of
registration answers, canary results, metrics reads and clock steps through the pure rules, and
checks after every step the invariants the verdicts must keep."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sidecar.core.endpoint import EndpointState, apply_canary, apply_registration, apply_sample
from sidecar.core.evidence.progress import COMPLETED, GENERATION, PROMPT, STEPS, ProgressSample
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.verdict import decide_liveness, endpoint_verdict
from tests.support.tables import COST, POLICY, SPEC

pytestmark = pytest.mark.unit

CATEGORIES = (PROMPT, GENERATION, STEPS, COMPLETED)
REGISTRATION_ANSWERS = [
    (Outcome.SUCCESS, 200),
    (Outcome.ERROR, 503),
    (Outcome.REFUSED, None),
    (Outcome.TIMEOUT, None),
]
CANARY_ANSWERS = [
    (Outcome.SUCCESS, 200),
    (Outcome.TIMEOUT, None),
    (Outcome.INVALID, 200),
    (Outcome.ERROR, 500),
    (Outcome.ERROR, 400),
    (Outcome.REFUSED, None),
]


class Verdicts(RuleBasedStateMachine):
    @initialize(has_canary=st.booleans())
    def start(self, has_canary: bool) -> None:
        self.now = 0.0
        self.ep = EndpointState("generate", has_canary, "why")
        self.counters = dict.fromkeys(CATEGORIES, 0.0)
        self.live_changes: list[float] = []
        self.live = True
        # After a failure other than a timeout: (incarnation, failures, ready) it left.
        self.pinned: tuple[int, int, bool | None] | None = None

    def _result(self, outcome: Outcome, status: int | None, latency: float) -> Result:
        started = self.now
        self.now += latency
        return Result(outcome, str(outcome), started, self.now, 1e9 + self.now, "c", status)

    def _read(self, in_flight: float | None) -> ProgressSample:
        return ProgressSample(
            self.now, 1e9 + self.now, in_flight, dict(self.counters), stepwise=True
        )

    @rule(answer=st.sampled_from(REGISTRATION_ANSWERS), latency=st.sampled_from([0.01, 0.5]))
    def registration(self, answer: tuple[Outcome, int | None], latency: float) -> None:
        outcome, status = answer
        if outcome is Outcome.TIMEOUT:
            latency = POLICY.timeout
        self.ep = apply_registration(self.ep, self._result(outcome, status, latency), POLICY)

    @precondition(lambda self: self.ep.has_canary and self.ep.registration.registered)
    @rule(
        answer=st.sampled_from(CANARY_ANSWERS),
        flight=st.sampled_from([None, 0, 1, 3]),
        moved=st.sampled_from([0, 8, 50]),
    )
    def canary(self, answer: tuple[Outcome, int | None], flight: float | None, moved: int) -> None:
        outcome, status = answer
        baseline = self._read(flight) if flight is not None else None
        latency = POLICY.timeout if outcome is Outcome.TIMEOUT else 0.01
        result = self._result(outcome, status, latency)
        self.counters[PROMPT] += moved  # 8: the canary's own prompt, counted on arrival
        end = self._read(flight) if flight is not None else None
        before = self.ep
        self.ep = apply_canary(
            before, result, before.incarnation, POLICY, baseline=baseline, end=end, cost=COST
        )
        self.pinned = None
        if outcome not in (Outcome.SUCCESS, Outcome.TIMEOUT):
            c = self.ep.canary
            self.pinned = (self.ep.incarnation, c.failures, c.ready)
            assert c.failures >= 1  # counted, whatever the counters did

    @rule(
        flight=st.sampled_from([None, 0, 1, 4]),
        advance=st.sampled_from([0, 0, 5, 100]),
        readable=st.booleans(),
    )
    def metrics(self, flight: float | None, advance: int, readable: bool) -> None:
        for category in (PROMPT, GENERATION):
            self.counters[category] += advance
        read = self._read(flight) if readable else None
        self.ep = apply_sample(self.ep, read, "unreadable", SPEC)

    @rule(step=st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0]))
    def clock(self, step: float) -> None:
        self.now += step

    # --- invariants ------------------------------------------------------------------------------
    @invariant()
    def a_role_without_canary_is_never_notready_while_registered(self) -> None:
        ep = self.ep
        if not ep.has_canary and ep.registration.registered:
            assert endpoint_verdict(ep, POLICY, self.now).ready is True

    @invariant()
    def a_failure_other_than_a_timeout_is_never_undone_by_counters(self) -> None:
        if self.pinned is None:
            return
        incarnation, failures, ready = self.pinned
        if self.ep.incarnation == incarnation and self.ep.registration.registered:
            assert (self.ep.canary.failures, self.ep.canary.ready) == (failures, ready)

    @invariant()
    def no_liveness_failure_while_the_health_route_answers_non_200_or_refuses(self) -> None:
        last = self.ep.registration.last
        if last is not None and last.outcome in (Outcome.ERROR, Outcome.REFUSED):
            assert decide_liveness({"generate": self.ep}, self.now, POLICY.liveness_window).live

    @invariant()
    def live_never_changes_twice_within_one_window(self) -> None:
        live = decide_liveness({"generate": self.ep}, self.now, POLICY.liveness_window).live
        if live != self.live:
            self.live = live
            self.live_changes.append(self.now)
        changes = self.live_changes
        if len(changes) >= 3:
            assert changes[-1] - changes[-3] >= POLICY.liveness_window

    @invariant()
    def a_stall_is_notready_only_after_a_canary_timed_out(self) -> None:
        canary = self.ep.canary
        if canary.stalled:
            assert canary.last is not None
            assert canary.last.outcome is Outcome.TIMEOUT

    @invariant()
    def ready_with_a_canary_only_after_a_pass(self) -> None:
        ep = self.ep
        if ep.has_canary and endpoint_verdict(ep, POLICY, self.now).ready:
            assert ep.canary.proven


Verdicts.TestCase.settings = settings(max_examples=400, stateful_step_count=60, deadline=None)
TestVerdicts = Verdicts.TestCase
