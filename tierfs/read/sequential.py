"""Sequential detection: a handle's streams and an entry's shared front (DESIGN §3.4).

A handle keeps a few streams (one per loader thread reading its own region); a
read continuing a stream doubles its window up to the class limit. A read that
continues no stream of its handle but lands near another handle's sequential
front (`Fronts`: a herd of processes reading one file takes turns) continues
that front. Any other read starts a new stream with an empty window.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tierfs.cache import Entry

MAX_STREAMS = 8  # per handle: one per loader thread is typical
STREAM_SLACK = 4 << 20  # out-of-order tolerance for kernel async readahead
STREAM_GAP = 128 << 10  # a read this close after a stream's end continues it at once
SMALL_READ = 256 << 10  # a non-sequential read up to this size fetches only its pages


@dataclass
class Stream:
    next_off: int
    window: int = 0
    last_used: float = 0.0
    hits: int = 0


@dataclass
class ReadState:
    """Per-handle sequential detection."""

    streams: list[Stream] = field(default_factory=list)

    def advance(self, off: int, end: int, min_window: int, max_window: int) -> int:
        """Record a read of [off, end) and return the readahead window for it (0: random).

        A read continues a stream when it starts right at the stream's end; once
        the stream has continued, a small gap (STREAM_GAP) is tolerated, and once
        it has continued twice, reads up to STREAM_SLACK around its end count (the kernel's async readahead requests can
        arrive out of order). So a random read landing near a stream by chance
        does not grow any window."""
        now = time.monotonic()
        for s in self.streams:
            if off == s.next_off:
                follows = True
            elif s.next_off < off <= s.next_off + STREAM_GAP:
                follows = s.hits >= 1
            else:
                near = s.next_off - STREAM_SLACK <= off <= s.next_off + STREAM_SLACK
                follows = near and s.hits >= 2
            if follows:
                s.hits += 1
                s.window = _grown(s.window, min_window, max_window)
                s.next_off = max(s.next_off, end)
                s.last_used = now
                return s.window
        if len(self.streams) >= MAX_STREAMS:
            self.streams.remove(min(self.streams, key=lambda s: s.last_used))
        # A big read at offset 0 is the start of a sequential pass more often than not.
        window = min(min_window, max_window) if off == 0 and end - off > SMALL_READ else 0
        self.streams.append(Stream(end, window, now))
        return window


def _grown(window: int, min_window: int, max_window: int) -> int:
    """A sequential stream's next window: doubled, at least the min, at most the max."""
    return min(max(window * 2, min_window), max_window)


class _Front(NamedTuple):
    entry: Entry
    end: int  # where the furthest sequential reader got to
    window: int
    seen: float  # monotonic time the front last moved


class Fronts:
    """Each recently read entry's sequential front, shared by all its handles.

    Why: N processes reading one file at once (a herd) take turns: the kernel
    sends each process's next request only for what the page cache still
    lacks, so the herd reads the file in order as a relay while no single
    handle sees a stream (a 1 GiB herd of 8: 476 GETs, mostly 1 MiB chunks,
    where one reader makes 64 part GETs). A read that continues no stream of
    its own handle but lands near the entry's front continues the front
    instead: whole parts, and a window that grows as one stream's would.
    A small read continues it only right at the front (see `follow`)."""

    KEEP = 64  # entries remembered
    FRESH = 1.0  # seconds a front stays meaningful without a read moving it

    def __init__(self, behind: int) -> None:
        self.behind = behind  # how far behind the front a read still counts (landed memory)
        self._fronts: OrderedDict[int, _Front] = OrderedDict()

    def note(self, entry: Entry, end: int, window: int) -> None:
        """A read of `entry` ending at `end` continued a stream of its handle."""
        now = time.monotonic()
        prior = self._fronts.pop(id(entry), None)
        if prior is not None and prior.entry is entry and now - prior.seen <= self.FRESH:
            # The front is the furthest sequential reader, with the widest window.
            end, window = max(end, prior.end), max(window, prior.window)
        self._fronts[id(entry)] = _Front(entry, end, window, now)
        if len(self._fronts) > self.KEEP:
            self._fronts.popitem(last=False)

    def follow(self, entry: Entry, off: int, end: int, min_window: int, max_window: int) -> int:
        """If [off, end) lands near the front, the front moves to `end` and its
        window grows as a stream's would; that window is returned. Else 0."""
        front = self._fronts.get(id(entry))
        if front is None or front.entry is not entry:
            return 0
        now = time.monotonic()
        reach = max(front.window, min_window)
        if now - front.seen > self.FRESH or not front.end - self.behind <= off <= front.end + reach:
            return 0
        if end - off <= SMALL_READ and not front.end <= off <= front.end + STREAM_GAP:
            # Small and not at the front: a random read that landed near it by
            # chance (a loader's 4 KiB preads), not a relay's next piece, which
            # starts where the last one ended. Following it would read ahead and
            # stage whole parts for 4 KiB.
            return 0
        window = _grown(front.window, min_window, max_window)
        self._fronts[id(entry)] = _Front(entry, max(end, front.end), window, now)
        self._fronts.move_to_end(id(entry))
        return window
