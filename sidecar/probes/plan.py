"""The pure rule that plans an endpoint's canary, from what its transport resolved: whether it
gets one, why, and with which prober (``sidecar/wiring/resolve.py`` calls it once)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.core.vocabulary import GENERATE, KV_TRANSFER
from sidecar.probes.base import TRANSFER, CanaryPlan, Prober, Reads


def plan_canary(
    prober: Prober,
    reads: Reads,
    *,
    kind: str,
    enabled: bool,
    payload: Mapping[str, Any] | None = None,
    endpoint: str = GENERATE,
) -> CanaryPlan:
    """Decide whether the endpoint gets a canary (DYN_HEALTH_CHECK_ENABLED), why, and with which
    request (DYN_HEALTH_CHECK_PAYLOAD, else the prober's own)."""
    override = dict(payload) if payload is not None else None

    def plan(on: bool, why: str) -> CanaryPlan:
        return CanaryPlan(endpoint, on, why, prober, reads, override, probe=kind)

    if not enabled:
        return plan(
            False,
            "canaries are off (DYN_HEALTH_CHECK_ENABLED=false); readiness follows registration",
        )
    if override is not None:
        return plan(True, "DYN_HEALTH_CHECK_PAYLOAD replaces the built-in body")
    if prober.refusal is not None:
        return plan(False, prober.refusal)
    return plan(True, prober.why())


def plan_transfer_probe(prober: Prober, reads: Reads, peer_url: str, interval: float) -> CanaryPlan:
    """The kv_transfer endpoint's plan: a prefill peer at ``peer_url`` (SIDECAR_KV_PEER_URL),
    probed every ``interval`` (SIDECAR_KV_PROBE_INTERVAL)."""
    why = (
        f"a real KV transfer from the prefill peer {peer_url}, decoded here and checked against "
        f"a local prefill, every {interval:g} s and when transfers fail"
    )
    return CanaryPlan(KV_TRANSFER, True, why, prober, reads, probe=TRANSFER)
