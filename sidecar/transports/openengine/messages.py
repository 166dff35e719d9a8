"""The OpenEngine messages the canary and its checks use, declared with the field numbers of the
schema TensorRT-LLM serves: ai-dynamo/openengine v0.1.0 (Buf Schema Registry commit
``768a93c7b44e40f28c692ad0b471a8f2``, schema revision 1; TensorRT-LLM's
``tensorrt_llm/grpc/openengine/proto/openengine/v1/``). No Python bindings are published (the
repository's ``openengine-proto`` package is unreleased), so the sidecar declares the subset it
sends and reads (``sidecar/runtime/protodecl.py``); tests/test_openengine.py checks every number
against ../shared/reference/openengine.md and names where that page describes another revision.

Where the revisions differ, v0.1.0 is what is declared:

- two services, ``openengine.v1.Inference`` (``Generate``) and ``openengine.v1.Control``
  (``Health``, ``GetLoad``, ``Abort``, ``GetServerInfo``, ``GetModelInfo``); the newer
  repository's single ``OpenEngine`` service, with ``GetEngineInfo`` and ``Drain``, is not what
  TensorRT-LLM serves;
- ``HealthState`` has no DRAINING: NOT_READY is 4 (in the newer schema 4 is DRAINING and
  NOT_READY 5, so the names are declared, and judged, as v0.1.0 numbers them);
- ``ErrorCode`` has no DRAINING: INTERNAL is 11 (12 in the newer schema).
"""

from __future__ import annotations

from google.protobuf import struct_pb2  # noqa: F401  (registers google/protobuf/struct.proto)

from sidecar.runtime.protodecl import (
    BOOL,
    DOUBLE,
    ENUM,
    INT32,
    MESSAGE,
    OPTIONAL,
    REPEATED,
    STRING,
    UINT32,
    UINT64,
    Declared,
)

PACKAGE = "openengine.v1"
INFERENCE = f"{PACKAGE}.Inference"
CONTROL = f"{PACKAGE}.Control"
#: The schema these numbers are read from.
REVISION = "openengine v0.1.0 (BSR 768a93c7b44e40f28c692ad0b471a8f2, schema revision 1)"

