"""Read path (DESIGN §3): tier 1 first, then coalesced ranged GETs, with readahead.

Every byte served comes out of the tier-1 sparse file: a fetch writes the
ranged GET's body into it (one part at a time, never the whole object in
RAM) and the read is then answered from there.

Single-flight: every chunk being fetched has one owner; any other reader (or
readahead) that needs it waits on the owner's event, so N readers of a cold
chunk cause one GET.

Readahead is per handle and per stream: a handle keeps a few streams (one per
loader thread reading its own region); a read continuing a stream doubles its
window up to the class limit and keeps up to `max_parallel_gets` part-sized
GETs in flight ahead of it. A read that continues no stream starts a new one
with an empty window and fetches only the chunks it touches.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from tierfs.cache import ChunkCorrupt, Entry
from tierfs.store.base import Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)

MAX_STREAMS = 8  # per handle: one per loader thread is typical
STREAM_SLACK = 4 << 20  # out-of-order tolerance for kernel async readahead


@dataclass
class Stream:
    next_off: int
    window: int = 0
    last_used: float = 0.0


@dataclass
class ReadState:
    """Per-handle sequential detection."""

    streams: list[Stream] = field(default_factory=list)

    def advance(self, off: int, end: int, min_window: int, max_window: int) -> int:
        """Record a read of [off, end) and return the readahead window for it."""
        now = time.monotonic()
        for s in self.streams:
            if s.next_off - STREAM_SLACK <= off <= s.next_off + STREAM_SLACK:
                s.window = min(max(s.window * 2, min_window), max_window)
                s.next_off = max(s.next_off, end)
                s.last_used = now
                return s.window
        if len(self.streams) >= MAX_STREAMS:
            self.streams.remove(min(self.streams, key=lambda s: s.last_used))
        # A read at offset 0 is the start of a sequential pass more often than not.
        window = min_window if off == 0 else 0
        self.streams.append(Stream(end, window, now))
        return window


class _Flight:
    """One in-flight fetch; waiters learn its outcome."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class Reader:
    def __init__(
        self,
        store: Store,
        workers: Workers,
        nursery: trio.Nursery,
        *,
        part_size: int,
        readahead_min: int,
        observe_read: Callable[[str, int], None] = lambda tier, n: None,
    ) -> None:
        self.store = store
        self.workers = workers
        self.nursery = nursery
        self.part_size = part_size
        self.readahead_min = readahead_min
        self.observe_read = observe_read
        # (entry identity, chunk index) -> flight fetching it
        self._flights: dict[tuple[int, int], _Flight] = {}

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, readahead_max: int
    ) -> bytes:
        end = min(off + size, entry.size)
        if off >= end:
            return b""
        window = state.advance(off, end, self.readahead_min, readahead_max)
        fetched = await self.ensure(entry, off, end, whole_parts=window > 0)
        if window:
            self.prefetch(entry, end, min(end + window, entry.size))
        for _ in range(3):
            try:
                data = await self.workers.disk(entry.read, off, end - off)
                break
            except ChunkCorrupt as exc:
                log.warning("cache chunk(s) %s of %r failed checksum: refetching", exc.chunks, entry.key)
            except KeyError:
                pass  # chunks given up to eviction between fetch and read (tiny cache)
            fetched = await self.ensure(entry, off, end, whole_parts=False) or fetched
        else:
            raise OSError(errno.EIO, "cache keeps returning corrupt data")
        self.observe_read("store" if fetched else "cache", len(data))
        return data

    async def ensure(self, entry: Entry, start: int, end: int, *, whole_parts: bool) -> bool:
        """Make [start, end) present in tier 1; True if anything had to be fetched.

        Fetches run in the daemon's nursery, not the caller's: a reader that is
        interrupted must not cancel a GET other readers are waiting on.
        """
        fetched = False
        while True:
            missing = entry.missing(start, end)
            if not missing:
                return fetched
            fetched = True
            waits: list[_Flight] = []
            for a, b in missing:
                if whole_parts:
                    a, b = self._align_parts(entry, a, b)
                for pa, pb, flight, owner in self._claim(entry, a, b):
                    if owner:
                        self.nursery.start_soon(self._fetch, entry, pa, pb, flight)
                    waits.append(flight)
            for flight in waits:
                await flight.done.wait()
                if flight.error is not None:
                    raise flight.error

    def prefetch(self, entry: Entry, start: int, end: int) -> None:
        """Start background fetches of every part of [start, end) not present or in flight."""
        if start >= end:
            return
        for a, b in entry.missing(start, end):
            a, b = self._align_parts(entry, a, b)
            for pa, pb, flight, owner in self._claim(entry, a, b):
                if owner:
                    self.nursery.start_soon(self._fetch, entry, pa, pb, flight)

    def _align_parts(self, entry: Entry, a: int, b: int) -> tuple[int, int]:
        p = self.part_size
        return (a // p) * p, min(-(-b // p) * p, entry.size)

    def _claim(self, entry: Entry, a: int, b: int) -> list[tuple[int, int, _Flight, bool]]:
        """Split [a, b) into pieces of at most part_size: runs of chunks nobody is
        fetching get a new flight (owner=True); chunks already in flight are
        answered with that flight (owner=False)."""
        cs = entry.chunk_size
        ident = id(entry)
        per_part = max(1, self.part_size // cs)
        first, last = a // cs, -(-b // cs)
        runs: list[tuple[int, int]] = []  # [start, end) chunk runs to claim
        out: list[tuple[int, int, _Flight, bool]] = []
        run_start: int | None = None
        for c in range(first, last):
            existing = self._flights.get((ident, c))
            if existing is None:
                if run_start is None:
                    run_start = c
                elif c - run_start == per_part:
                    runs.append((run_start, c))
                    run_start = c
                continue
            if run_start is not None:
                runs.append((run_start, c))
                run_start = None
            if not out or out[-1][2] is not existing:
                out.append((c * cs, c * cs, existing, False))
        if run_start is not None:
            runs.append((run_start, last))
        for c0, c1 in runs:
            flight = _Flight()
            for c in range(c0, c1):
                self._flights[(ident, c)] = flight
            out.append((c0 * cs, min(c1 * cs, entry.size), flight, True))
        return out

    async def _fetch(self, entry: Entry, a: int, b: int, flight: _Flight) -> None:
        try:
            await self.workers.data(self._get_and_store, entry, a, b)
        except Exception as exc:
            flight.error = _as_oserror(exc)
        except BaseException:
            flight.error = OSError(errno.EIO, "fetch cancelled: daemon stopping")
            raise
        finally:
            cs = entry.chunk_size
            ident = id(entry)
            for c in range(a // cs, -(-b // cs)):
                if self._flights.get((ident, c)) is flight:
                    del self._flights[(ident, c)]
            flight.done.set()

    def _get_and_store(self, entry: Entry, a: int, b: int) -> None:
        data = self.store.get_range(entry.key, a, b - a, entry.etag)
        if len(data) != b - a:
            raise StoreError(f"short read of {entry.key!r}: {len(data)} of {b - a} bytes")
        entry.store(a, data)


def _as_oserror(exc: BaseException) -> BaseException:
    if isinstance(exc, StoreError):
        return OSError(exc.errno, str(exc))
    return exc
