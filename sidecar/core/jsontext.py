"""JSON from an engine, read as the untrusted input it is: text that is not JSON, or is nested
deeper than Python's parser can follow, raises ``ValueError``, the one error its readers catch
(tests/test_fuzz.py sends both)."""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes) -> Any:
    """``json.loads``, with a parse too deep for the interpreter's stack a ``ValueError`` too."""
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply to read") from exc
