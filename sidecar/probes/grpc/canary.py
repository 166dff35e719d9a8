"""The canary over the engine's gRPC generation service: the common probe
(:mod:`sidecar.probes.canary`: send, judge, stop) through the gRPC channel
(:mod:`sidecar.runtime.grpcengine`), whose deadline ends the call on the server; on a timeout the
probe also sends the engine's ``Abort`` with the canary's request id (``Prober.abort``), as SGLang
Model Gateway does when its client drops a stream.
"""

from __future__ import annotations

from sidecar.probes.canary import Canary


class GrpcCanary(Canary):
    holds_on = "call"
