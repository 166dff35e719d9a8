"""Role-aware canaries: one prober per backend and transport, and the pure rule that plans an
endpoint's canary.

Where is a decode canary built? In the backend's module, method ``body``: over the engine's HTTP
API ``vllm.py``, ``sglang.py``, ``trtllm.py`` or ``openai.py``; over Dynamo's request plane
(SIDECAR_TRANSPORT=dynamo) ``dynamo/vllm.py``, ``dynamo/sglang.py`` or ``dynamo/trtllm.py``.
"""

from __future__ import annotations

from sidecar.config import GENERATE, KV_TRANSFER, Backend, Settings, Transport
from sidecar.probes.base import CanaryPlan, CanaryRequest, Prober, Role
from sidecar.probes.dynamo import DynamoSglangProber, DynamoTrtllmProber, DynamoVllmProber
from sidecar.probes.kinds import Probe, ProbeKind
from sidecar.probes.openai import OpenAIProber
from sidecar.probes.sglang import SglangProber
from sidecar.probes.transfer import PATH
from sidecar.probes.trtllm import TrtllmProber
from sidecar.probes.vllm import VllmProber

__all__ = [
    "CanaryPlan",
    "CanaryRequest",
    "Probe",
    "ProbeKind",
    "Prober",
    "Role",
    "plan_canary",
    "plan_transfer_probe",
    "prober_for",
]


def prober_for(settings: Settings) -> Prober:
    if settings.transport is Transport.DYNAMO:
        endpoint = settings.dynamo_endpoint or GENERATE
        match settings.backend:
            case Backend.VLLM:
                return DynamoVllmProber(endpoint)
            case Backend.SGLANG:
                return DynamoSglangProber(endpoint, settings.sglang_bootstrap_port)
            case Backend.TRTLLM:
                return DynamoTrtllmProber(endpoint)
            case Backend.OPENAI:  # refused by the configuration's checks
                raise ValueError("no Dynamo worker speaks the openai backend")
    match settings.backend:
        case Backend.VLLM:
            return VllmProber()
        case Backend.SGLANG:
            return SglangProber(settings.sglang_bootstrap_port)
        case Backend.TRTLLM:
            return TrtllmProber()
        case Backend.OPENAI:
            return OpenAIProber()


def plan_transfer_probe(settings: Settings) -> CanaryPlan | None:
    """The kv_transfer endpoint's plan, when SIDECAR_KV_PEER_URL names a prefill peer."""
    if settings.kv_peer_url is None:
        return None
    prober = prober_for(settings)
    why = (
        f"a real KV transfer from the prefill peer {settings.kv_peer_url}, decoded here and "
        "checked against a local prefill, every "
        f"{settings.kv_probe_interval:g} s and when transfers fail"
    )
    role = Role(settings.disaggregation_mode, settings.model_type)
    return CanaryPlan(KV_TRANSFER, True, why, prober, role, PATH, probe=ProbeKind.TRANSFER)


def plan_canary(settings: Settings, endpoint: str = GENERATE) -> CanaryPlan:
    """Decide whether the endpoint gets a canary, why, and with which request."""
    prober = prober_for(settings)
    role = Role(settings.disaggregation_mode, settings.model_type)
    path = settings.canary_path or prober.generation_path
    override = settings.health_check_payload

    kind = ProbeKind.DYNAMO if settings.transport is Transport.DYNAMO else ProbeKind.HTTP

    def plan(enabled: bool, why: str) -> CanaryPlan:
        return CanaryPlan(endpoint, enabled, why, prober, role, path, override, probe=kind)

    if not settings.health_check_enabled:
        return plan(
            False,
            "canaries are off (DYN_HEALTH_CHECK_ENABLED=false); readiness follows registration",
        )
    if override is not None:
        return plan(True, "DYN_HEALTH_CHECK_PAYLOAD replaces the built-in body")
    skip = prober.skip_reason(role)
    if skip is not None:
        return plan(False, skip)
    return plan(True, prober.why(role))
