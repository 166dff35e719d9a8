"""What Dynamo's runtime client writes on stderr, through the sidecar's own logging.

The runtime logs a line for every request it routes ("route request completed", "... failed")
straight to file descriptor 2, and always: its logging appends an always-on directive for its
request span that no DYN_LOG value overrides (1.6.1). The sidecar logs one line per
state change, none per probe. So file descriptor 2 becomes a pipe, read by one thread for the
life of the process, which hands each line to the ``dynamo.runtime`` logger: at DEBUG, except the
runtime's errors, at WARNING. The sidecar's own log handlers keep writing to the real stderr.

Install it in the main thread, after logging is configured and before the runtime starts.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from typing import TextIO

log = logging.getLogger("dynamo.runtime")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"\b(TRACE|DEBUG|INFO|WARN|ERROR)\b")


def level_of(line: str) -> int:
    """The sidecar's log level for one line of the runtime's output (pure, tested)."""
    found = _LEVEL.search(line[:80])
    return logging.WARNING if found and found.group(1) == "ERROR" else logging.DEBUG


def _forward(pipe: TextIO) -> None:
    for raw in pipe:
        line = _ANSI.sub("", raw).rstrip()
        if line:
            log.log(level_of(line), "%s", line)


def capture() -> None:
    """Make file descriptor 2 a pipe forwarded to the ``dynamo.runtime`` logger; Python's
    sys.stderr, and every log handler that wrote to it, keep the real stderr."""
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stderr,
            sys.__stderr__,
        ):
            handler.setStream(real)
    sys.stderr = real
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    pipe = os.fdopen(read, "r", encoding="utf-8", errors="replace")
    threading.Thread(target=_forward, args=(pipe,), name="dynamo-runtime-log", daemon=True).start()
