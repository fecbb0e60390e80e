"""Whole small objects kept in memory between the moment their bytes are at hand
and their reader's read (issue 21).

A walk through a directory of small objects costs the daemon per file, not per
byte: each thread hop (a worker doing a tier-1 read, an index transaction) is
a round trip through the trio loop, and on a busy machine those dominate a
100 KB file. So the bytes of a small object are kept here when they are in
memory anyway (a fetch ahead of a walk, a demand fetch) or when its open had
to load it from tier 1 in the same worker hop: the reader's `read` is then a
slice of memory on the loop, with no hop and no second tier-1 read.

Bounded by `cap` bytes and taken from the memory budget (try_take: never
waited for); given back under pressure (`shrink`), when an object's last byte
has been served, or oldest first. Keyed by (key, ETag): only clean versions
from the store are kept, so a body is always the object's bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from tierfs.budget import MemoryBudget

Body = bytes | bytearray | memoryview
# The most bytes kept (the mount keeps at most 1/8 of its memory budget): a walk
# window of 64 files of 100 KB for each of 8 readers.
BODIES_MAX = 64 << 20


class Bodies:
    def __init__(self, budget: MemoryBudget, cap: int) -> None:
        self.budget = budget
        self.cap = cap
        self._items: OrderedDict[tuple[str, str], Body] = OrderedDict()
        self._bytes = 0
        self.served = 0  # reads answered from here (status, tests)
        budget.reclaim_with(self.shrink)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def has(self, key: str, etag: str) -> bool:
        return (key, etag) in self._items

    def offer(self, key: str, etag: str, data: Body) -> None:
        """Keep the bytes of (key, etag) if they fit (trio thread)."""
        n = len(data)
        k = (key, etag)
        if not n or n > self.cap or k in self._items:
            return
        while self._bytes + n > self.cap and self._items:
            self._pop_oldest()
        if not self.budget.try_take(n):
            return
        self._items[k] = data
        self._bytes += n

    def get(self, key: str, etag: str) -> Body | None:
        return self._items.get((key, etag))

    def drop(self, key: str, etag: str) -> None:
        data = self._items.pop((key, etag), None)
        if data is not None:
            self._bytes -= len(data)
            self.budget.give(len(data))

    def shrink(self, want: int) -> int:
        """Give back about `want` bytes, oldest first; the bytes given."""
        freed = 0
        while freed < want and self._items:
            freed += self._pop_oldest()
        return freed

    def _pop_oldest(self) -> int:
        _, data = self._items.popitem(last=False)
        self._bytes -= len(data)
        self.budget.give(len(data))
        return len(data)
