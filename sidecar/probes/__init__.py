"""The probes, whatever the transport: a canary's request and plan (``base.py``, ``plan.py``),
what a channel hands back (``exchange.py``), the one judgement of it (``judge.py``), the common
canary probe that sends, judges and stops (``canary.py``), the KV transfer probe
(``transfer.py``), and which plan each unit follows (``units.py``).

Where is a decode canary built? In its transport's package, by backend:
``sidecar/transports/<transport>/<backend>.py``, method ``body``; what the role needs is its
engine's rule, once for every transport: ``sidecar/engines/<backend>.py``, ``role_canary``.
"""
