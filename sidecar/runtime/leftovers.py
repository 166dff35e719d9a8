"""Removing what a canary caused the engine to write: an encoder's cache entry for the canary's
image (vLLM's ECExampleConnector writes ``<shared_storage_path>/<item>/encoder_cache.safetensors``),
where that storage is mounted in the sidecar too (``SIDECAR_EC_STORAGE_PATH``).

Only what a canary's prober names is removed (:meth:`sidecar.probes.base.Prober.leftovers`), and
only as a file under this directory, through plain path components (never ``..``, never a
link); then its directory, if that is left empty. A canary that timed out may still cause its
file to be written when the engine resumes: its name is kept and tried again with every later
canary, and at the end, for ``keep`` seconds.

The file system is reached off the event loop (a thread; ``offload``, which tests run inline) with
a deadline: a hung mount never holds a canary back, and while one removal is still stuck, none
other starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path

log = logging.getLogger(__name__)

#: How long a timed-out canary's name is tried again (its engine may resume much later).
KEEP = 600.0
#: At most this many names are kept waiting; the oldest go first.
KEPT_AT_MOST = 1000
#: The deadline of one round of removals.
TIMEOUT = 2.0

#: Runs a blocking call of the file system, off the event loop.
Offload = Callable[[Callable[[], None]], Awaitable[None]]


async def in_thread(call: Callable[[], None]) -> None:
    await asyncio.to_thread(call)


class Leftovers:
    def __init__(
        self,
        root: Path,
        *,
        keep: float = KEEP,
        timeout: float = TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        offload: Offload = in_thread,
    ) -> None:
        self.root = root
        self.offload = offload
        self.keep = keep
        self.timeout = timeout
        self.clock = clock
        self._waiting: dict[str, float] = {}  # name -> until when it is tried again
        self._round: asyncio.Future[None] | None = None
        self.removed = 0  # files removed, for the tests and the logs

    @property
    def waiting(self) -> tuple[str, ...]:
        """Names of files a timed-out canary may still cause to be written."""
        return tuple(self._waiting)

    async def remove(self, names: Sequence[str], *, later: bool) -> None:
        """Remove ``names`` now, with every name still waiting; with ``later``, a name not there
        yet waits for its file (the canary that would write it timed out)."""
        if self._round is not None and not self._round.done():
            log.warning("canary leftovers: the last removal under %s is still running", self.root)
            if later:
                self._wait(names)
            return
        self._round = asyncio.ensure_future(self.offload(partial(self._remove_all, names, later)))
        try:
            await asyncio.wait_for(asyncio.shield(self._round), self.timeout)
        except TimeoutError:
            log.warning(
                "canary leftovers: removal under %s took over %g s", self.root, self.timeout
            )

    async def aclose(self) -> None:
        """The last try for the names still waiting."""
        if self._waiting:
            await self.remove((), later=False)

    def _wait(self, names: Sequence[str]) -> None:
        until = self.clock() + self.keep
        for name in names:
            self._waiting[name] = until
        while len(self._waiting) > KEPT_AT_MOST:
            del self._waiting[next(iter(self._waiting))]

    def _remove_all(self, names: Sequence[str], later: bool) -> None:
        now = self.clock()
        for name, until in list(self._waiting.items()):
            if self._remove(name) or until < now:
                del self._waiting[name]
        for name in names:
            if not self._remove(name) and later:
                self._wait((name,))

    def _remove(self, name: str) -> bool:
        """Remove the regular file ``root/name`` and then its directories up to the root that
        are left empty; whether the file was there."""
        relative = Path(name)
        parts = relative.parts
        if relative.is_absolute() or not parts or any(p in (".", "..") for p in parts):
            log.warning("canary leftovers: refusing to remove %r (not a plain relative path)", name)
            return True  # nothing will ever be removed under that name
        path = self.root.joinpath(*parts)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("canary leftovers: cannot read %s: %s", path, exc)
            return False
        if not stat.S_ISREG(mode):
            log.warning("canary leftovers: %s is not a regular file; left alone", path)
            return True
        for parent in path.parents:  # no link on the way: the file is really under the root
            if parent == self.root:
                break
            if parent.is_symlink():
                log.warning("canary leftovers: %s goes through a link; left alone", path)
                return True
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("canary leftovers: cannot remove %s: %s", path, exc)
            return False
        self.removed += 1
        for parent in path.parents:
            if parent == self.root:
                break
            try:
                parent.rmdir()
            except OSError:
                break  # not empty (the engine's own entries), or gone
        return True
