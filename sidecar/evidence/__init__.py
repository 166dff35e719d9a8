"""The evidence model: three sources, each a small immutable state and the pure function that
updates it.

- :mod:`.registration`: the engine's own health route (up, loading, gone, frozen).
- :mod:`.canary`: a role-aware inference request (the only source that decides readiness).
- :mod:`.progress`: the engine's Prometheus metrics (hints: when to probe, whether a timeout was
  load, whether work is stuck).

Every source consumes a :class:`~sidecar.evidence.result.Result` or a metrics sample and owns its
own fields; :mod:`sidecar.verdict` reads all three and decides, as one table.
"""
