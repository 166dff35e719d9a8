"""TensorRT-LLM's gRPC service (``trtllm.TrtllmService``, as TensorRT-LLM's own servicer serves
it for SGLang Model Gateway): ``Generate`` with tokenized input; prefill and decode carry
``disaggregated_params`` ``REQUEST_TYPE_CONTEXT_AND_GENERATION``, DIS-1737's rule over HTTP: a
decode worker refuses a request without them ("Disaggregated params are required for decode
mode"), and with them runs it whole, locally.

No TensorRT-LLM runs on this CPU: built from the proto (smg-grpc-proto 0.4.28) and tested on the
fake engine that serves it. Its registration is ``GetModelInfo`` (its server's grpc.health.v1
is not known).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import PROMPT_TOKEN_IDS, Prober, Role
from sidecar.probes.grpc.base import GrpcProber
from sidecar.probes.role import Backend, Mode
from sidecar.probes.trtllm import TrtllmProber

#: DisaggregatedParams.request_type that runs a request whole on one worker.
CONTEXT_AND_GENERATION = "REQUEST_TYPE_CONTEXT_AND_GENERATION"


class GrpcTrtllmProber(GrpcProber):
    backend: ClassVar[Backend] = Backend.TRTLLM
    grpc_module: ClassVar[str] = "smg_grpc_proto.trtllm_service_pb2"
    service: ClassVar[str] = "trtllm.TrtllmService"
    ids_field: ClassVar[str] = "output_token_ids"
    http: ClassVar[type[Prober]] = TrtllmProber

    def why(self, role: Role) -> str:
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            return (
                f"{role.mode} worker: disaggregated_params request_type "
                f"{CONTEXT_AND_GENERATION} runs it whole, locally (without them decode refuses "
                "it: DIS-1737)"
            )
        return "plain greedy generation"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 2
        body: dict[str, Any] = {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_token_ids": list(PROMPT_TOKEN_IDS)},
            "sampling_config": {"temperature": 0},
            "max_tokens": tokens,
            "ignore_eos": True,
            "streaming": False,
        }
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            body["disaggregated_params"] = {"request_type": CONTEXT_AND_GENERATION}
        return body, tokens
