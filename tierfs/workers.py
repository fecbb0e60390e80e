"""Blocking work off the trio loop, each kind with its own explicit capacity.

boto3 calls and large local file I/O run in worker threads; the limits keep
the number of threads (and so sockets, fds and in-flight bytes) bounded.
Metadata requests get their own pool so a `stat` never queues behind a wall
of 8 MiB ranged GETs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


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
