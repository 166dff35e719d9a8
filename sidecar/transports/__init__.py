"""The transports: how a canary reaches the engine. Each is a package of its own
(``seam.py`` says what a transport provides), listed once here; SIDECAR_TRANSPORT names one.
A new transport is a new package and one line below.
"""

from __future__ import annotations

from sidecar.transports import dynamo, grpc, http, openengine
from sidecar.transports.seam import Transport

#: Every transport by its SIDECAR_TRANSPORT name.
TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        http.TRANSPORT,
        dynamo.TRANSPORT,
        grpc.TRANSPORT,
        openengine.TRANSPORT,
    )
}

__all__ = ["TRANSPORTS", "Transport"]