DECLARED = Declared(
    file="health_sidecar/openengine_v1_subset.proto",
    package=PACKAGE,
    dependencies=("google/protobuf/struct.proto",),
    enums={
        "FinishReason": (
            ("FINISH_REASON_UNSPECIFIED", 0),
            ("FINISH_REASON_STOP", 1),
            ("FINISH_REASON_LENGTH", 2),
            ("FINISH_REASON_CANCELLED", 3),
        ),
        "ErrorCode": (
            ("ERROR_CODE_UNSPECIFIED", 0),
            ("ERROR_CODE_INVALID_ARGUMENT", 1),
            ("ERROR_CODE_UNSUPPORTED_FEATURE", 2),
            ("ERROR_CODE_ROLE_MISMATCH", 3),
            ("ERROR_CODE_MODEL_NOT_FOUND", 4),
            ("ERROR_CODE_OVERLOADED", 5),
            ("ERROR_CODE_REQUEST_NOT_FOUND", 6),
            ("ERROR_CODE_DUPLICATE_REQUEST", 7),
            ("ERROR_CODE_KV_SESSION_NOT_FOUND", 8),
            ("ERROR_CODE_KV_TRANSFER_FAILED", 9),
            ("ERROR_CODE_CANCELLED", 10),
            ("ERROR_CODE_INTERNAL", 11),
        ),
        "HealthState": (
            ("HEALTH_STATE_UNSPECIFIED", 0),
            ("HEALTH_STATE_STARTING", 1),
            ("HEALTH_STATE_READY", 2),
            ("HEALTH_STATE_DEGRADED", 3),
            ("HEALTH_STATE_NOT_READY", 4),
        ),
        "EngineRole": (
            ("ENGINE_ROLE_UNSPECIFIED", 0),
            ("ENGINE_ROLE_AGGREGATED", 1),
            ("ENGINE_ROLE_PREFILL", 2),
            ("ENGINE_ROLE_DECODE", 3),
        ),
        "AbortStatus": (
            ("ABORT_STATUS_UNSPECIFIED", 0),
            ("ABORT_STATUS_ABORTED", 1),
            ("ABORT_STATUS_ALREADY_FINISHED", 2),
        ),
    },
    messages={
        "TokenIds": (("ids", 1, REPEATED, UINT32, None),),
        "SamplingParams": (
            ("temperature", 1, OPTIONAL, DOUBLE, None),
            ("top_p", 2, OPTIONAL, DOUBLE, None),
            ("top_k", 3, OPTIONAL, INT32, None),
            ("seed", 8, OPTIONAL, UINT64, None),
        ),
        "StoppingOptions": (
            ("max_tokens", 1, OPTIONAL, UINT32, None),
            ("min_tokens", 2, OPTIONAL, UINT32, None),
            ("ignore_eos", 4, OPTIONAL, BOOL, None),
        ),
        "KvSessionRef": (("session_id", 1, OPTIONAL, STRING, None),),
        "GenerateRequest": (
            ("request_id", 1, OPTIONAL, STRING, None),
            ("model", 2, OPTIONAL, STRING, None),
            ("prompt", 3, OPTIONAL, STRING, None),
            ("token_ids", 4, OPTIONAL, MESSAGE, "TokenIds"),
            ("sampling", 5, OPTIONAL, MESSAGE, "SamplingParams"),
            ("stopping", 6, OPTIONAL, MESSAGE, "StoppingOptions"),
            ("extra", 12, OPTIONAL, MESSAGE, ".google.protobuf.Struct"),
        ),
        "TokenInfo": (
            ("token_id", 1, OPTIONAL, UINT32, None),
            ("token", 2, OPTIONAL, STRING, None),
        ),
        "TokenOutput": (
            ("output_index", 1, OPTIONAL, UINT32, None),
            ("tokens", 2, REPEATED, MESSAGE, "TokenInfo"),
            ("text", 3, OPTIONAL, STRING, None),
        ),
        "PrefillReady": (("kv_session", 1, OPTIONAL, MESSAGE, "KvSessionRef"),),
        "GenerationFinished": (
            ("output_index", 1, OPTIONAL, UINT32, None),
            ("reason", 2, OPTIONAL, ENUM, "FinishReason"),
            ("message", 3, OPTIONAL, STRING, None),
        ),
        "EngineError": (
            ("code", 1, OPTIONAL, ENUM, "ErrorCode"),
            ("message", 2, OPTIONAL, STRING, None),
            ("retryable", 3, OPTIONAL, BOOL, None),
        ),
        "Usage": (
            ("prompt_tokens", 1, OPTIONAL, UINT32, None),
            ("completion_tokens", 2, OPTIONAL, UINT32, None),
            ("total_tokens", 3, OPTIONAL, UINT32, None),
        ),
        "GenerateResponse": (
            ("request_id", 1, OPTIONAL, STRING, None),
            ("token", 3, OPTIONAL, MESSAGE, "TokenOutput"),
            ("prefill_ready", 4, OPTIONAL, MESSAGE, "PrefillReady"),
            ("finished", 5, OPTIONAL, MESSAGE, "GenerationFinished"),
            ("error", 6, OPTIONAL, MESSAGE, "EngineError"),
            ("usage", 10, OPTIONAL, MESSAGE, "Usage"),
        ),
        "HealthRequest": (
            ("include_inference_probe", 1, OPTIONAL, BOOL, None),
            ("model", 2, OPTIONAL, STRING, None),
            ("role", 3, OPTIONAL, ENUM, "EngineRole"),
        ),
        "HealthCheck": (
            ("name", 1, OPTIONAL, STRING, None),
            ("state", 2, OPTIONAL, ENUM, "HealthState"),
            ("message", 3, OPTIONAL, STRING, None),
        ),
        "HealthResponse": (
            ("state", 1, OPTIONAL, ENUM, "HealthState"),
            ("checks", 2, REPEATED, MESSAGE, "HealthCheck"),
        ),
        "AbortRequest": (("request_id", 1, OPTIONAL, STRING, None),),
        "AbortResponse": (
            ("status", 1, OPTIONAL, ENUM, "AbortStatus"),
            ("message", 2, OPTIONAL, STRING, None),
        ),
        "GetLoadRequest": (("include_per_rank", 1, OPTIONAL, BOOL, None),),
        "LoadInfo": (
            ("instance_id", 1, OPTIONAL, STRING, None),
            ("timestamp_unix_nanos", 2, OPTIONAL, UINT64, None),
            ("running_requests", 3, OPTIONAL, UINT32, None),
            ("queued_requests", 4, OPTIONAL, UINT32, None),
        ),
        "GetModelInfoRequest": (("model", 1, OPTIONAL, STRING, None),),
        "ModelInfo": (
            ("model_id", 1, OPTIONAL, STRING, None),
            ("served_model_name", 2, OPTIONAL, STRING, None),
        ),
        "GetServerInfoRequest": (),
        "ServerInfo": (
            ("engine_name", 1, OPTIONAL, STRING, None),
            ("engine_version", 2, OPTIONAL, STRING, None),
            ("engine_role", 3, OPTIONAL, ENUM, "EngineRole"),
        ),
    },
    oneofs={
        "GenerateRequest": {"input": ("prompt", "token_ids")},
        "GenerateResponse": {"event": ("token", "prefill_ready", "finished", "error")},
        "AbortRequest": {"target": ("request_id",)},
    },
    services={
        "Inference": {"Generate": ("GenerateRequest", "GenerateResponse", True)},
        "Control": {
            "Health": ("HealthRequest", "HealthResponse", False),
            "GetLoad": ("GetLoadRequest", "LoadInfo", False),
            "Abort": ("AbortRequest", "AbortResponse", False),
            "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
            "GetServerInfo": ("GetServerInfoRequest", "ServerInfo", False),
        },
    },
)

DECLARED.register()
