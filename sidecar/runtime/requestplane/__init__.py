"""Dynamo's request plane (SIDECAR_TRANSPORT=dynamo): find this pod's worker instance on its
system server (``identity``, ``worker``), and canary it straight over the request plane with
Dynamo's own runtime client (``client``), in an environment of its own (``environment``).

The canary payloads are in ``sidecar/probes/dynamo/``, one module per backend.
"""
