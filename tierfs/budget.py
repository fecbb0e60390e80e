"""One memory budget for every byte the daemon holds in flight (DESIGN §8).

GET part buffers, parts kept in memory after they landed, buffers that answer
FUSE reads, upload part buffers and queued direct writes all take their bytes
from one `MemoryBudget`, shared by reads and uploads (as mountpoint-s3's
memory limiter is). A taker that finds the budget spent first asks the
holders of memory that can be given back (idle pooled buffers, landed parts)
to shrink, then waits in trio, never in a worker thread. Any thread may give
bytes back.

`BufferPool` keeps buffers of one size for reuse (a fresh 1-16 MiB buffer
costs a page fault per 4 KiB and a zeroing): an idle pooled buffer still
counts against the budget, so the daemon's resident memory stays near its
idle size plus the budget. Buffers are aligned (O_DIRECT needs it), or, for
upload bodies, bytearrays of exactly their length: botocore sends a
bytearray in one piece, a file-like body 16 KiB per call (four 64 MiB uploads
that way made reads of others wait 120 ms, p50, for the GIL).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import trio

from tierfs.cache.directio import ALIGN, aligned_buffer


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        """Build inside the trio run that uses it (givers in other threads wake
        its waiters through the run's token)."""
        if limit <= 0:
            raise ValueError("a memory budget must be positive")
        self.limit = limit
        self.peak = 0
        self._used = 0
        self._mu = threading.Lock()  # leaf: counters only
        self.token = trio.lowlevel.current_trio_token()
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting = 0
        self._reclaiming = False
        self._reclaimers: list[Callable[[int], int]] = []

    @property
    def used(self) -> int:
        return self._used

    @property
    def pressed(self) -> bool:
        """Someone is waiting for bytes: holders should give back, not keep."""
        return self._waiting > 0 or self._reclaiming

    def reclaim_with(self, shrink: Callable[[int], int]) -> None:
        """A holder of memory it can give back registers (once, when it is built):
        `shrink(n)` frees about n bytes (on the trio thread) and says how many."""
        self._reclaimers.append(shrink)

    def try_take(self, n: int) -> bool:
        """Take `n` bytes if they fit now. A request larger than the whole budget
        fits once nothing else is held (it then holds all of it, and more)."""
        with self._mu:
            if self._used + n > self.limit and self._used:
                return False
            self._used += n
            self.peak = max(self.peak, self._used)
            return True

    async def take(self, n: int) -> None:
        """Take `n` bytes, waiting (in trio) while the budget is spent."""
        while not self.try_take(n):
            self._reclaim(n)
            if self.try_take(n):
                return
            self._waiting += 1
            try:
                await self._lot.park()
            finally:
                self._waiting -= 1

    def give(self, n: int) -> None:
        """Give `n` bytes back (any thread)."""
        with self._mu:
            self._used -= n
        if self._waiting:
            with contextlib.suppress(trio.RunFinishedError):  # stopping: nobody waits
                self.token.run_sync_soon(self._lot.unpark_all)

    def _reclaim(self, n: int) -> None:
        short = self._used + n - self.limit
        self._reclaiming = True
        try:
            for shrink in self._reclaimers:
                if short <= 0:
                    return
                short -= shrink(short)
        finally:
            self._reclaiming = False


class BufferPool:
    """Aligned buffers of `size` bytes, taken from `budget` and reused; at most
    `keep` idle ones are held (and given back under pressure). Requests above
    `size` get a buffer of their own, counted like the others. A `cap` bounds
    the bytes this pool holds at once (a share of the budget: uploads get one,
    so that they never take the memory reads need)."""

    def __init__(
        self, budget: MemoryBudget, size: int, keep: int, cap: int | None = None,
        exact: bool = False,
    ) -> None:
        self.budget = budget
        self.size = size
        self.keep = keep
        self.cap = cap
        self.exact = exact  # bytearrays of exactly the length asked (else aligned mmaps)
        # A bytearray is zeroed when made (a 16 MiB one: ~30 ms of page faults on
        # the bench VM), so it is made in a thread, not on the trio loop.
        self._makers = trio.CapacityLimiter(2)
        self._free: list[memoryview] = []
        self._held = 0  # bytes this pool took from the budget (idle and out)
        self._mu = threading.Lock()
        self._lot = trio.lowlevel.ParkingLot()  # waiting for this pool's cap
        budget.reclaim_with(self.drop_idle)

    async def take(self, n: int) -> memoryview:
        """A buffer of at least `n` bytes (trio: waits for the budget, and the cap)."""
        while True:
            buf = self._reuse(n)
            if buf is not None:
                return buf
            alloc = self._alloc_size(n)
            if self._within_cap(alloc):
                break
            if not self.drop_idle(alloc):  # idle ones that do not fit make room
                await self._lot.park()
        try:
            await self.budget.take(alloc)
        except BaseException:
            self._release(alloc)
            raise
        if not self.exact:
            return aligned_buffer(alloc)  # an anonymous mmap: its pages come later
        try:
            return await trio.to_thread.run_sync(_zeroed, alloc, limiter=self._makers)
        except BaseException:
            self._release(alloc)
            self.budget.give(alloc)
            raise

    def take_now(self, n: int) -> memoryview | None:
        """As `take`, or None if there is no room right now (optional work)."""
        buf = self._reuse(n)
        if buf is not None:
            return buf
        alloc = self._alloc_size(n)
        if not self._within_cap(alloc) and not (self.drop_idle(alloc) and self._within_cap(alloc)):
            return None
        if self.budget.try_take(alloc):
            return aligned_buffer(alloc) if not self.exact else _zeroed(alloc)
        self._release(alloc)
        return None

    def give(self, buf: memoryview) -> None:
        """Return a buffer (any thread); kept for reuse unless memory is wanted."""
        if len(buf) == self.size and not self.budget.pressed:
            with self._mu:
                if len(self._free) < self.keep:
                    self._free.append(buf)
                    self._wake()
                    return
        self._release(len(buf))
        self.budget.give(len(buf))

    def drop_idle(self, need: int) -> int:
        """Free idle buffers worth about `need` bytes; the bytes freed."""
        freed = 0
        with self._mu:
            while self._free and freed < need:
                self._free.pop()
                freed += self.size
        if freed:
            self._release(freed)
            self.budget.give(freed)
        return freed

    def _within_cap(self, alloc: int) -> bool:
        """Count `alloc` bytes as held if the cap allows."""
        with self._mu:
            if self.cap is not None and self._held and self._held + alloc > self.cap:
                return False
            self._held += alloc
            return True

    def _release(self, n: int) -> None:
        with self._mu:
            self._held -= n
            self._wake()

    def _wake(self) -> None:
        """(with _mu held) a buffer or room came back: cap waiters look again."""
        if self.cap is not None and self._lot.statistics().tasks_waiting:
            with contextlib.suppress(trio.RunFinishedError):
                self.budget.token.run_sync_soon(self._lot.unpark_all)

    def _reuse(self, n: int) -> memoryview | None:
        if n > self.size or (self.exact and n != self.size):
            return None
        with self._mu:
            return self._free.pop() if self._free else None

    def _alloc_size(self, n: int) -> int:
        if self.exact:
            return n
        return self.size if n <= self.size else -(-n // ALIGN) * ALIGN



def _zeroed(n: int) -> memoryview:
    return memoryview(bytearray(n))
