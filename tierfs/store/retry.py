"""The one retry loop of the store layer: exponential backoff with full jitter.

SDK-level retries are switched off so that every attempt is visible to the
metrics observer and the whole operation is bounded by one deadline, however
the attempts fail (5xx, throttling, resets, truncated bodies).

The wait between attempts is `time.sleep` unless the caller installed a pause
of its own for this thread (`pausing`): the daemon's workers give their slot
back and wait in trio meanwhile (workers.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from tierfs.store.base import UNREACHABLE_KINDS, RequestObserver, StoreError

T = TypeVar("T")

log = logging.getLogger("tierfs.store")

BASE_DELAY = 0.05  # first backoff ceiling, seconds
MAX_DELAY = 5.0  # backoff ceiling never grows past this

# The deadline of the operation running on this thread, for adapters that can
# cut one attempt short (the S3 adapter turns it into a per-request read timeout).
_current = threading.local()


@contextmanager
def pausing(pause: Callable[[float], None]) -> Iterator[None]:
    """Store operations run on this thread inside the block wait out their
    backoffs with `pause(seconds)` instead of `time.sleep`."""
    outer = getattr(_current, "pause", None)
    _current.pause = pause
    try:
        yield
    finally:
        _current.pause = outer


def time_left() -> float | None:
    """Seconds left before the deadline of the store operation running on this
    thread; None outside one."""
    end = getattr(_current, "end", None)
    return None if end is None else end - time.monotonic()


@dataclass(frozen=True)
class Failure:
    """How one failed attempt is classified."""

    kind: str  # StoreError kind
    errno: int
    reason: str  # one line, never with credentials or signed URLs
    retryable: bool
    # The attempt was cut short at the operation's deadline: what the attempt
    # before it met (if any) says more about the store than "no answer in time".
    cut: bool = False


def call_with_retries(
    op: str,
    what: str,
    attempt: Callable[[], tuple[T, int]],
    *,
    deadline: float,
    classify: Callable[[Exception], Failure | None],
    observer: RequestObserver | None,
) -> T:
    """Run `attempt` until it succeeds, fails for good, or `deadline` seconds pass.

    `attempt` returns (result, bytes transferred). `classify` maps an exception
    to a Failure, or None to let it propagate untouched. Each attempt is
    reported to `observer` as "ok", "retry" or the final error kind. `what`
    names the target in the error message (e.g. "get 's3://b/k'").
    """
    start = time.monotonic()
    end = start + deadline
    outer = getattr(_current, "end", None)
    _current.end = end if outer is None else min(end, outer)
    try:
        return _retry_loop(op, what, attempt, start, end, classify, observer)
    finally:
        _current.end = outer


def _retry_loop(
    op: str,
    what: str,
    attempt: Callable[[], tuple[T, int]],
    start: float,
    end: float,
    classify: Callable[[Exception], Failure | None],
    observer: RequestObserver | None,
) -> T:
    tries = 0
    previous: Failure | None = None
    while True:
        tries += 1
        t0 = time.monotonic()
        try:
            result, nbytes = attempt()
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if failure.cut and previous is not None:
                failure = previous
            previous = failure
            now = time.monotonic()
            # The last sleep is cut short so that one attempt lands at the deadline
            # (an adapter cuts that attempt's reads to the time left: time_left()).
            delay = min(
                random.uniform(0.0, min(MAX_DELAY, BASE_DELAY * 2 ** (tries - 1))), end - now
            )
            if failure.retryable and delay > 0:
                if observer is not None:
                    observer(op, "retry", now - t0, 0)
                log.debug("%s: %s; retry %d in %.2fs", what, failure.reason, tries, delay)
                (getattr(_current, "pause", None) or time.sleep)(delay)
                continue
            kind = failure.kind
            message = f"{what}: {failure.reason}"
            if failure.retryable:
                message += f" (gave up after {tries} attempts in {now - start:.1f}s)"
                # Failing a whole deadline of retries (resets, 5xx) is a store that
                # is away, whatever each attempt said: degraded mode, not one EIO.
                if kind not in UNREACHABLE_KINDS:
                    kind = "unreachable"
            if observer is not None:
                observer(op, kind, now - t0, 0)
            raise StoreError(message, errno_=failure.errno, kind=kind) from exc
        if observer is not None:
            observer(op, "ok", time.monotonic() - t0, nbytes)
        return result
