"""A subset of a service's proto, declared from a table of field numbers and registered in
protobuf's default descriptor pool: for services that publish no Python stubs (SGLang's native
gRPC service, OpenEngine). A subset is wire-compatible: a parser skips the fields it does not
know, and a request sets only the declared ones.

The file is proto2 so that every scalar keeps explicit presence (``temperature`` 0, greedy, goes
on the wire rather than being dropped as a default); the wire encoding is the same either way.
Repeated scalars are packed, as proto3 packs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

_F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
STRING, BOOL, FLOAT, DOUBLE = _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_FLOAT, _F.TYPE_DOUBLE
INT32, UINT32, UINT64 = _F.TYPE_INT32, _F.TYPE_UINT32, _F.TYPE_UINT64
MESSAGE, ENUM = _F.TYPE_MESSAGE, _F.TYPE_ENUM

#: One field: (name, number, label, type, the message or enum type's name for MESSAGE and ENUM:
#: a name of this package, or a full name starting with ".", such as ".google.protobuf.Struct").
Field = tuple[str, int, int, int, str | None]


@dataclass(frozen=True)
class Declared:
    """A proto file's subset: its messages (a map's entry, "Message.Entry", after its
    message), enums, the oneofs that group some fields, and its services' methods."""

    file: str
    package: str
    messages: Mapping[str, tuple[Field, ...]]
    services: Mapping[str, Mapping[str, tuple[str, str, bool]]]  # method -> (in, out, streams)
    enums: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    oneofs: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    dependencies: tuple[str, ...] = ()  # files it imports ("google/protobuf/struct.proto")

    def _type(self, name: str) -> str:
        return name if name.startswith(".") else f".{self.package}.{name}"

    def file_proto(self) -> descriptor_pb2.FileDescriptorProto:
        proto = descriptor_pb2.FileDescriptorProto(
            name=self.file, package=self.package, syntax="proto2"
        )
        proto.dependency.extend(self.dependencies)
        for name, values in self.enums.items():
            enum = proto.enum_type.add(name=name)
            for value, number in values:
                enum.value.add(name=value, number=number)
        made: dict[str, descriptor_pb2.DescriptorProto] = {}
        for name, fields in self.messages.items():
            outer, _, inner = name.partition(".")
            if inner:  # a map entry, nested in its message
                message = made[outer].nested_type.add(name=inner)
                message.options.map_entry = True
            else:
                message = made[name] = proto.message_type.add(name=name)
            groups = self.oneofs.get(name, {})
            indices = {group: i for i, group in enumerate(groups)}
            for group in groups:
                message.oneof_decl.add(name=group)
            for field_name, number, label, kind, type_name in fields:
                added = message.field.add(name=field_name, number=number, label=label, type=kind)
                if type_name is not None:
                    added.type_name = self._type(type_name)
                if label == REPEATED and kind not in (MESSAGE, STRING):
                    added.options.packed = True
                for group, members in groups.items():
                    if field_name in members:
                        added.oneof_index = indices[group]
        for service_name, methods in self.services.items():
            service = proto.service.add(name=service_name)
            for method, (request, response, streams) in methods.items():
                service.method.add(
                    name=method,
                    input_type=self._type(request),
                    output_type=self._type(response),
                    server_streaming=streams,
                )
        return proto

    def register(self, pool: descriptor_pool.DescriptorPool | None = None) -> None:
        """Add the file to ``pool`` (the default one), once; its dependencies must be in the
        default pool (import their generated modules first), from which they are copied into
        a pool of its own."""
        pool = pool or descriptor_pool.Default()
        try:
            pool.FindFileByName(self.file)
        except KeyError:
            for name in self.dependencies:  # from the default pool, into a pool of its own
                _copy(name, pool)
            pool.Add(self.file_proto())

    def message(
        self, name: str, pool: descriptor_pool.DescriptorPool | None = None
    ) -> type[Message]:
        """The class of a declared message (registered in ``pool`` first)."""
        pool = pool or descriptor_pool.Default()
        self.register(pool)
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{self.package}.{name}"))

    def number(self, message: str, field_name: str) -> int:
        """A declared field's number (for the drift test against the reference)."""
        return next(n for name, n, *_ in self.messages[message] if name == field_name)


def _copy(file: str, pool: descriptor_pool.DescriptorPool) -> None:
    """A file the default pool holds (a generated module's), added to ``pool`` if missing."""
    try:
        pool.FindFileByName(file)
    except KeyError:
        proto = descriptor_pb2.FileDescriptorProto()
        descriptor_pool.Default().FindFileByName(file).CopyToProto(proto)
        pool.Add(proto)
