"""SGLang's scheduler service (``sglang.grpc.scheduler.SglangScheduler``: SGLang run with
``--smg-grpc-mode`` on smg-grpc-servicer, gRPC only): ``Generate`` with tokenized input;
prefill and decode carry ``disaggregated_params`` with SGLang's fake-transfer bootstrap host,
as over HTTP (a decode server given none crashes its scheduler; a prefill server waits for a
peer).

SGLang's native service (``--grpc-port``, ``sglang.runtime.v1.SglangService``) publishes no
Python stubs, and its field numbers changed between releases: not built yet.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import PROMPT_TOKEN_IDS, Prober, Role
from sidecar.probes.grpc.base import GrpcProber
from sidecar.probes.role import Backend, Mode
from sidecar.probes.sglang import FAKE_BOOTSTRAP_HOST, SglangProber, bootstrap_room

#: DisaggregatedParams.bootstrap_room is an int32 in this service.
ROOMS = 1 << 31


class GrpcSglangProber(GrpcProber):
    backend: ClassVar[Backend] = Backend.SGLANG
    grpc_module: ClassVar[str] = "smg_grpc_proto.sglang_scheduler_pb2"
    service: ClassVar[str] = "sglang.grpc.scheduler.SglangScheduler"
    health_service: ClassVar[str | None] = ""
    http: ClassVar[type[Prober]] = SglangProber

    def __init__(self, bootstrap_port: int = 8998) -> None:
        self.bootstrap_port = bootstrap_port

    def why(self, role: Role) -> str:
        return SglangProber(self.bootstrap_port).why(role)

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 2
        body: dict[str, Any] = {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_ids": list(PROMPT_TOKEN_IDS)},
            "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            "stream": False,
        }
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            body["disaggregated_params"] = {
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": bootstrap_room(request_id) % ROOMS,
            }
        return body, tokens

    def answer(self, parsed: Any, role: Role) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        return None if role.mode is Mode.DECODE else super().answer(parsed, role)
