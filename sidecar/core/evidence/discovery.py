"""Discovery: can the router still find this worker? (Dynamo workers, SIDECAR_TRANSPORT=dynamo.)

A Dynamo worker is reached only through discovery (etcd or Dynamo's file backend): its records
live on a lease that it keeps alive. A worker frozen past its lease (10 s) loses its records, and
after it resumes it never registers again: alive, its system server answering and its own
/health saying its endpoints are ready, while no request can ever reach it. Only a restart brings
it back.

What this source may do: make the endpoint notready while its instance is missing from discovery
(no canary is sent: there is no way to it), and, when it was listed before in this incarnation,
run a liveness clock (the orphan). What it may not do: make an endpoint ready (the canary does).
An instance never listed in this incarnation starts no clock: that is a worker still registering,
or a sidecar given other discovery variables than its worker's, and restarting the worker would
fix neither.

Under Kubernetes discovery it is not asked: the cluster lists only Ready pods, so its answer would
follow this sidecar's own verdict (a notready worker would never be found again), and asking
needs rights to list the cluster's EndpointSlices. The canary there reaches the worker by the
record the worker advertises itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DiscoveryState:
    listed: bool | None = None  # None: not asked (not Dynamo, Kubernetes, or no instance yet)
    instance: str | None = None  # the instance asked about
    was_listed: bool = False  # listed at least once for this instance
    missing_since: float | None = None  # liveness clock: an instance listed before, now missing
    changed_at: float = 0.0  # monotonic time ``listed`` last changed
    where: str = ""  # the discovery asked ("file discovery (/srv/kv)", "etcd")

    @property
    def orphaned(self) -> bool:
        return self.missing_since is not None

    def reason(self) -> str:
        if self.listed is not False or self.instance is None:
            return ""
        if self.was_listed:
            return (
                f"not discoverable: {self.instance} is gone from {self.where} while its system "
                "server answers (its records expired, as after a freeze longer than their lease): "
                "no request can reach it, and only a restart registers it again"
            )
        return (
            f"not discoverable: {self.instance} is not listed by {self.where} (yet); if this "
            "lasts, the sidecar's DYN_DISCOVERY_BACKEND and DYN_FILE_KV (or ETCD_ENDPOINTS) are "
            "not the worker's"
        )


def on_discovery(
    state: DiscoveryState, listed: bool | None, instance: str | None, at: float, where: str
) -> DiscoveryState:
    """Apply one look at discovery (``listed`` None: not asked)."""
    if instance != state.instance:
        state = DiscoveryState(instance=instance, changed_at=at, where=where)
    if listed is None:
        return replace(state, listed=None, missing_since=None, where=where)
    changed_at = at if listed != state.listed else state.changed_at
    if listed:
        return replace(
            state, listed=True, was_listed=True, missing_since=None, changed_at=changed_at
        )
    since = state.missing_since
    if state.was_listed and since is None:
        since = at
    return replace(state, listed=False, missing_since=since, changed_at=changed_at, where=where)
