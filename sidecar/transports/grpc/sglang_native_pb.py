"""SGLang's native gRPC service (``--grpc-port``, ``sglang.runtime.v1.SglangService``): the
messages its canary uses, registered in protobuf's default descriptor pool when imported.

SGLang publishes no Python stubs of this service (its server is Rust, in the wheel's
``rust_extensions/_grpc``), and the field numbers moved between releases: in 0.5.23, the
release tested here, ``disaggregated_params`` is field 13, in the newest proto 12 (where 13 is
another field). So the sidecar declares the subset it sends and reads, with 0.5.23's numbers,
read off the running server (each number named by the server's own decoder). A subset is
wire-compatible: a parser skips fields it does not know, and a request sets only these.

Declared, and registered on import, with ``sidecar/runtime/protodecl.py`` (proto2, so that
``temperature`` 0, greedy, goes on the wire).
"""

from __future__ import annotations

from sidecar.runtime.protodecl import (
    BOOL,
    FLOAT,
    MESSAGE,
    OPTIONAL,
    REPEATED,
    STRING,
    UINT32,
    UINT64,
    Declared,
    Field,
)

PACKAGE = "sglang.runtime.v1"
SERVICE = f"{PACKAGE}.SglangService"
FILE = "health_sidecar/sglang_runtime_v1_subset.proto"

# message -> its fields: (name, number, label, type, message type for TYPE_MESSAGE); a nested
# message (a map's entry) follows the message it is nested in
MESSAGES: dict[str, tuple[Field, ...]] = {
    "SamplingParams": (
        ("temperature", 1, OPTIONAL, FLOAT, None),
        ("max_new_tokens", 8, OPTIONAL, UINT32, None),
        ("ignore_eos", 12, OPTIONAL, BOOL, None),
    ),
    "DisaggregatedParams": (
        ("bootstrap_host", 1, OPTIONAL, STRING, None),
        ("bootstrap_port", 2, OPTIONAL, UINT32, None),
        ("bootstrap_room", 3, OPTIONAL, UINT64, None),
    ),
    "GenerateRequest": (
        ("input_ids", 1, REPEATED, UINT32, None),
        ("sampling_params", 2, OPTIONAL, MESSAGE, "SamplingParams"),
        ("stream", 3, OPTIONAL, BOOL, None),
        ("rid", 7, OPTIONAL, STRING, None),
        ("disaggregated_params", 13, OPTIONAL, MESSAGE, "DisaggregatedParams"),
    ),
    "GenerateResponse": (
        ("output_ids", 1, REPEATED, UINT32, None),
        ("meta_info", 2, REPEATED, MESSAGE, "GenerateResponse.MetaInfoEntry"),
        ("finished", 3, OPTIONAL, BOOL, None),
    ),
    "GenerateResponse.MetaInfoEntry": (  # map<string, string>
        ("key", 1, OPTIONAL, STRING, None),
        ("value", 2, OPTIONAL, STRING, None),
    ),
    "AbortRequest": (
        ("rid", 1, OPTIONAL, STRING, None),
        ("abort_all", 2, OPTIONAL, BOOL, None),
    ),
    "AbortResponse": (("success", 1, OPTIONAL, BOOL, None),),
    "HealthCheckRequest": (),
    "HealthCheckResponse": (("healthy", 1, OPTIONAL, BOOL, None),),
    "GetModelInfoRequest": (),
    "GetModelInfoResponse": (
        ("model_path", 1, OPTIONAL, STRING, None),
        ("json_info", 2, OPTIONAL, STRING, None),
    ),
}
# method -> (request, response, the server streams)
METHODS = {
    "Generate": ("GenerateRequest", "GenerateResponse", True),
    "Abort": ("AbortRequest", "AbortResponse", False),
    "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse", False),
    "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
}

DECLARED = Declared(
    file=FILE,
    package=PACKAGE,
    messages=MESSAGES,
    services={SERVICE.rpartition(".")[2]: METHODS},
)
DECLARED.register()
