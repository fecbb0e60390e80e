"""The fetcher: bytes tier 1 (or a read through memory) lacks, from the sources,
each byte range fetched once however many wait for it (DESIGN §3.3).

Four kinds of fetch, each claimed in a `SingleFlight` table of its own:
- parts (`chunks`): whole chunks of an object, in units of at most a part,
  received into a pooled aligned part buffer, written into tier 1 with
  O_DIRECT, then kept in memory a while for the reads that follow
  (landed.py); a small object (up to `whole_max`) is fetched whole into memory
  of its own size instead and offered to its reader (bodies.py);
- pages (`pages`): the 4 KiB pages of a small random read, so it costs about
  4 KiB from the store (`Serving.store_pages`);
- through memory (`memory`): units read into part buffers and served from
  there, never written to tier 1 (a tier 1 too small or full: waste.py);
- whole objects ahead of a walk (`objects`, by key): fetched into a new tier-1
  file with no open entry (`Cache.whole_fill`), for walkahead.py.

Where the bytes come from is the ordered list of sources (sources.py: the
origin store today; a transfer engine and a shared tier plug in there). A
source may write into the tier-1 file itself; otherwise the fetcher does.
What a GET's response says of the object (user metadata) goes up through
`learned`, on the trio loop, once the fetch is done.

Fetches run in the daemon's nursery, not the caller's: a reader that is
interrupted must not cancel a GET other readers are waiting on. Readahead
of an object nobody holds open any more is dropped before its GET.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, TypeVar

import trio
import xxhash

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.cache.chunkmap import PAGE
from tierfs.cache.directio import pwrite_all
from tierfs.read.bodies import Bodies
from tierfs.read.flights import Flight, SingleFlight, wait_all
from tierfs.read.landed import LandedParts
from tierfs.read.sources import Got, Source, Tier1Fill, Want, ask
from tierfs.read.waste import WasteCaps
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers

log = logging.getLogger(__name__)
T = TypeVar("T")

UNIT_SHARE = 8  # a fetch unit is at most 1/UNIT_SHARE of tier 1
ChunkKey = tuple[int, int]  # (id of the entry, chunk / page / unit index)
Learned = Callable[[str, str, dict[str, str]], None]  # (key, ETag, user metadata)


def fetch_unit(part_size: int, capacity: int, chunk_size: int) -> int:
    """The largest part fetch: a part, but small enough that a reader's chunks, the
    ones landing and those ahead fit in tier 1 together."""
    fit = capacity // UNIT_SHARE // chunk_size * chunk_size
    return max(chunk_size, min(part_size, fit))


class NoRoom(OSError):
    """Tier 1 could not take fetched bytes (its disk is full); the caller reads
    through memory instead."""

    def __init__(self, key: str) -> None:
        super().__init__(errno.ENOSPC, f"{key!r}: no room in tier 1 for fetched bytes")


class Abandoned(Exception):
    """A readahead fetch of an object nobody holds open any more: not made."""


class _Sink:
    """One fetch's sink (sources.Sink): `buf` for the wanted bytes of `entry`, landed
    by `_deliver` (tier 1 and/or memory); its worker threads are `run`'s, and
    they drop a fetch of an object nobody holds open any more."""

    def __init__(self, entry: Entry, start: int, buf: memoryview,
                 run: Callable[..., Awaitable[Any]], *, tier1: bool) -> None:
        self.entry = entry
        self.start = start
        self.landed = False
        self._buf = buf
        self._run = run
        self._tier1 = tier1

    def buffer(self) -> memoryview:
        return self._buf

    def land(self) -> None:
        if not self.landed:
            self.landed = True
            self._deliver()

    def _deliver(self) -> None:
        """Put the bytes in `buf` where this fetch keeps them."""

    def tier1(self, start: int, end: int) -> AbstractContextManager[Tier1Fill] | None:
        return self.entry.serve.filling(start, end) if self._tier1 else None

    async def worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(self._unless_abandoned, fn, *args)

    def _unless_abandoned(self, fn: Callable[..., T], *args: Any) -> T:
        if self.entry.closed:  # readahead for a reader that is gone
            raise Abandoned(self.entry.key)
        return fn(*args)


class _PartSink(_Sink):
    """Chunks into tier 1 with O_DIRECT from a pooled part buffer, which is then kept
    in memory for the reads that follow (landed.py; it owns the buffer from then)."""

    def __init__(self, fetcher: Fetcher, entry: Entry, start: int, buf: memoryview,
                 length: int) -> None:
        super().__init__(entry, start, buf[:length], fetcher.workers.data, tier1=True)
        self.pooled = buf
        self.kept = False  # the landed parts own `pooled`
        self._landed_parts = fetcher.landed

    def _deliver(self) -> None:
        a, b = self.start, self.start + len(self._buf)
        try:
            self.entry.serve.store(a, self._buf)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # Fetched, but tier 1 has no room: the bytes serve from memory.
            self._keep(a, b)
            raise NoRoom(self.entry.key) from exc
        self._keep(a, b)

    def _keep(self, a: int, b: int) -> None:
        self._landed_parts.land(self.entry, a, b, self.pooled)
        self.kept = True


class _MemorySink(_PartSink):
    """A unit read through memory: into a pooled part buffer, kept in memory, never
    written to tier 1."""

    def __init__(self, fetcher: Fetcher, entry: Entry, start: int, buf: memoryview,
                 length: int) -> None:
        super().__init__(fetcher, entry, start, buf, length)
        self._tier1 = False

    def _deliver(self) -> None:
        self._keep(self.start, self.start + len(self._buf))


class _OwnSink(_Sink):
    """Bytes in memory of their own size (a small object, the pages of a small read),
    put into tier 1 by `put`: a full cache disk is NoRoom (read through)."""

    def __init__(self, entry: Entry, start: int, length: int,
                 run: Callable[..., Awaitable[Any]], put: Callable[[int, memoryview], None],
                 *, tier1: bool) -> None:
        super().__init__(entry, start, memoryview(bytearray(length)), run, tier1=tier1)
        self._put = put

    def _deliver(self) -> None:
        try:
            self._put(self.start, self._buf)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise NoRoom(self.entry.key) from exc
            raise


class _Had(Exception):
    """Tier 1 holds the object already: nothing fetched."""


class _WholeSink:
    """A whole object fetched ahead of its reader, with no entry open: into a new
    tier-1 file (`Cache.whole_fill`), made in the worker thread that has the
    bytes. Its first worker call looks first: an object tier 1 has is not
    fetched (`_Had`)."""

    def __init__(self, cache: Cache, info: ObjectInfo, run: Callable[..., Awaitable[Any]]) -> None:
        self.landed = False
        self._cache = cache
        self._info = info
        self._run = run
        self._buf: memoryview | None = None
        self._looked = False

    def buffer(self) -> memoryview:
        if self._buf is None:
            self._buf = memoryview(bytearray(self._info.size))  # zeroed: in a worker
        return self._buf

    def land(self) -> None:
        if self.landed:
            return
        self.landed = True
        buf, cs = self.buffer(), self._cache.chunk_size
        digests = [xxhash.xxh3_64_digest(buf[o : o + cs]) for o in range(0, len(buf), cs)]
        with self.tier1(0, len(buf)) as fill:
            pwrite_all(fill.fd, buf, 0)
            fill.commit(digests)

    def tier1(self, start: int, end: int) -> AbstractContextManager[Tier1Fill]:
        info = self._info
        if (start, end) != (0, info.size):
            raise ValueError("a whole object's fill takes the whole object")
        return self._cache.whole_fill(info.key, info.etag, info.mtime, info.size)

    async def worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(self._unless_had, fn, *args)

    def _unless_had(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._looked:
            self._looked = True
            known = self._cache.lookup(self._info.key)
            if known is not None and known.etag == self._info.etag and known.cached_bytes == self._info.size:
                raise _Had(self._info.key)
        return fn(*args)


class Fetcher:
    def __init__(
        self,
        sources: Sequence[Source],
        workers: Workers,
        nursery: trio.Nursery,
        *,
        cache: Cache,
        budget: MemoryBudget,
        parts: BufferPool,
        landed: LandedParts,
        bodies: Bodies,
        waste: WasteCaps,
        unit: int,
        whole_max: int,
        learned: Learned,
    ) -> None:
        self.sources = list(sources)
        self.workers = workers
        self.nursery = nursery
        self.cache = cache
        self.budget = budget
        self.parts = parts  # part buffers (taken from the budget)
        self.landed = landed
        self.bodies = bodies
        self.waste = waste
        self.unit = unit  # the largest part fetch (chunks), and the through-memory unit
        self.whole_max = whole_max
        self.learned = learned
        self.chunks: SingleFlight[ChunkKey] = SingleFlight()
        self.pages: SingleFlight[ChunkKey] = SingleFlight()
        self.memory: SingleFlight[ChunkKey] = SingleFlight()
        self.objects: SingleFlight[str] = SingleFlight()

    # -- what readers ask for ----------------------------------------------------

    async def ensure(self, entry: Entry, start: int, end: int, *, in_parts: bool) -> bool:
        """Make [start, end) present in tier 1 (`in_parts`: in whole parts); True
        if anything had to be fetched."""
        fetched = False
        while True:
            missing = entry.serve.missing(start, end)
            if not missing:
                return fetched
            fetched = True
            waits: list[Flight] = []
            if in_parts:
                missing = self.widen(entry, missing)
            for a, b in missing:
                for pa, pb, flight, owner in self.claim(entry, a, b):
                    if owner:
                        self.nursery.start_soon(self.fetch_part, entry, pa, pb, flight)
                    waits.append(flight)
            await wait_all(waits)

    async def ensure_pages(self, entry: Entry, start: int, end: int) -> bool:
        """Make the pages of [start, end) servable by `Serving.read_pages`, fetching only
        the missing pages (or waiting for a chunk fetch already covering them)."""
        fetched = False
        ident = id(entry)
        cs = entry.chunk_size
        while True:
            missing = entry.serve.missing_pages(start, end)
            if not missing:
                return fetched
            fetched = True
            waits: list[Flight] = []
            for a, b in missing:
                run: int | None = None
                for p in range(a // PAGE, -(-b // PAGE)):
                    other = self.chunks.get((ident, p * PAGE // cs)) or self.pages.get((ident, p))
                    if other is None:
                        if run is None:
                            run = p
                        continue
                    if run is not None:
                        waits.append(self._start_pages(entry, run, p))
                        run = None
                    if other not in waits:
                        waits.append(other)
                if run is not None:
                    waits.append(self._start_pages(entry, run, -(-b // PAGE)))
            await wait_all(waits)

    def prefetch(self, entry: Entry, start: int, end: int) -> None:
        """Start background fetches of every part of [start, end) not present or in flight."""
        if start >= end:
            return
        for a, b in self.widen(entry, entry.serve.missing(start, end)):
            for pa, pb, flight, owner in self.claim(entry, a, b):
                if owner:
                    self.nursery.start_soon(self.fetch_part, entry, pa, pb, flight)

    def through_memory(self, entry: Entry, pos: int) -> Flight:
        """A GET of the unit holding `pos` into memory (landed parts, never tier 1);
        joins one in flight."""
        a = pos - pos % self.unit
        b = min(a + self.unit, entry.size)
        return self.memory.join(
            (id(entry), a // self.unit),
            lambda flight: self.nursery.start_soon(self._fetch_memory, entry, a, b, flight),
        )

    async def fetch_whole(self, info: ObjectInfo) -> tuple[bool, memoryview | None]:
        """Fetch a whole small object into tier 1 ahead of its reader (walkahead.py),
        with no entry open: whether it was fetched (False: tier 1 had it, or a
        fetch of it in flight was joined), and its bytes where they came through
        memory. One worker hop and one index transaction with the store's own
        GETs: a fetch ahead of a walk through 10,000 small objects once took
        three hops (an open, the reader's fetch, a release) and three
        transactions, together more of the daemon's CPU than the GET (issue 21).
        Raises what the fetch failed with."""
        flight = self.objects.get(info.key)
        if flight is not None:
            await flight.wait()
            return False, None
        flight = self.objects.claim((info.key,))
        try:
            await self.budget.take(info.size)
        except BaseException:
            self.objects.land(flight, _cancelled())
            raise
        sink = _WholeSink(self.cache, info, self.workers.small)
        try:
            got = await self.objects.fly(
                flight, partial(self._from_sources, Want(info.key, info.etag, info.size, 0, info.size), sink))
        finally:
            self.budget.give(info.size)
        if isinstance(flight.error, _Had):
            return False, None
        if got is None:
            assert flight.error is not None
            raise flight.error
        self._learn(info.key, got)
        return True, None if got.in_tier1 else sink.buffer()

    # -- claims ------------------------------------------------------------------

    def widen(self, entry: Entry, missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Missing ranges grown to whole parts, minus what is already present: the
        alignment must never fetch a chunk again (a herd would pay for it)."""
        p = self.unit
        out: list[tuple[int, int]] = []
        for a, b in missing:
            a, b = (a // p) * p, min(-(-b // p) * p, entry.size)
            if out and a < out[-1][1]:
                a = out[-1][1]
            if a < b:
                out.extend(entry.serve.missing(a, b))
        return out

    def claim(self, entry: Entry, a: int, b: int) -> list[tuple[int, int, Flight, bool]]:
        """Split [a, b) into pieces of at most a unit: runs of chunks nobody is
        fetching get a new flight (owner=True: the caller starts `fetch_part`);
        chunks already in flight are answered with that flight (owner=False)."""
        cs = entry.chunk_size
        ident = id(entry)
        per_part = max(1, self.unit // cs)
        first, last = a // cs, -(-b // cs)
        runs: list[tuple[int, int]] = []  # [start, end) chunk runs to claim
        out: list[tuple[int, int, Flight, bool]] = []
        run_start: int | None = None
        for c in range(first, last):
            existing = self.chunks.get((ident, c))
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
            flight = self.chunks.claim((ident, c) for c in range(c0, c1))
            out.append((c0 * cs, min(c1 * cs, entry.size), flight, True))
        if runs:
            self.waste.claimed(entry, runs)
        return out

    # -- the fetches ---------------------------------------------------------------

    async def fetch_part(self, entry: Entry, a: int, b: int, flight: Flight) -> None:
        """The fetch of a claimed part (chunks [a, b)) into tier 1."""
        if entry.size <= self.whole_max:
            await self._fetch_small(entry, a, b, flight)
            return
        try:
            buf = await self.parts.take(b - a)
        except BaseException:
            self.chunks.land(flight, _cancelled())
            raise
        sink = _PartSink(self, entry, a, buf, b - a)
        try:
            got = await self.chunks.fly(flight, partial(self._from_sources, _want(entry, a, b), sink))
        finally:
            if not sink.kept:
                self.parts.give(buf)
        self._learn(entry.key, got)

    async def _fetch_small(self, entry: Entry, a: int, b: int, flight: Flight) -> None:
        """A small object's bytes into memory of their own size (a part buffer would
        hold part_size of the budget for 100 KB), then into tier 1; offered to
        its reader (bodies.py) when they are the whole object."""
        try:
            await self.budget.take(b - a)
        except BaseException:
            self.chunks.land(flight, _cancelled())
            raise
        sink = _OwnSink(entry, a, b - a, self.workers.small, entry.serve.store, tier1=True)
        try:
            got = await self.chunks.fly(flight, partial(self._from_sources, _want(entry, a, b), sink))
        finally:
            self.budget.give(b - a)
        if got is None:
            return
        self._learn(entry.key, got)
        if not got.in_tier1 and a == 0 and b == entry.size and entry.state == "clean":
            self.bodies.offer(entry.key, entry.etag, sink.buffer())

    def _start_pages(self, entry: Entry, p0: int, p1: int) -> Flight:
        ident = id(entry)
        flight = self.pages.claim((ident, p) for p in range(p0, p1))
        self.nursery.start_soon(self._fetch_pages, entry, p0 * PAGE, min(p1 * PAGE, entry.size), flight)
        return flight

    async def _fetch_pages(self, entry: Entry, a: int, b: int, flight: Flight) -> None:
        """Pages into memory of their own size, then into tier 1 through the page cache:
        an O_DIRECT write would wait for the device with the fetch slot held (a 100
        KiB object: 1,431 vs 658 us, bench/tier1cost.py, 10,000 objects, median of 3)."""
        try:
            await self.budget.take(b - a)
        except BaseException:
            self.pages.land(flight, _cancelled())
            raise
        sink = _OwnSink(entry, a, b - a, self.workers.data, entry.serve.store_pages, tier1=False)
        try:
            got = await self.pages.fly(flight, partial(self._from_sources, _want(entry, a, b), sink))
        finally:
            self.budget.give(b - a)
        self._learn(entry.key, got)

    async def _fetch_memory(self, entry: Entry, a: int, b: int, flight: Flight) -> None:
        if self.landed.holds(entry, a, b):  # fetched meanwhile
            self.memory.land(flight)
            return
        try:
            buf = await self.parts.take(b - a)
        except BaseException:
            self.memory.land(flight, _cancelled())
            raise
        sink = _MemorySink(self, entry, a, buf, b - a)
        try:
            got = await self.memory.fly(flight, partial(self._from_sources, _want(entry, a, b), sink))
        finally:
            if not sink.kept:
                self.parts.give(buf)
        self._learn(entry.key, got)

    async def _from_sources(self, want: Want, sink: _Sink | _WholeSink) -> Got:
        """Ask the sources; bytes a source left in memory are landed (in a worker hop
        of their own: the store's source lands them in its own)."""
        got = await ask(self.sources, want, sink)
        if not got.in_tier1 and not sink.landed:
            await sink.worker(sink.land)
        return got

    def _learn(self, key: str, got: Got | None) -> None:
        """What a response said of the object goes up (on the trio loop)."""
        if got is not None and got.metadata:
            self.learned(key, got.etag, got.metadata)


def _want(entry: Entry, a: int, b: int) -> Want:
    return Want(entry.key, entry.etag, entry.size, a, b)


def _cancelled() -> OSError:
    return OSError(errno.EIO, "fetch cancelled: daemon stopping")
