"""Walks through a directory of small objects, seen so the next files can be
fetched ahead (DESIGN §3).

A dataset of small files is read file after file: `cat dir/*` in listing
order, `xargs -P8 -n64 cat` (eight cursors, each in listing order), or the
workers of a DataLoader taking consecutive indexes (roughly in order, a few
apart). If every file waits for its own GET, such a walk runs at one store
round trip per file however fast the reader is. So a walk that is seen has
the next files of its directory fetched while the current ones are read.

A walk is seen the way a sequential stream is (sequential.py), over listing
positions instead of byte offsets: each directory keeps a few cursors. A
cursor becomes a walk once the next two positions after it were opened, each
right after the one before; from then on an open shortly after it (within
SLACK positions: workers a little out of step) continues it, and one shortly
before it is a worker running a little behind and changes nothing. A walk's
window of files ahead doubles with each continuation, up to a maximum, and is
topped up once half of it is read: half a window at a time, so what is asked
ahead of a warm walk is opened a batch per worker hop (prepared.py), not one
hop per file. An open that continues no cursor starts a new one and fetches
nothing ahead. A shuffled reader (a random sampler) opens the very next
position of a cursor now and then by chance, and twice in a row almost never,
so it fetches about what it reads (bench/smallfiles.py measures it).

Pure bookkeeping, no I/O: the read path asks `opened` and fetches what it
returns.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

SLACK = 16  # an open this many positions past a cursor still continues it
CURSORS = 8  # per directory: one per reader walking it (xargs -P8)
DIRS = 64  # directories remembered


@dataclass
class _Cursor:
    pos: int  # the furthest listing position opened
    hits: int = 0  # continuations so far
    window: int = 0  # files ahead allowed
    ahead: int = 0  # positions before this one are fetched or being fetched
    used: float = field(default_factory=time.monotonic)


class Walks:
    def __init__(self, window_min: int = 4, window_max: int = 64) -> None:
        if not 0 < window_min <= window_max:
            raise ValueError("walk windows must be positive, min <= max")
        self.window_min = window_min
        self.window_max = window_max
        self._dirs: OrderedDict[str, list[_Cursor]] = OrderedDict()

    def opened(self, directory: str, pos: int, count: int) -> range:
        """An object at listing position `pos` of `directory` (of `count` entries)
        was opened: the positions to fetch ahead now (often none)."""
        cursors = self._dirs.pop(directory, None) or []
        self._dirs[directory] = cursors
        if len(self._dirs) > DIRS:
            self._dirs.popitem(last=False)
        now = time.monotonic()
        ahead = [c for c in cursors if c.pos < pos <= c.pos + (SLACK if c.hits >= 2 else 1)]
        if not ahead:
            if any(c.hits >= 2 and c.pos - SLACK <= pos <= c.pos for c in cursors):
                return range(0)  # a worker a little behind the others of its walk
            if len(cursors) >= CURSORS:
                cursors.remove(min(cursors, key=lambda c: c.used))
            cursors.append(_Cursor(pos, ahead=pos + 1, used=now))
            return range(0)
        c = min(ahead, key=lambda c: pos - c.pos)
        c.pos, c.used = pos, now
        c.hits += 1
        c.ahead = max(c.ahead, pos + 1)
        if c.hits < 2:
            return range(0)
        c.window = min(max(2 * c.window, self.window_min), self.window_max)
        if c.ahead - (pos + 1) > c.window // 2:
            return range(0)  # topped up once half the window is read: strides, not one by one
        start, stop = c.ahead, min(count, pos + 1 + c.window)
        c.ahead = max(c.ahead, stop)
        return range(start, stop)
