"""Registration: the engine's own cheap health route (vLLM's /health, SGLang's /v1/models, ...).

It answers "is the engine up with its model loaded", never "does it compute": the canary does
that. A refusal or a non-200 answer deregisters at once (gone, loading, draining). A timeout is a
frozen server, unless the engine's counters advanced meanwhile (a health route slow under load is
load, not death) or it is the first one after a canary passed (one slow answer must not drop a
worker that served moments ago).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.evidence.result import Outcome, Result


@dataclass(frozen=True)
class RegistrationState:
    registered: bool | None = None  # None: not checked yet
    incarnation: int = 0  # +1 at every (re)registration: a restarted engine proves itself anew
    last: Result | None = None
    timeouts: int = 0  # consecutive timeouts
    timeout_since: float | None = None  # liveness clock: an unbroken run of unexcused timeouts
    note: str | None = None  # why the last timeout did not deregister

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
    state: RegistrationState, result: Result, *, progressing: bool, canary_just_passed: bool
) -> RegistrationState:
    """Apply one check of the engine's health route.

    ``progressing``: the engine's counters advanced since shortly before the check started.
    ``canary_just_passed``: the last canary of this incarnation passed.
    """
    if result.ok:
        return RegistrationState(
            registered=True,
            incarnation=state.incarnation + (0 if state.registered else 1),
            last=result,
        )
    if result.outcome is not Outcome.TIMEOUT:
        # Gone, loading, draining or broken: deregistered now; not a hang, so no clock.
        return RegistrationState(registered=False, incarnation=state.incarnation, last=result)
    timeouts = state.timeouts + 1
    if progressing:
        return replace(
            state,
            last=result,
            timeouts=timeouts,
            timeout_since=None,
            note="not counted: the engine's counters advance, it is busy",
        )
    since = state.timeout_since if state.timeout_since is not None else result.started
    if state.registered and timeouts == 1 and canary_just_passed:
        return replace(
            state,
            last=result,
            timeouts=timeouts,
            timeout_since=since,
            note="one timeout right after a passed canary is tolerated",
        )
    return replace(
        state, registered=False, last=result, timeouts=timeouts, timeout_since=since, note=None
    )
