"""Blocking work off the trio loop, each kind with its own explicit capacity.

boto3 calls and large local file I/O run in worker threads; the limits keep
the number of threads (and so sockets, fds and in-flight bytes) bounded.
Metadata requests get their own pool so a `stat` never queues behind a wall
of 8 MiB ranged GETs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")
log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc mallopt parameter
MALLOC_ARENAS = 2


def limit_malloc_arenas(n: int = MALLOC_ARENAS) -> None:
    """Cap glibc's per-thread malloc arenas. With ~30 worker threads each keeping
    its own arena of freed 1-8 MiB buffers, the daemon's RSS grew past 330 MiB in
    the herd bench; with 2 arenas it stays near 200 MiB. Best effort (non-glibc: no-op)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not libc.mallopt(_M_ARENA_MAX, n):
            log.debug("mallopt(M_ARENA_MAX) refused")
    except (OSError, AttributeError):
        pass


class Workers:
    def __init__(self, data_threads: int, meta_threads: int, disk_threads: int) -> None:
        self.data_limiter = trio.CapacityLimiter(data_threads)
        self.meta_limiter = trio.CapacityLimiter(meta_threads)
        self.disk_limiter = trio.CapacityLimiter(disk_threads)

    async def data(self, fn: Callable[..., T], *args: object) -> T:
        """A bulk store transfer (GET/PUT of object bytes)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.data_limiter)

    async def meta(self, fn: Callable[..., T], *args: object) -> T:
        """A metadata store request (HEAD, LIST, DELETE, COPY)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.meta_limiter)

    async def disk(self, fn: Callable[..., T], *args: object) -> T:
        """Local cache I/O and index updates."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.disk_limiter)
