"""Recently fetched parts, kept in memory for the reads that follow them.

Why: a sequential reader asks for the bytes of a part shortly after its GET
landed. Reading them back from tier 1 costs a device read per FUSE request,
which queues behind the O_DIRECT writes of the parts still landing; on the
bench VM that made tier 1 the bottleneck of a cold read (disk 80% busy,
25% iowait). Serving them from the part buffer the GET filled costs one
memcpy. Tier 1 still receives every part (for the next open, another
process, or after this memory moved on).

Bounded: at most `capacity` bytes of part buffers are held here; the oldest
part goes back to the buffer pool when a new one lands, unless a read is
copying out of it at that moment (then it goes back when that read is done).
The buffers count against the memory budget, which may ask for them back
sooner (`shrink`) when others need memory.
Entries are matched by identity and ETag, and only serve while the entry is
clean: a local write makes the entry dirty, and its bytes then differ.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from tierfs.budget import BufferPool

if TYPE_CHECKING:
    from tierfs.cache import Entry


class _Part:
    __slots__ = ("entry", "etag", "start", "end", "buf", "pins", "gone", "staged")

    def __init__(self, entry: Entry, start: int, end: int, buf: memoryview, staged: bool) -> None:
        self.entry = entry
        self.etag = entry.etag
        self.start = start
        self.end = end
        self.buf = buf
        self.pins = 0
        self.gone = False
        self.staged = staged  # loaded from tier 1 ahead of a reader (not fetched)


class LandedParts:
    def __init__(self, pool: BufferPool, capacity: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self._parts: OrderedDict[tuple[int, int], _Part] = OrderedDict()
        self._held = 0
        self._mu = threading.Lock()
        pool.budget.reclaim_with(self.shrink)

    def land(
        self, entry: Entry, start: int, end: int, buf: memoryview, *, staged: bool = False
    ) -> None:
        """Keep `buf` (holding [start, end) of `entry`, from `pool`) for later reads;
        the pool gets it back once it ages out."""
        if end - start > self.capacity:
            self.pool.give(buf)
            return
        part = _Part(entry, start, end, buf, staged)
        free: list[memoryview] = []
        with self._mu:
            old = self._parts.pop((id(entry), start), None)
            if old is not None:
                free += self._drop(old)
            self._parts[(id(entry), start)] = part
            self._held += len(buf)
            while self._held > self.capacity:
                _, oldest = self._parts.popitem(last=False)
                free += self._drop(oldest)
        for b in free:
            self.pool.give(b)

    def shrink(self, need: int) -> int:
        """Give the oldest parts back until about `need` bytes are free (the memory
        budget asks); parts a read is copying out of go back when it is done."""
        free: list[memoryview] = []
        with self._mu:
            while self._parts and sum(map(len, free)) < need:
                _, oldest = self._parts.popitem(last=False)
                free += self._drop(oldest)
        for b in free:
            self.pool.give(b)
        return sum(map(len, free))

    def _drop(self, part: _Part) -> list[memoryview]:
        self._held -= len(part.buf)
        part.gone = True
        return [] if part.pins else [part.buf]

    def pin(self, entry: Entry, start: int, end: int) -> _Part | None:
        """The landed part holding all of [start, end) of `entry`, pinned, or None.
        A scan, newest first: a handful of parts are held at any time."""
        if entry.state != "clean":
            return None
        with self._mu:
            part = self._find(entry, start, end)
            if part is None or part.etag != entry.etag:
                return None
            part.pins += 1
            return part

    def holds(self, entry: Entry, start: int, end: int) -> bool:
        with self._mu:
            return self._find(entry, start, end) is not None

    def _find(self, entry: Entry, start: int, end: int) -> _Part | None:
        for part in reversed(self._parts.values()):
            if part.entry is entry and part.start <= start and end <= part.end:
                return part
        return None

    def copy_out(self, part: _Part, start: int, end: int, out: memoryview) -> memoryview:
        """Copy [start, end) out of a pinned part into `out`; unpins it."""
        try:
            a = start - part.start
            out[: end - start] = part.buf[a : a + end - start]
            return out[: end - start]
        finally:
            self.unpin(part)

    def view(self, part: _Part, start: int, end: int) -> memoryview:
        """[start, end) of a pinned part, not copied; unpins it. The view stays
        valid (a buffer is freed only once nothing refers to it), and unchanged
        until the trio thread takes a buffer again: a part buffer given back to
        the pool is only refilled after a `BufferPool.take`, and those happen on
        the trio thread only. So the caller must hand the view on before that
        thread runs anything else (Reader.read)."""
        try:
            a = start - part.start
            return part.buf[a : a + end - start]
        finally:
            self.unpin(part)

    def unpin(self, part: _Part) -> None:
        with self._mu:
            part.pins -= 1
            back = part.gone and not part.pins
        if back:
            self.pool.give(part.buf)
