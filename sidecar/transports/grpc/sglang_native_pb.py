"""SGLang's native gRPC service (``--grpc-port``, ``sglang.runtime.v1.SglangService``): the
messages its canary uses, registered in protobuf's default descriptor pool when imported.

SGLang publishes no Python stubs of this service (its server is Rust, in the wheel's
``rust_extensions/_grpc``), and the field numbers moved between releases: in 0.5.23, the
release tested here, ``disaggregated_params`` is field 13, in the newest proto 12 (where 13 is
another field). So the sidecar declares the subset it sends and reads, with 0.5.23's numbers,
read off the running server (each number named by the server's own decoder). A subset is
wire-compatible: a parser skips fields it does not know, and a request sets only these.

The file is proto2 so that every scalar keeps explicit presence: ``temperature`` 0 (greedy) goes
on the wire rather than being dropped as a default. The wire encoding is the same either way.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool

PACKAGE = "sglang.runtime.v1"
SERVICE = f"{PACKAGE}.SglangService"
FILE = "health_sidecar/sglang_runtime_v1_subset.proto"

_F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
STRING, BOOL, FLOAT, UINT32, UINT64 = (
    _F.TYPE_STRING,
    _F.TYPE_BOOL,
    _F.TYPE_FLOAT,
    _F.TYPE_UINT32,
    _F.TYPE_UINT64,
)
MESSAGE = _F.TYPE_MESSAGE

# message -> its fields: (name, number, label, type, message type for TYPE_MESSAGE); a nested
# message (a map's entry) follows the message it is nested in
MESSAGES: dict[str, tuple[tuple[str, int, int, int, str | None], ...]] = {
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


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name=FILE, package=PACKAGE, syntax="proto2")
    made: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name, fields in MESSAGES.items():
        outer, _, inner = name.partition(".")
        if inner:  # a map entry, nested in its message
            message = made[outer].nested_type.add(name=inner)
            message.options.map_entry = True
        else:
            message = made[name] = proto.message_type.add(name=name)
        for field, number, label, kind, type_name in fields:
            added = message.field.add(name=field, number=number, label=label, type=kind)
            if type_name is not None:
                added.type_name = f".{PACKAGE}.{type_name}"
            if label == REPEATED and kind != MESSAGE:
                added.options.packed = True
    service = proto.service.add(name=SERVICE.rpartition(".")[2])
    for method, (request, response, streams) in METHODS.items():
        service.method.add(
            name=method,
            input_type=f".{PACKAGE}.{request}",
            output_type=f".{PACKAGE}.{response}",
            server_streaming=streams,
        )
    return proto


def _register() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(FILE)
    except KeyError:
        pool.Add(_file())


_register()
