"""The one rule for a test whose prerequisite is missing (a real engine, a validator, a daemon,
a browser, a private network namespace): skip where a developer lacks it, naming what prepares
it; fail under CI (``CI`` set), which prepares everything and must run every test."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(message: str) -> NoReturn:
    """Skip with ``message``, or fail with it under CI."""
    if os.environ.get("CI"):
        pytest.fail(f"CI: {message}")
    pytest.skip(message)
