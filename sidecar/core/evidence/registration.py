"""Registration: the engine's own cheap health route (vLLM's /health, SGLang's /v1/models, ...).

It answers "is the engine up with its model loaded", never "does it compute": the canary does
that. A refusal or a non-200 answer deregisters at once (gone, loading, draining); an engine that
served and then says "not serving" as a status (grpc.health.v1's NOT_SERVING) also starts a
liveness clock, which SERVING or a refusal ends. A timeout is ambiguous, slow or frozen: it is
load when the engine's counters advanced meanwhile. Otherwise, for a role with a canary, it sends
a canary at once and the canary decides (on vLLM under load on two cores the health route took
over a second while the engine computed: deregistering on it was a false 503); for a role without
one, ``threshold`` timeouts in a row deregister.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.core.evidence.result import Outcome, Result


@dataclass(frozen=True)
class RegistrationState:
    registered: bool | None = None  # None: not checked yet
    incarnation: int = 0  # +1 at every (re)registration: a restarted engine proves itself anew
    last: Result | None = None
    timeouts: int = 0  # consecutive timeouts
    timeout_since: float | None = None  # liveness clock: an unbroken run of unexcused timeouts
    note: str | None = None  # why the last timeout did not deregister
    doubt: bool = False  # the last check timed out unexcused: a canary should find out now
    identity: str | None = None  # what registered, where it can change (a Dynamo instance)
    # liveness clock: the engine has said it is not serving (a status from a server that stays
    # up, not a refusal) ever since it last served, with no refusal between
    not_serving_since: float | None = None

    @property
    def answers_200(self) -> bool:
        return self.last is not None and self.last.ok

    @property
    def gone(self) -> bool:
        """Nothing listens: the engine process is gone."""
        return self.last is not None and self.last.outcome is Outcome.REFUSED

    @property
    def reason(self) -> str:
        if self.last is None:
            return "not checked yet"
        return self.last.reason + (f" ({self.note})" if self.note else "")


def on_registration(
    state: RegistrationState,
    result: Result,
    *,
    progressing: bool,
    canary_decides: bool,
    threshold: int,
) -> RegistrationState:
    """Apply one check of the engine's health route.

    ``progressing``: the engine's counters advanced since shortly before the check started.
    ``canary_decides``: the role has a canary, which goes through the same server.
    ``threshold``: consecutive unexcused timeouts that deregister a role without a canary.
    """
    if result.ok:
        # A Dynamo worker restarted between two checks answers with a new instance.
        same = bool(state.registered) and state.identity == result.identity
        return RegistrationState(
            registered=True,
            incarnation=state.incarnation + (0 if same else 1),
            last=result,
            identity=result.identity,
        )
    if result.outcome is not Outcome.TIMEOUT:
        # Gone, loading, draining or broken: deregistered now; not a hang, so no timeout clock.
        # But an engine that served and now says it cannot, from a server that stays up, will
        # not come back by itself (vLLM's gRPC server with its engine dead): that starts one.
        said = result.not_serving and (state.registered or state.not_serving_since is not None)
        since = state.not_serving_since if state.not_serving_since is not None else result.started
        return RegistrationState(
            registered=False,
            incarnation=state.incarnation,
            last=result,
            identity=state.identity,
            not_serving_since=since if said else None,
        )
    timeouts = state.timeouts + 1
    if not state.registered:
        # It never answered in this incarnation: not registered, and not a hang of a server that
        # served (the startup probe's business).
        return replace(state, registered=False, last=result, timeouts=timeouts, note=None)
    if progressing:
        return replace(
            state,
            last=result,
            timeouts=timeouts,
            timeout_since=None,
            doubt=False,
            note="not counted: the engine's counters advance, it is busy",
        )
    if canary_decides:
        # Slow or frozen? The canary goes through the same server and finds out (it leaves now);
        # a health route slow under load must not drop a worker that computes, and a frozen one
        # fails its canaries, whose clock is the liveness evidence.
        return replace(
            state,
            last=result,
            timeouts=timeouts,
            timeout_since=None,
            doubt=True,
            note="not counted: a canary finds out whether the engine computes",
        )
    since = state.timeout_since if state.timeout_since is not None else result.started
    if timeouts < threshold:
        return replace(
            state,
            last=result,
            timeouts=timeouts,
            timeout_since=since,
            note=f"{timeouts} of {threshold} timeouts before deregistering",
        )
    return replace(
        state, registered=False, last=result, timeouts=timeouts, timeout_since=since, note=None
    )
