"""The gRPC health service: ``grpc.health.v1.Health`` (Check and Watch) on SIDECAR_GRPC_PORT.

The kubelet's ``grpc:`` probes and any ``grpc.health.v1`` client read the same verdicts as the
HTTP routes, by service name:

- ``""`` and ``readiness``: SERVING iff ``/health`` is 200 (:func:`readiness_of`);
- ``liveness``: SERVING iff ``/live`` is 200 (:func:`liveness_of`);
- each endpoint's name (``generate``, ``kv_transfer``): SERVING iff ``/health``'s ``endpoints``
  says it is ready;
- any other name: NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch), as the library answers.

The library's own servicer (grpcio-health-checking) holds the statuses and streams them. They are
set, never polled by a client: :class:`GrpcHealth` subscribes to Health's events (called on the
monitor's thread after each new snapshot is published, the heartbeat's included, so a liveness
clock that runs out by time alone is seen within a tick) and sets the services whose status
changed. A Check also brings the statuses up to its own moment first, as a ``/health`` answer
reads the snapshot at its own moment, and the server itself does so every :data:`TICK`: a monitor
that stopped running, which publishes nothing, turns readiness NOT_SERVING on every Watch stream
as it turns ``/health`` 503.

Nothing slow runs on the monitor's thread: ``set`` only takes the servicer's lock and hands the
new status to each Watch stream, whose own thread sends it (each stream keeps only the latest,
so a client that reads slowly misses intermediate statuses, never the last one). Watch streams
have threads of their own (at most :data:`WATCH_THREADS` at once; another waits for a free one),
so they never take the threads Checks are answered on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import OVERALL_HEALTH, HealthServicer

from sidecar.core.events import Event
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of
from sidecar.core.verdict import StartingStatus
from sidecar.surface.grpcnames import LIVENESS, READINESS
from sidecar.surface.view import HealthView

log = logging.getLogger("sidecar.grpc")

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING: Status = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Status = health_pb2.HealthCheckResponse.NOT_SERVING
OVERALL = OVERALL_HEALTH

CHECK_THREADS = 4  # Checks are answered from memory
WATCH_THREADS = 16  # Watch streams served at once
MAX_CALLS = 64  # calls at once (Watch streams included); more are refused with RESOURCE_EXHAUSTED
GRACE = 1.0  # seconds calls in flight get to finish on shutdown; Watch streams are then ended
# Seconds between the server's own refreshes: what time alone changes reaches Watch streams even
# when the monitor publishes nothing (a monitor fallen silent: readiness NOT_SERVING, as /health).
TICK = 0.5
# No SO_REUSEPORT (gRPC's default): a port another process holds fails the bind, loudly.
OPTIONS = (("grpc.so_reuseport", 0),)


def statuses(snap: Snapshot, now: float) -> dict[str, Status]:
    """Every service's status, from one snapshot, as the HTTP routes would answer at ``now``."""
    ready = SERVING if readiness_of(snap, now).ready else NOT_SERVING
    live = SERVING if liveness_of(snap, now).live else NOT_SERVING
    out = {OVERALL: ready, READINESS: ready, LIVENESS: live}
    for name, verdict in snap.endpoint_verdicts.items():
        # As /health's "endpoints": before its first verdict, the starting status.
        ok = verdict.ready if verdict.ready is not None else snap.starting is StartingStatus.READY
        out[name] = SERVING if ok else NOT_SERVING
    return out


def address(host: str, port: int) -> str:
    """``host:port`` as gRPC binds it (an IPv6 address in brackets)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host}:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class _Servicer(HealthServicer):
    """The library's servicer, with Watch streams on threads of their own; a call first brings
    the statuses up to its moment."""

    def __init__(self, refresh: Callable[[], None], watchers: futures.ThreadPoolExecutor) -> None:
        # Blocking Watch: ``set`` hands each stream its latest status and returns; the stream's
        # thread (from ``watchers``) does the sending.
        super().__init__(experimental_non_blocking=False, experimental_thread_pool=watchers)
        self._refresh = refresh

    def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        self._refresh()
        return super().Check(request, context)

    def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: Any,
        send_response_callback: Callable[[Any], None] | None = None,
    ) -> Any:
        self._refresh()
        return super().Watch(request, context, send_response_callback)


class GrpcHealth:
    """The gRPC health server. ``Sidecar`` runs it as it runs uvicorn's: ``serve`` until
    ``should_exit`` is set; ``started`` once it listens."""

    def __init__(self, health: HealthView, host: str, port: int, grace: float = GRACE) -> None:
        self.health = health
        self.address = address(host, port)
        self.grace = grace
        self.started = False
        self._exit = asyncio.Event()
        self._lock = threading.Lock()  # one refresh at a time, each from the newest snapshot
        self._said: dict[str, Status] = {}
        self._watchers = futures.ThreadPoolExecutor(WATCH_THREADS, thread_name_prefix="grpc-watch")
        self.servicer = _Servicer(self.refresh, self._watchers)
        self.refresh()

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set on the serving event loop (as ``Sidecar.stop_servers`` does)."""
        if value:
            self._exit.set()

    def on_event(self, _event: Event) -> None:
        """Health's subscriber (the monitor's thread): every event follows a new snapshot. Subscribe
        it at once, so that no change is missed between now and ``serve``."""
        self.refresh()

    def refresh(self) -> None:
        """Set the services whose status changed since they were last set."""
        with self._lock:
            fresh = statuses(self.health.snapshot, self.health.clock())
            changed = {name: s for name, s in fresh.items() if self._said.get(name) != s}
            self._said.update(changed)
            for name, status in changed.items():
                self.servicer.set(name, status)

    async def serve(self) -> None:
        """Listen until ``should_exit``; then NOT_SERVING for every service, the calls in flight
        get ``grace`` seconds, and the server stops. A port that cannot be bound is logged as
        critical and returns at once (``started`` stays False)."""
        server = grpc.server(
            futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="grpc"),
            options=OPTIONS,
            maximum_concurrent_rpcs=MAX_CALLS,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        try:
            server.add_insecure_port(self.address)
        except RuntimeError:
            log.critical(
                "the gRPC health service could not bind %s (SIDECAR_GRPC_PORT)", self.address
            )
            self._watchers.shutdown(wait=False)
            return
        server.start()
        self.started = True
        log.info(
            "gRPC health service on %s: grpc.health.v1.Health, services '' and %s (/health), "
            "%s (/live), %s",
            self.address,
            READINESS,
            LIVENESS,
            ", ".join(sorted(self.health.snapshot.endpoint_verdicts)),
        )
        try:
            while not self._exit.is_set():
                self.refresh()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK):
                        await self._exit.wait()
        finally:
            self.servicer.enter_graceful_shutdown()
            stopped = server.stop(self.grace)
            await asyncio.to_thread(stopped.wait, self.grace + 1.0)
            self._watchers.shutdown(wait=False)
