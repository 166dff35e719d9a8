"""Dynamo's request plane, from the sidecar: canaries straight to this pod's worker instance.

The client is Dynamo's own (ai-dynamo-runtime: ``DistributedRuntime``, an endpoint's ``client``,
``direct(payload, instance_id, context=...)``), a long-lived runtime on the monitor's event loop.
It never goes through a frontend or a router: ``direct`` names the instance.

- Discovery: with etcd or the file backend the client shares the worker's discovery (the same
  variables), which is also how the sidecar sees an orphaned worker (alive, gone from
  discovery). Under Kubernetes the client reads a private file-discovery directory holding only
  the record this pod's worker advertises on its own /metadata, kept fresh by the sidecar: it
  reaches the worker whether or not the cluster lists it (a pod that is not Ready is not listed,
  and a canary that depended on the cluster would never see its worker recover), and it needs no
  rights on the cluster.
- The deadline covers the whole stream, from ``direct`` to the last chunk (the client has no
  stream timeout of its own). On timeout, or when the sidecar stops, the canary is stopped on the
  worker (``Context.stop_generating()``, which reaches it within milliseconds): timed-out canaries
  never pile up there. The monitor sends one canary at a time.
- Nothing here raises to the caller, or judges: what came back (the chunks, the error event, or
  why nothing came) goes to the probe (the common canary probe, ``sidecar/probes/canary.py``),
  which judges it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.config import DiscoveryBackend
from sidecar.core.evidence.result import Outcome
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import NoAnswer, Received, Streamed
from sidecar.transports.dynamo.identity import Instance
from sidecar.transports.dynamo.settings import PlaneConfig

# More chunks than a canary of a few tokens can need: a worker streaming on and on is broken.
MAX_CHUNKS = 256

INSTANCES = "v1/instances"  # file discovery's bucket of endpoint records
ERROR_TEXT_CHARS = 200


def _text(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:ERROR_TEXT_CHARS] + ("..." if len(text) > ERROR_TEXT_CHARS else "")


def classify(exc: BaseException) -> tuple[Outcome, str, bool]:
    """(outcome, reason, the worker itself refused) for an exception of the runtime client, as
    ai-dynamo-runtime 1.6.1 raises them:

    - ``InvalidRequest: <type>: <message>`` and ``Internal: <type>: <message>`` (both raised as
      ValueError: the handler raised a ValueError, or anything else): the worker's handler
      refused the request (TensorRT-LLM decode's "Disaggregated params are required for decode
      mode", SGLang decode's "bootstrap_info is required ...");
    - ``Unavailable: instance_id=... not found for endpoint ...``: not in the client's discovery;
    - ``CannotConnect`` / "TCP connection to ... failed": nothing listens (a killed worker);
    - ``DeadlineExceeded`` / ``ConnectionTimeout``: the runtime's own request timeout;
    - ``Disconnected``, ``StreamIncomplete``, ``EngineShutdown`` and any other ``Unavailable``
      ("Worker disconnected before response stream was established"): the exchange broke;
    - anything else: counted as the worker's refusal (a failure that fails liveness only once
      the canary passed in this incarnation: an unknown error from the start is no crash loop)."""
    text = _text(exc)
    kind = type(exc).__name__
    lowered = text.lower()
    if text.startswith(("InvalidRequest: ", "Internal: ")):
        said = text.removeprefix("InvalidRequest: ").removeprefix("Internal: ")
        return Outcome.ERROR, f"worker error: {said}", True
    if text.startswith("Unavailable:") and "not found" in lowered:
        return Outcome.REFUSED, f"not in discovery: {text}", False
    if kind == "CannotConnect" or ("connection" in lowered and "failed" in lowered):
        return Outcome.REFUSED, f"cannot connect: {text}", False
    if kind == "ConnectionTimeout" or text.startswith("DeadlineExceeded"):
        return Outcome.TIMEOUT, f"the runtime's request timeout: {text}", False
    if kind in ("Disconnected", "StreamIncomplete", "EngineShutdown") or text.startswith(
        "Unavailable:"
    ):
        return Outcome.ERROR, f"the stream broke: {text}", False
    return Outcome.ERROR, f"worker error: {text}", True


def url_safe(key: str) -> str:
    """A discovery key as Dynamo's file store names its file: every byte that is not a letter or
    a digit percent-encoded."""
    return "".join(c if c.isascii() and c.isalnum() else f"%{ord(c):02X}" for c in key)


class RequestPlane:
    """The sidecar's Dynamo runtime client (I/O). Create it on the loop it will run on."""

    def __init__(
        self,
        config: PlaneConfig,
        *,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        private_dir: str | None = None,
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.clock = clock
        self.local = config.discovery is DiscoveryBackend.KUBERNETES
        # Kubernetes: the private file-discovery directory (created by the caller, who sets the
        # runtime's DYN_FILE_KV to it before the runtime starts).
        self.private_dir = Path(private_dir) if private_dir else None
        self._runtime: Any = None
        self._clients: dict[str, Any] = {}
        self._advertised: Path | None = None

    @property
    def where(self) -> str:
        """The discovery the client reads, for reasons."""
        backend = self.config.discovery
        if backend is DiscoveryBackend.FILE:
            return f"file discovery ({self.config.file_kv})"
        if self.local:
            return "the sidecar's own copy of the worker's /metadata record"
        return str(backend)

    def start(self) -> None:
        """Create the runtime (the environment is already the client's: environment.apply)."""
        from dynamo.runtime import DistributedRuntime

        backend = "file" if self.local else self.config.discovery.value
        self._runtime = DistributedRuntime(
            asyncio.get_running_loop(), backend, self.config.plane.value
        )

    async def aclose(self) -> None:
        if self._runtime is not None:
            self._runtime.shutdown()
            self._runtime = None
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    async def _client(self, path: str) -> Any:
        client = self._clients.get(path)
        if client is None:
            client = await self._runtime.endpoint(path).client()
            # Its discovery watch starts empty: let it load what is listed before the first look
            # (an endpoint with no instance at all waits out the timeout, once).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout):
                    await client.wait_for_instances()
            self._clients[path] = client
        return client

    async def listed(self, instance: Instance) -> bool:
        """Does the client's discovery list the instance now?"""
        async with asyncio.timeout(self.timeout):
            client = await self._client(instance.path)
        return instance.instance_id in client.instance_ids()

    async def advertise(self, instance: Instance) -> bool:
        """Kubernetes: keep the worker's own record in the private directory (written once,
        touched at every check, since file discovery expires records untouched for 10 s), and
        wait up to the timeout for the client to list it. Returns whether it is listed."""
        assert self.private_dir is not None
        assert instance.record is not None
        key = f"{instance.namespace}/{instance.component}/{instance.endpoint}/{instance.hex}"
        bucket = self.private_dir / INSTANCES
        target = bucket / url_safe(key)
        if target != self._advertised:
            bucket.mkdir(parents=True, exist_ok=True)
            if self._advertised is not None:
                self._advertised.unlink(missing_ok=True)
            # Written aside, then renamed: the store's watcher ignores ".tmp_" files and never
            # sees a partial record.
            fd, temp = tempfile.mkstemp(prefix=".tmp_", dir=bucket)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(dict(instance.record), out)
            os.replace(temp, target)
            self._advertised = target
        else:
            os.utime(target)
        async with asyncio.timeout(self.timeout):
            client = await self._client(instance.path)
            # The private directory holds this record only: any instance is this one.
            await client.wait_for_instances()
        return instance.instance_id in client.instance_ids()

    async def send(self, request: CanaryRequest, instance: Instance, deadline: float) -> Received:
        """Send one canary to the instance and collect its whole stream within ``deadline``; on
        the deadline, an error event, too long a stream or any failure, stop it on the worker."""
        from dynamo.runtime import Context

        started = self.clock()

        def received(answer: Streamed | NoAnswer) -> Received:
            return Received(answer, started, self.clock(), time.time())

        context = Context(id=request.request_id)
        chunks: list[Any] = []
        try:
            async with asyncio.timeout(deadline):
                client = await self._client(instance.path)
                stream = await client.direct(
                    request.body, instance.instance_id, annotated=True, context=context
                )
                async for chunk in stream:
                    if chunk.is_error():
                        context.stop_generating()
                        said = " ".join(chunk.comments() or []) or "an error event"
                        return received(Streamed(tuple(chunks), error=said))
                    chunks.append(chunk.data())
                    if len(chunks) > MAX_CHUNKS:
                        context.stop_generating()
                        return received(NoAnswer(Outcome.INVALID, f"more than {MAX_CHUNKS} chunks"))
        except TimeoutError:
            context.stop_generating()
            return received(
                NoAnswer(
                    Outcome.TIMEOUT,
                    f"no complete answer within {deadline:g} s ({len(chunks)} chunk(s) "
                    "arrived); stopped on the worker",
                )
            )
        except asyncio.CancelledError:
            context.stop_generating()
            raise
        except Exception as exc:  # the runtime raises plain Exceptions too
            context.stop_generating()
            outcome, reason, rejected = classify(exc)
            return received(NoAnswer(outcome, reason, rejection=rejected))
        return received(Streamed(tuple(chunks)))
