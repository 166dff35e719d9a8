"""The canary over Dynamo's request plane: the common probe (:mod:`sidecar.probes.canary`: send,
judge, stop) sending the payload the backend's Dynamo prober built
(``sidecar/probes/dynamo/<backend>.py``) straight to this pod's worker instance. The channel
stops the canary on the worker (``stop_generating``) the moment its deadline passes, as the HTTP
client closes a timed-out canary's connection: a Dynamo canary's stop is its context, which only
the channel holds.

Where stopping the context does not stop the work (Dynamo's encode worker never reads its
context: ``Prober.keeps_abandoned``), the probe keeps the timed-out canary's stream open instead,
sends no other while it runs, and removes the file its answer names once it comes.
"""

from __future__ import annotations

from sidecar.probes.canary import Canary


class DynamoCanary(Canary):
    holds_on = "stream"
