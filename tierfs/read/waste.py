"""Waste caps: readahead that a too-small tier 1 throws away is cut, down to
reading through memory (DESIGN §4: a read never evicts what it needs; thrash is
detected and stopped).

A small tier 1 must not turn into a store storm (a 32 MiB cache once fetched
9x the bytes read of a 200 MiB file; a 64 MiB cache disk, over 200 GiB). A
chunk fetched and evicted again before any read used it is waste: each waste
cuts that object's readahead to a quarter, and once none is left its reads
are served from memory through the store without caching (one warning line);
likewise when the cache disk is full (ENOSPC). An object that stays quiet for
WASTE_QUIET seconds gets its readahead back.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass

from tierfs.cache import Entry

log = logging.getLogger(__name__)

WASTE_QUIET = 30.0  # seconds without waste before an object's readahead is restored
AHEAD_SHARE = 4  # readahead reaches at most 1/AHEAD_SHARE of tier 1 ahead


@dataclass
class _Use:
    """How tier 1 keeps up with one open object's reads."""

    unserved: bytearray  # per chunk: 1 = fetched, not yet served (fetching it again is waste)
    cap: int  # bytes of readahead allowed; each waste cuts it to a quarter
    through: bool = False  # reads come through memory, not tier 1
    last_waste: float = -math.inf


class WasteCaps:
    """Per open clean object: its readahead cap and whether it reads through memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # tier 1's
        self.ahead_max = capacity // AHEAD_SHARE  # the cap of an object with no waste
        self._uses: weakref.WeakKeyDictionary[Entry, _Use] = weakref.WeakKeyDictionary()
        self._warned_through = False
        self.wasted_bytes = 0  # fetched, then evicted before any read used them

    def use(self, entry: Entry) -> _Use | None:
        """The object's record (clean objects only: local writes are never fetched);
        a quiet object gets its readahead back."""
        if entry.state != "clean":
            return None
        use = self._uses.get(entry)
        if use is None:
            use = self._uses[entry] = _Use(bytearray(-(-entry.size // entry.chunk_size)), self.ahead_max)
        elif use.cap < self.ahead_max and time.monotonic() - use.last_waste > WASTE_QUIET:
            use.cap, use.through = self.ahead_max, False
        return use

    def cut(self, entry: Entry) -> bool:
        """Whether the object's readahead was cut (a whole-object prefetch stops)."""
        use = self._uses.get(entry)
        return use is not None and use.cap < self.ahead_max

    def claimed(self, entry: Entry, runs: list[tuple[int, int]]) -> None:
        """Runs [c0, c1) of chunks are being fetched: those fetched before and not
        served since are waste."""
        use = self._uses.get(entry)
        if use is None:
            return
        wasted = 0
        for c0, c1 in runs:
            wasted += use.unserved.count(1, c0, c1)
            use.unserved[c0:c1] = b"\1" * (c1 - c0)
        if not wasted:
            return
        self.wasted_bytes += wasted * entry.chunk_size
        use.last_waste = time.monotonic()
        use.cap //= 4
        log.debug("%r: %d chunk(s) evicted unread; readahead now %d bytes", entry.key, wasted, use.cap)
        if use.cap < entry.chunk_size:
            self.go_through(entry, f"tier 1 ({self.capacity >> 20} MiB) cannot hold what is being read")

    def served(self, entry: Entry, start: int, end: int) -> None:
        """[start, end) was served: its chunks are no waste if fetched again."""
        use = self._uses.get(entry)
        if use is not None:
            lo, hi = start // entry.chunk_size, (end - 1) // entry.chunk_size + 1
            use.unserved[lo:hi] = bytes(hi - lo)

    def go_through(self, entry: Entry, why: str) -> None:
        """Read the object through memory from now on (until it is quiet again)."""
        use = self.use(entry)
        if use is None or use.through:
            return
        use.through = True
        use.last_waste = time.monotonic()
        use.cap = 0
        if not self._warned_through:
            self._warned_through = True
            log.warning("%s: reading %r (and any other such file) from the store through "
                        "memory, without caching it", why, entry.key)
        else:
            log.debug("%s: reading %r through memory", why, entry.key)
