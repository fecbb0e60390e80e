"""The errno a call fails with, for tests that check many calls in a row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def errno_of(fn: Callable[[], Any]) -> int | None:
    """The errno of the OSError `fn()` raises; None if it succeeds."""
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None
