"""Eviction: segmented LRU over whole objects, chunk shedding inside open ones,
run beside the fills (never inside one).

Why SLRU and not LRU: a one-pass read of a dataset larger than the cache must
not flush objects that are used again and again (model weights read at every
restart). An object enters the probation segment on its first use; used again
after that, it moves to the protected segment, which may hold at most
PROTECTED_FRACTION of the capacity (overflow is demoted, least recent first, to
the fresh end of probation). Victims come from probation first, then from
protected, least recent first. That is exactly the key order of the index's
`order` database (segment, rank, key hash), so the policy costs no memory per
object and survives restarts without a rebuild.

Open objects are never whole-object victims. When nothing else is left, chunks
of open objects are shed in `shed_order`: farthest behind the object's most
recent store first, so a file bigger than the whole cache streams through it;
the chunks just stored, never.

Beside, not inside: a fill (a fetched part, a local write) only counts its
bytes (`Cache.account`); once tier 1 is over its capacity, or has grown
enough (or long enough ago) that the free-space floor needs a look, the
count asks the `Evictor`, which makes room in a thread of its own (`run`,
in the mount's nursery). A fill never waits for an eviction; a writer that
hits ENOSPC asks for room itself and waits for it (`Cache.reclaim`).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import trio

from tierfs.cache.index import (
    CLEAN,
    PROBATION,
    PROTECTED,
    STORED,
    VERIFIED,
    Index,
    Record,
    WriteTxn,
    key_hash,
    order_key,
)

PROTECTED_FRACTION = 0.8
FREE_RECHECK = 0.5  # seconds between statvfs calls of the free-space floor
FREE_RECHECK_BYTES = 64 << 20  # ...or sooner, after this much growth of our own

_SHEDDABLE = re.compile(b"[" + bytes((STORED, VERIFIED)) + b"]+")


def use(
    wt: WriteTxn, kh: bytes, rec: Record, *, access_ns: int, reused: bool, capacity: int
) -> None:
    """Record one use of a clean object in `wt`: move it to the fresh end of its
    segment (protected if it was used before), then keep protected within bounds."""
    seg = PROTECTED if reused or rec.seg == PROTECTED else PROBATION
    wt.put(kh, rec, replace(rec, access_ns=access_ns, rank_ns=access_ns, seg=seg))
    if seg == PROTECTED:
        _rebalance(wt, int(capacity * PROTECTED_FRACTION), access_ns)


def _rebalance(wt: WriteTxn, limit: int, now_ns: int) -> None:
    while wt.counter(b"protected") > limit:
        cur = wt.txn.cursor(db=wt.ix.order)
        if not cur.set_range(bytes((PROTECTED,))):
            return
        okey = bytes(cur.key())
        kh = okey[9:]
        rec = wt.record(kh)
        if rec is None or order_key(kh, rec) != okey:
            wt.delete_order_key(okey)  # left over from a lost transaction
            continue
        wt.put(kh, rec, replace(rec, seg=PROBATION, rank_ns=now_ns))


def shed_order(states: bytearray, keep_lo: int, keep_hi: int) -> Iterator[int]:
    """Present chunks of an open object in the order they should go: behind the
    kept range farthest first, then ahead of it farthest first; the kept range
    [keep_lo, keep_hi] (the most recent store) is never offered."""
    if keep_lo > 0:
        for m in _SHEDDABLE.finditer(states, 0, keep_lo):
            yield from range(m.start(), m.end())
    ahead = [m.span() for m in _SHEDDABLE.finditer(states, keep_hi + 1)]
    for a, b in reversed(ahead):
        yield from range(b - 1, a - 1, -1)


class Open(Protocol):
    """An open entry, as eviction sees it (objects.py)."""

    def _shed(self, amount: int) -> int: ...

    def _drop_unpinned(self) -> int: ...


class Evictable(Protocol):
    """The Cache, as eviction sees it (cache/__init__.py)."""

    capacity: int
    min_free: int
    used: int
    root: Path
    index: Index

    def account(self, delta: int) -> None: ...

    def _try_claim(self, kh: bytes) -> bool: ...

    def _open_by_recency(self) -> Sequence[Open]: ...

    def _claimed(self, kh: bytes) -> AbstractContextManager[Open | None]: ...

    def _unclaim(self, kh: bytes) -> None: ...

    def _unlink(self, name: str) -> None: ...


class Evictor:
    """Keeps one Cache within `capacity` and above its free-space floor."""

    def __init__(self, cache: Evictable) -> None:
        self.cache = cache
        self._mu = threading.Lock()  # one eviction pass at a time
        self._counts = threading.Lock()
        self._wanted = threading.Event()  # a count asks for a pass (`run`)
        self._free_seen = (-FREE_RECHECK - 1.0, 0, 0)  # (monotonic, free bytes, used then)
        self.evictions = self.evicted_bytes = 0

    def counted(self, used: int) -> None:
        """(`Cache.account`, any thread, cheap) tier 1 now holds `used` bytes."""
        checked, _, used_then = self._free_seen
        c = self.cache
        if used > c.capacity or (c.min_free and (
                used - used_then > FREE_RECHECK_BYTES or time.monotonic() - checked > FREE_RECHECK)):
            self._wanted.set()

    async def run(self, disk: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        """For the mount's life (in its nursery): a pass (through `disk`, a worker)
        each time a count asks for one."""
        one = trio.CapacityLimiter(1)
        while True:
            await trio.to_thread.run_sync(self.wait_wanted, abandon_on_cancel=True, limiter=one)
            await disk(self.make_room)

    def wait_wanted(self) -> None:
        """(A thread of its own) until a count asks for a pass, or `stop`."""
        self._wanted.wait()
        self._wanted.clear()

    def stop(self) -> None:
        """Let a thread waiting in `run` go (the cache is closing)."""
        self._wanted.set()

    def deficit(self) -> int:
        """Bytes to free: over capacity, or under the free-space floor. The free
        space is measured at most every FREE_RECHECK seconds and estimated in
        between from our own growth."""
        c = self.cache
        used = c.used
        over = used - c.capacity
        if not c.min_free:
            return over
        now = time.monotonic()
        checked, free, used_then = self._free_seen
        if now - checked > FREE_RECHECK or used - used_then > FREE_RECHECK_BYTES:
            st = os.statvfs(c.root)
            free, used_then = st.f_bavail * st.f_frsize, used
            self._free_seen = (now, free, used_then)
        return max(over, c.min_free - (free - max(0, used - used_then)))

    def make_room(self) -> None:
        """Evict until within bounds: whole unopened objects in policy order, then
        chunks of open ones (the one filled last first: a file bigger than the
        cache sheds its own past), never dirty or sealed data."""
        if self.deficit() <= 0:
            return
        c = self.cache
        with self._mu:
            need = self.deficit()
            while need > 0 and (victim := self._claim_victim()) is not None:
                need -= self._evict_claimed(*victim)
            if need <= 0:
                return
            for e in c._open_by_recency():
                freed = e._shed(need)
                if freed:
                    self._count(freed)
                    need -= freed
                    if need <= 0:
                        return

    def evict(self, key: str) -> bool:
        """Drop an object's cached data. Refused (False) for dirty or sealed objects;
        chunks of an open object being read right now stay."""
        c = self.cache
        kh = key_hash(key)
        with c._claimed(kh) as e:
            if e is not None:
                freed = e._drop_unpinned()
                if freed < 0:
                    return False
                self._count(freed)
                return True
            with c.index.write() as wt:
                rec = wt.record(kh)
                if rec is not None and rec.state == CLEAN:
                    wt.drop(kh, rec)
            c.account(wt.used_delta)
            if rec is None or rec.state != CLEAN:
                return False
            c._unlink(rec.fid.hex())
            self._count(rec.cached)
            return True

    def _claim_victim(self) -> tuple[bytes, bytes] | None:
        """The first unopened, unclaimed object in eviction order, claimed."""
        for okey in self.cache.index.order_keys():
            kh = okey[9:]
            if self.cache._try_claim(kh):
                return okey, kh
        return None

    def _evict_claimed(self, okey: bytes, kh: bytes) -> int:
        c = self.cache
        try:
            with c.index.write() as wt:
                rec = wt.record(kh)
                if rec is None or rec.state != CLEAN or order_key(kh, rec) != okey:
                    wt.delete_order_key(okey)  # left over from a lost transaction
                    rec = None
                else:
                    wt.drop(kh, rec)
            c.account(wt.used_delta)
        finally:
            c._unclaim(kh)
        if rec is None:
            return 0
        c._unlink(rec.fid.hex())
        self._count(rec.cached)
        return rec.cached

    def _count(self, nbytes: int) -> None:
        with self._counts:
            self.evictions += 1
            self.evicted_bytes += nbytes
