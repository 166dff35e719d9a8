"""SIDECAR_REGISTRATION's target, parsed: where the engine's gRPC health service listens. Apart
from :mod:`sidecar.runtime.grpcregistration` so that reading the configuration never loads
grpcio."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """None for an IP address or an RFC 1123 host name, else what is wrong."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return "not an IP address or host name"
    return None


@dataclass(frozen=True)
class GrpcTarget:
    """SIDECAR_REGISTRATION parsed: where the engine's gRPC health service listens, and which
    service's status the registration check asks for ("" is the server as a whole)."""

    host: str
    port: int
    service: str

    @property
    def address(self) -> str:
        """host:port as grpc's channel takes it (an IPv6 address in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def grpc_target(value: str) -> GrpcTarget:
    """Parse ``grpc://HOST:PORT[/SERVICE]``; raise ValueError naming what is wrong."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError("not a URL") from None
    if parts.scheme != "grpc" or not parts.hostname:
        raise ValueError("not a grpc:// URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("has a query, fragment or credentials")
    if "\\" in value or host_problem(parts.hostname):
        raise ValueError("the host is not an IP address or host name")
    if port is None or port == 0:
        raise ValueError("no port (the engine's gRPC server has no default)")
    service = parts.path.removeprefix("/")
    if not re.fullmatch(r"[A-Za-z0-9_.-]*", service):
        raise ValueError("the service is not a gRPC service name (letters, digits, _ . -)")
    return GrpcTarget(parts.hostname, port, service)
