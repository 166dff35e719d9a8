"""A private network namespace for the tests of engines that listen on every interface.

Dynamo's event plane binds 0.0.0.0 whatever its host variables say, and so do parts of SGLang.
Tests of such engines run in a network namespace of their own with only loopback up, so that
nothing of a test is reachable from outside and nothing outside is reachable from it.

Namespaces belong to threads: :func:`private_network` moves the calling (main) thread into a
new one, and every process it starts afterwards (the engines, the sidecar) is born there, so the
test, its engines and its sidecar all share that namespace's loopback. On exit the thread goes
back to the namespace it came from; sockets opened inside keep working until they are closed.
It needs root (CAP_SYS_ADMIN), which CI has; elsewhere the tests skip, naming what is missing,
and under CI (``CI`` set) they fail instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.prerequisites import missing as prerequisite_missing

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _check(code: int, what: str) -> None:
    if code != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unavailable() -> str | None:
    """Why a private network namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a private network namespace needs root (unshare -n); CI runs as root"
    if not any(
        os.access(os.path.join(d, "ip"), os.X_OK) for d in ("/usr/sbin", "/sbin", "/usr/bin")
    ):
        return "a private network namespace needs iproute2's ip"
    return None


@contextlib.contextmanager
def private_network() -> Iterator[None]:
    """Run the calling thread, and every process it starts, in a new network namespace with only
    loopback up; return to the original namespace afterwards."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)
            interfaces = [name for _, name in socket.if_nameindex()]
            assert interfaces == ["lo"], f"a fresh namespace has only lo, not {interfaces}"
            yield
        finally:
            _check(_libc.setns(original, CLONE_NEWNET), "setns back")
    finally:
        os.close(original)


def require_private_network() -> None:
    """Skip (fail under CI) when no private namespace can be made."""
    why = unavailable()
    if why is not None:
        prerequisite_missing(why)


@pytest.fixture(scope="module")
def isolated() -> Iterator[None]:
    """The whole test module in a private network namespace (request it before any fixture
    that starts an engine)."""
    require_private_network()
    with private_network():
        yield
