"""Writes acknowledged before tier 1 has them (direct-write handles).

A direct-write handle's write(2) reaches the daemon synchronously, one request
at a time: applying it (pwrite into the tier-1 file, chunk checksum, a worker
thread hop: ~0.5 ms per MiB) before replying made the writer wait for all of
it. pyfuse3 hands the bytes over as a private copy, so the reply can go out at
once while one task per handle applies that handle's writes in order,
contiguous ones joined (8 KiB writes are applied 1 MiB at a time).

Every other path that looks at a file's bytes waits for its queued writes
first (reads, truncate, sealing, renames, unlink). In-flight bytes are capped
for the whole mount. The first failure sticks to the handle: its next write,
fsync and close report it, and the file is never sealed with a write missing
(after a restart it is quarantined like any file whose writer did not close).
"""

from __future__ import annotations

import collections
import errno
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tierfs.budget import MemoryBudget

COALESCE = 1 << 20  # contiguous queued writes applied as one, up to this many bytes
Apply = Callable[[Any, int, bytes], Awaitable[object]]


class WriteQueue:
    """One handle's writes, oldest first, and the first error applying them."""

    def __init__(self, entry: Any) -> None:
        self.entry = entry
        self.items: collections.deque[tuple[int, bytes]] = collections.deque()
        self.running = False
        self.error: OSError | None = None
        self.submitted = 0  # writes queued so far
        self.done = 0  # writes applied (or dropped after a failure) so far

    def check(self) -> None:
        if self.error is not None:
            raise OSError(self.error.errno, f"an earlier write failed: {self.error.strerror}")


class QueuedWrites:
    def __init__(
        self, nursery: trio.Nursery, apply: Apply, limit: int, budget: MemoryBudget
    ) -> None:
        self._nursery = nursery
        self._apply = apply  # (entry, offset, data): the synchronous write path
        self._limit = limit
        self._budget = budget
        self._queued = 0
        self._lot = trio.lowlevel.ParkingLot()  # woken whenever a write is applied
        self._active: set[WriteQueue] = set()

    @property
    def queued_bytes(self) -> int:
        return self._queued

    async def submit(self, q: WriteQueue, entry: Any, offset: int, data: bytes) -> None:
        """Queue a write (raising the handle's earlier failure instead); waits
        while the mount's cap on queued bytes is reached."""
        q.check()
        if q.entry is not entry:  # the handle moved to another cache entry
            await self.drain(q)
            q.entry = entry
        while self._queued and self._queued + len(data) > self._limit:
            await self._lot.park()
            q.check()
        await self._budget.take(len(data))
        q.items.append((offset, data))
        q.submitted += 1
        self._queued += len(data)
        if not q.running:
            q.running = True
            self._active.add(q)
            self._nursery.start_soon(self._run, q)

    async def _run(self, q: WriteQueue) -> None:
        try:
            while q.items:
                offset, data, n = self._next_run(q)
                try:
                    await self._apply(q.entry, offset, data)
                except OSError as exc:
                    q.error = exc
                    return
                except Exception as exc:  # e.g. the entry was removed meanwhile
                    q.error = OSError(errno.EIO, str(exc))
                    return
                for _ in range(n):
                    q.items.popleft()
                q.done += n
                self._queued -= len(data)
                self._budget.give(len(data))
                self._lot.unpark_all()
        finally:
            dropped = sum(len(d) for _, d in q.items)  # after an error
            self._queued -= dropped
            self._budget.give(dropped)
            q.done += len(q.items)
            q.items.clear()
            q.running = False
            self._active.discard(q)
            self._lot.unpark_all()

    @staticmethod
    def _next_run(q: WriteQueue) -> tuple[int, bytes, int]:
        """The oldest write joined with the contiguous ones after it (up to
        COALESCE bytes): a stream of small writes is applied in big pieces."""
        offset, data = q.items[0]
        end, n = offset + len(data), 1
        while n < len(q.items) and end - offset < COALESCE and q.items[n][0] == end:
            end += len(q.items[n][1])
            n += 1
        if n > 1:
            data = b"".join(q.items[i][1] for i in range(n))
        return offset, data, n

    async def drain(self, q: WriteQueue) -> None:
        """Wait until this handle's writes are applied; raise its failure."""
        while q.running:
            await self._lot.park()
        q.check()

    async def drain_entry(self, entry: Any, but: WriteQueue | None = None) -> None:
        """Wait until every other handle's write to this entry that was queued
        before this call is applied (their errors stay with them). Writes queued
        later are not waited for: a writer that keeps writing starves no reader."""
        targets = [(q, q.submitted) for q in self._active if q.entry is entry and q is not but]
        while any(q.done < upto for q, upto in targets):
            await self._lot.park()
