"""The evidence model: one source per kind of evidence, each a small immutable state and the
pure function that updates it.

- :mod:`.registration`: the engine's own health route (up, loading, gone, frozen).
- :mod:`.canary`: a role-aware inference request (the only source that decides readiness).
- :mod:`.progress`: the engine's Prometheus metrics (hints: when to probe, whether a timeout was
  load, whether work is stuck).
- :mod:`.transfers`: the engine's failed-KV-transfer counters (a note, never a verdict).
- :mod:`.lifecycle`: paused on purpose (asleep, in maintenance): notready and live, no canary.
- :mod:`.discovery`: a Dynamo worker's instance listed by discovery (the orphan).
- :mod:`.enginehealth`: a Dynamo worker's own /health, shown beside the verdict.
- :mod:`.faults`: what vLLM's fault tolerance reports per rank (unhealthy, dead: notready and a
  liveness clock; recovering, paused: notready and live, no canary).

Every source consumes a :class:`~sidecar.core.evidence.result.Result` or a sample and owns its own
fields; :mod:`sidecar.core.verdict` reads them all and decides, as one table.
"""
