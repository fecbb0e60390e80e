"""Blocking work off the trio loop, each kind with its own explicit capacity.

boto3 calls and large local file I/O run in worker threads; the limits keep
the number of threads (and so sockets and fds) bounded. Five kinds, so that
none queues behind another: `data` (ranged GETs into part buffers: their
slots bound the part-sized bytes in flight), `small` (GETs of whole small
objects: each holds only its own size of the memory budget, and a walk
through a directory of them is bound by round trips, not bytes), `upload`
(PUTs and parts: uploads never take the slots reads need), `meta` (HEAD,
LIST, DELETE, COPY: a `stat` never waits behind a wall of GETs) and `disk`
(tier-1 I/O, index).

A store operation that backs off between retries (store/retry.py) gives its
slot back for the wait, which it spends in trio (`Kind._pause`): a store that
throttles or flaps does not hold the slots others need. The thread itself
waits meanwhile; each kind allows twice its slots in threads for that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import TypeVar

import trio

from tierfs.store.retry import pausing

T = TypeVar("T")
log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
_M_ARENA_MAX = -8
MALLOC_ARENAS = 2
MMAP_THRESHOLD = 256 << 10


def tune_malloc() -> None:
    """Keep glibc from holding freed memory. With ~30 worker threads each keeping
    its own arena of freed 1-8 MiB buffers, the daemon's RSS grew past 330 MiB in
    the herd bench; with 2 arenas it stays near 200 MiB. A fixed mmap threshold
    (glibc otherwise raises it up to 32 MiB after the first large free) returns
    any large temporary at once. Call before the worker threads exist. Best
    effort (non-glibc: no-op)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS):
            log.debug("mallopt(M_ARENA_MAX) refused")
        if not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            log.debug("mallopt(M_MMAP_THRESHOLD) refused")
    except (OSError, AttributeError):
        pass


class Kind:
    """`slots` calls of one kind at a time; a call backing off lends its slot out."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._sem = trio.Semaphore(slots)
        self._threads = trio.CapacityLimiter(2 * slots)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        await self._sem.acquire()
        held = [True]

        def pause(seconds: float) -> None:  # in the worker thread, from store/retry.py
            trio.from_thread.run(self._pause, held, seconds)

        def call() -> T:
            with pausing(pause):
                return fn(*args)

        try:
            return await trio.to_thread.run_sync(call, limiter=self._threads)
        finally:
            if held[0]:
                self._sem.release()

    async def _pause(self, held: list[bool], seconds: float) -> None:
        held[0] = False
        self._sem.release()
        try:
            await trio.sleep(seconds)
        finally:
            with trio.CancelScope(shield=True):
                await self._sem.acquire()
            held[0] = True


class Workers:
    def __init__(self, *, data: int, upload: int, meta: int, disk: int,
                 small: int | None = None) -> None:
        self.kinds = {"data": Kind(data), "small": Kind(data if small is None else small),
                      "upload": Kind(upload), "meta": Kind(meta), "disk": Kind(disk)}

    async def data(self, fn: Callable[..., T], *args: object) -> T:
        """A ranged GET of object bytes."""
        return await self.kinds["data"].run(fn, *args)

    async def small(self, fn: Callable[..., T], *args: object) -> T:
        """A GET of a whole small object."""
        return await self.kinds["small"].run(fn, *args)

    async def upload(self, fn: Callable[..., T], *args: object) -> T:
        """A PUT of object bytes, one part of a multipart upload, or its start/end."""
        return await self.kinds["upload"].run(fn, *args)

    async def meta(self, fn: Callable[..., T], *args: object) -> T:
        """A metadata store request (HEAD, LIST, DELETE, COPY)."""
        return await self.kinds["meta"].run(fn, *args)

    async def disk(self, fn: Callable[..., T], *args: object) -> T:
        """Local cache I/O, index updates, other local syscalls."""
        return await self.kinds["disk"].run(fn, *args)
