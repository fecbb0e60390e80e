"""Read path (DESIGN §3): tier 1 first, then coalesced ranged GETs, with readahead.

A fetch receives a ranged GET's body into a reused, aligned part buffer
(never the whole object in RAM) and writes it to the tier-1 sparse file with
O_DIRECT (cache/directio.py). The part buffer then stays in memory for a
while (landed.py): a read of bytes that just landed is a memcpy from it;
any other read comes out of tier 1 (O_DIRECT again for a clean object, so
tier 1 never doubles the kernel's own page cache of the mount).

Single-flight: every chunk (and every page of a small read) being fetched has
one owner; any other reader (or readahead) that needs it waits on the owner's
event, so N readers of a cold chunk cause one GET.

Readahead follows the streams of streams.py: a read with a window keeps up
to `max_parallel_gets` part-sized GETs in flight ahead of it. A read with no
window fetches only what it touches: whole chunks for a big read, just its
4 KiB pages for a small one (`Entry.store_pages`), so a random 4 KiB read
costs about 4 KiB from the store. Small objects are objects, not pages: any
read of one up to `whole_object_max` (an image, a clip, a JSON file) fetches
it whole into tier 1 with its checksum, into a buffer of its own size, so it
is counted, kept across remounts and evicted like any object.

Model-like files get `prefetch_object`: one background task walks the object
in order with a bounded number of parts in flight, so reads that need other
parts are never queued behind the whole object.

A small tier 1 must not turn into a store storm (a 32 MiB cache once fetched
9x the bytes read of a 200 MiB file; a 64 MiB cache disk, over 200 GiB).
So: a read pins the chunks it waits for (eviction never sheds them before it
is served); fetches come in units of at most 1/8 of the cache and readahead
reaches at most 1/4 of it ahead; readahead of an object nobody holds open any
more is dropped. A chunk fetched and evicted again before any read used it is
waste: each waste halves that object's readahead, and once none is left its
reads are served from memory through the store without caching (one warning
line); likewise when the cache disk is full (ENOSPC).
"""

from __future__ import annotations

import errno
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import trio

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import ChunkCorrupt, Entry
from tierfs.cache.directio import ALIGN
from tierfs.cache.objects import PAGE
from tierfs.read.bodies import Bodies, Body
from tierfs.read.landed import LandedParts
from tierfs.read.streams import SMALL_READ, Fronts, ReadState
from tierfs.store.base import Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)
T = TypeVar("T")

SIZE_LOG_AFTER = 1024  # log the FUSE read size histogram once, after this many reads
SERVE_BUFFER = (1 << 20) + 2 * ALIGN  # a 1 MiB FUSE read at any offset, aligned for O_DIRECT
UNIT_SHARE = 8  # a fetch unit is at most 1/UNIT_SHARE of the cache...
AHEAD_SHARE = 4  # ...and readahead reaches at most 1/AHEAD_SHARE of it ahead
WASTE_QUIET = 30.0  # seconds without waste before an object's readahead is restored


class _NoRoom(OSError):
    """Tier 1 could not take fetched bytes (its disk is full); the caller reads
    through memory instead."""

    def __init__(self, key: str) -> None:
        super().__init__(errno.ENOSPC, f"{key!r}: no room in tier 1 for fetched bytes")


class _Abandoned(Exception):
    """A readahead fetch of an object nobody holds open any more: not made."""


@dataclass
class _Use:
    """How tier 1 keeps up with one open object's reads."""

    unserved: bytearray  # per chunk: 1 = fetched, not yet served (fetching it again is waste)
    cap: int  # bytes of readahead allowed; each waste cuts it to a quarter
    through: bool = False  # reads come through memory, not tier 1
    last_waste: float = -math.inf


class _Flight:
    """One in-flight fetch; waiters learn its outcome."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class Reader:
    """Every buffer it holds comes from the memory budget: part buffers (`parts`,
    part_size each: GETs in flight, landed, staged), reply buffers of big reads
    (`serve`, SERVE_BUFFER each) and the bytes of small page reads."""

    def __init__(
        self,
        store: Store,
        workers: Workers,
        nursery: trio.Nursery,
        *,
        budget: MemoryBudget,
        parts: BufferPool,
        serve: BufferPool,
        part_size: int,
        readahead_min: int,
        cache_capacity: int,
        chunk_size: int,
        observe_read: Callable[[str, int], None],
        prefetch_parallel: int,
        landed_bytes: int,
        whole_object_max: int,
        bodies: Bodies | None = None,
    ) -> None:
        self.store = store
        # Small objects' bytes in memory between their fetch (or their open's
        # tier-1 load) and their read: served with no worker hop (bodies.py).
        self.bodies = bodies if bodies is not None else Bodies(budget, 0)
        self.workers = workers
        self.nursery = nursery
        self.budget = budget
        self.part_size = part_size
        self.capacity = cache_capacity
        # The fetch unit (parts and readahead are counted in it) and the furthest
        # readahead: small enough that a reader's chunks, the ones landing and
        # those ahead fit in the cache together.
        fit = cache_capacity // UNIT_SHARE // chunk_size * chunk_size
        self.unit = max(chunk_size, min(part_size, fit))
        self.ahead_max = cache_capacity // AHEAD_SHARE
        self.readahead_min = readahead_min
        self.observe_read = observe_read
        self.prefetch_parallel = max(1, prefetch_parallel)
        self.whole_max = whole_object_max
        # (entry identity, chunk index) -> flight fetching it
        self._flights: dict[tuple[int, int], _Flight] = {}
        # (entry identity, page index) -> flight fetching that page for a small read
        self._page_flights: dict[tuple[int, int], _Flight] = {}
        self._prefetching: set[int] = set()  # entries with a prefetch_object running
        self._part_buffers = parts
        self._serve_buffers = serve
        self._landed = LandedParts(parts, landed_bytes)
        self._staging: set[tuple[int, int]] = set()  # (entry identity, part start) loading
        self._fronts = Fronts(landed_bytes)
        self.request_sizes: Counter[int] = Counter()  # FUSE read sizes seen (KiB, rounded up)
        self._reads = 0
        self._uses: weakref.WeakKeyDictionary[Entry, _Use] = weakref.WeakKeyDictionary()
        self._mem_flights: dict[tuple[int, int], _Flight] = {}  # (entry, unit) -> GET to memory
        self._warned_through = False
        self.wasted_bytes = 0  # fetched, then evicted before any read used them

    # -- serving ---------------------------------------------------------------

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, readahead_max: int
    ) -> bytes | memoryview:
        """The bytes of [off, off+size) clipped at EOF, fetched into tier 1 first.

        A big read returns a view of a pooled buffer that is back in the pool when
        this returns: the caller must hand it to the kernel before the trio loop
        runs anything else (pyfuse3 replies right after `read` returns, with no
        await in between). Buffers are only taken on the trio thread, so no
        worker can be filling it meanwhile."""
        self._count_request(size)
        end = min(off + size, entry.size)
        if off >= end:
            return b""
        body = self._body(entry)
        if body is not None:
            if end >= entry.size:  # its last bytes: a reader reads a small file once
                self.bodies.drop(entry.key, entry.etag)
            self.bodies.served += 1
            self.observe_read("cache", end - off)
            return memoryview(body)[off:end]
        use = self._use(entry)
        if use is not None:
            readahead_max = min(readahead_max, use.cap)
        window = state.advance(off, end, self.readahead_min, readahead_max)
        if window:
            self._fronts.note(entry, end, window)
        else:
            window = self._fronts.follow(entry, off, end, self.readahead_min, readahead_max)
        if use is not None and use.through:
            through = await self._through(entry, off, end, window)
            self.observe_read("store", len(through))
            return through
        whole = self.is_whole(entry)
        small = not whole and not window and end - off <= SMALL_READ and _pages_ok(entry)
        with entry.holding(off, end):
            try:
                data, fetched = await self._read_cached(entry, off, end, window, small, whole)
            except _NoRoom:
                self._go_through(entry, "the cache disk is full")
                fetched = True
                data = await self._through(entry, off, end, window)
        if use is not None:
            lo, hi = off // entry.chunk_size, (end - 1) // entry.chunk_size + 1
            use.unserved[lo:hi] = bytes(hi - lo)
        self.observe_read("store" if fetched else "cache", len(data))
        return data

    def _body(self, entry: Entry) -> Body | None:
        """The bytes of a clean small object kept in memory (bodies.py), if any."""
        if entry.size > self.whole_max or entry.state != "clean" or not self.bodies:
            return None
        body = self.bodies.get(entry.key, entry.etag)
        return body if body is not None and len(body) == entry.size else None

    def is_whole(self, entry: Entry) -> bool:
        """A small object: fetched whole by any read of it."""
        return entry.size <= self.whole_max and entry.state == "clean"

    async def _read_cached(
        self, entry: Entry, off: int, end: int, window: int, small: bool, whole: bool
    ) -> tuple[bytes | memoryview, bool]:
        """[off, end) through tier 1 (its chunks are held by the caller); the bytes,
        and whether any had to be fetched."""
        if whole:
            fetched = await self.ensure(entry, 0, entry.size, whole_parts=False)
            body = self._body(entry)  # this fetch's bytes (or a fetch ahead's)
            if body is not None:
                if end >= entry.size:
                    self.bodies.drop(entry.key, entry.etag)
                self.bodies.served += 1
                return memoryview(body)[off:end], fetched
        elif small:
            fetched = await self.ensure_pages(entry, off, end)
        else:
            fetched = await self.ensure(entry, off, end, whole_parts=window > 0)
        if window:
            self.prefetch(entry, end, min(end + window, entry.size))
        for _ in range(3):
            # The reply buffer is held only while serving, never while fetching:
            # a fetch waiting for memory must not wait on buffers of reads that
            # wait for fetches.
            buf = None if small else await self._serve_buffers.take(end - off + 2 * ALIGN)
            try:
                return await self._serve(entry, off, end, buf, window=window, fetched=fetched), fetched
            except ChunkCorrupt as exc:
                log.warning("cache chunk(s) %s of %r failed checksum: refetching", exc.chunks, entry.key)
            except KeyError:
                pass  # chunks given up to eviction between fetch and read (tiny cache)
            finally:
                if buf is not None:
                    self._serve_buffers.give(buf)
            if small:
                fetched = await self.ensure_pages(entry, off, end) or fetched
            else:
                fetched = await self.ensure(entry, off, end, whole_parts=False) or fetched
        raise OSError(errno.EIO, "cache keeps returning corrupt data")

    # -- a tier 1 too small or full: reads through memory ----------------------

    def _use(self, entry: Entry) -> _Use | None:
        """The object's tier-1 use record (clean objects only: local writes are
        never fetched); a quiet object gets its readahead back."""
        if entry.state != "clean":
            return None
        use = self._uses.get(entry)
        if use is None:
            use = self._uses[entry] = _Use(
                bytearray(-(-entry.size // entry.chunk_size)), self.ahead_max
            )
        elif use.cap < self.ahead_max and time.monotonic() - use.last_waste > WASTE_QUIET:
            use.cap, use.through = self.ahead_max, False
        return use

    def _wasted(self, entry: Entry, chunks: int) -> None:
        """Chunks fetched before and evicted unread are being fetched again."""
        use = self._uses.get(entry)
        if use is None:
            return
        self.wasted_bytes += chunks * entry.chunk_size
        use.last_waste = time.monotonic()
        use.cap //= 4
        log.debug("%r: %d chunk(s) evicted unread; readahead now %d bytes",
                  entry.key, chunks, use.cap)
        if use.cap < entry.chunk_size:
            self._go_through(entry, f"tier 1 ({self.capacity >> 20} MiB) cannot hold what is being read")

    def _go_through(self, entry: Entry, why: str) -> None:
        use = self._use(entry)
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

    async def _through(self, entry: Entry, off: int, end: int, window: int) -> memoryview:
        """[off, end) copied out of unit GETs into memory (landed parts), never
        written to tier 1; with a window, the next unit is fetched meanwhile. The
        reply buffer is taken once the bytes are in memory (never held while
        waiting for a fetch), and is back in the pool when this returns (see read)."""
        for _ in range(4):
            pos = off
            while pos < end:
                part = self._landed.pin(entry, pos, pos + 1)
                if part is None:
                    await _wait_all([self._start_memory(entry, pos)])
                    continue
                pos = part.end
                self._landed.unpin(part)
            buf = await self._serve_buffers.take(end - off + 2 * ALIGN)
            try:
                if self._copy_landed(entry, off, end, buf):
                    ahead = ((end - 1) // self.unit + 1) * self.unit
                    if window and ahead < entry.size:
                        self._start_memory(entry, ahead)
                    return buf[: end - off]
            finally:
                self._serve_buffers.give(buf)
        raise OSError(errno.EIO, f"{entry.key!r}: fetched bytes left memory unread")

    def _copy_landed(self, entry: Entry, off: int, end: int, buf: memoryview) -> bool:
        """Copy [off, end) out of landed parts into `buf`; False if a part is gone."""
        pos = off
        while pos < end:
            part = self._landed.pin(entry, pos, pos + 1)
            if part is None:
                return False
            stop = min(end, part.end)
            self._landed.copy_out(part, pos, stop, buf[pos - off :])
            pos = stop
        return True

    def _start_memory(self, entry: Entry, pos: int) -> _Flight:
        """A GET of the unit holding `pos` into memory; joins one in flight."""
        a = pos - pos % self.unit
        key = (id(entry), a // self.unit)
        flight = self._mem_flights.get(key)
        if flight is None:
            flight = self._mem_flights[key] = _Flight()
            b = min(a + self.unit, entry.size)
            self.nursery.start_soon(self._fetch_memory, entry, a, b, flight)
        return flight

    async def _fetch_memory(self, entry: Entry, a: int, b: int, flight: _Flight) -> None:
        try:
            buf = await self._part_buffers.take(b - a)
        except BaseException:
            self._settle(flight, entry, a, b, self._mem_flights, self.unit,
                         OSError(errno.EIO, "fetch cancelled: daemon stopping"))
            raise
        await self._fly(partial(self._get_into_memory, buf), entry, a, b, flight,
                        self._mem_flights, self.unit)

    def _get_into_memory(self, buf: memoryview, entry: Entry, a: int, b: int) -> None:
        if entry.closed or self._landed.holds(entry, a, b):
            self._part_buffers.give(buf)
            if entry.closed:
                raise _Abandoned(entry.key)
            return
        try:
            n = self.store.get_range_into(entry.key, a, b - a, buf[: b - a], entry.etag)
            if n != b - a:
                raise StoreError(f"short read of {entry.key!r}: {n} of {b - a} bytes")
        except BaseException:
            self._part_buffers.give(buf)
            raise
        self._landed.land(entry, a, b, buf)

    async def _serve(
        self, entry: Entry, off: int, end: int, buf: memoryview | None, *, window: int, fetched: bool
    ) -> bytes | memoryview:
        """One attempt at answering [off, end): a small read from tier 1's pages, a
        big one (into `buf`) from landed memory or else from tier 1."""
        if buf is None:
            if not fetched and entry.servable_now(off, end):
                # A few KiB from tier 1 with nothing to verify: cheaper on the loop
                # than a thread hop (warm random 4 KiB reads: ~1,350 -> ~3,800
                # reads/s in bench/randread.py). Anything more (a chunk's first
                # verification: a 1 MiB hash and an index read) goes to a worker.
                return entry.read_pages(off, end - off)
            return await self.workers.disk(entry.read_pages, off, end - off)
        part = self._landed.pin(entry, off, end)
        if part is not None:
            stage = part.staged  # read before copy_out unpins it
            # Fetched or staged moments ago: one memcpy (under the GIL either way, so inline).
            data: bytes | memoryview = self._landed.copy_out(part, off, end, buf)
        else:
            data = await self.workers.disk(entry.read_into, off, end - off, buf)
            stage = not fetched
        if window and stage:
            # A sequential reader of tier 1 (not of bytes that just landed from the
            # store, nor of ones it waited for) gets what follows loaded ahead, and
            # keeps getting it while it reads the staged parts.
            self._stage(entry, end, min(end + window, entry.size))
        return data

    def _count_request(self, size: int) -> None:
        self.request_sizes[-(-size // 1024)] += 1
        self._reads += 1
        if self._reads == SIZE_LOG_AFTER:
            top = ", ".join(f"{k} KiB x{n}" for k, n in self.request_sizes.most_common(4))
            log.info("FUSE read sizes (first %d reads): %s", self._reads, top)

    # -- fetching ----------------------------------------------------------------

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
            if whole_parts:
                missing = self._widen(entry, missing)
            for a, b in missing:
                for pa, pb, flight, owner in self._claim(entry, a, b):
                    if owner:
                        self.nursery.start_soon(self._fetch, entry, pa, pb, flight)
                    waits.append(flight)
            await _wait_all(waits)

    async def ensure_pages(self, entry: Entry, start: int, end: int) -> bool:
        """Make the pages of [start, end) servable by `Entry.read_pages`, fetching only
        the missing pages (or waiting for a chunk fetch already covering them)."""
        fetched = False
        ident = id(entry)
        cs = entry.chunk_size
        while True:
            missing = entry.missing_pages(start, end)
            if not missing:
                return fetched
            fetched = True
            waits: list[_Flight] = []
            for a, b in missing:
                run: int | None = None
                for p in range(a // PAGE, -(-b // PAGE)):
                    other = self._flights.get((ident, p * PAGE // cs)) or self._page_flights.get(
                        (ident, p)
                    )
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
            await _wait_all(waits)

    def _start_pages(self, entry: Entry, p0: int, p1: int) -> _Flight:
        flight = _Flight()
        ident = id(entry)
        for p in range(p0, p1):
            self._page_flights[(ident, p)] = flight
        self.nursery.start_soon(self._fetch_pages, entry, p0, p1, flight)
        return flight

    async def _fetch_pages(self, entry: Entry, p0: int, p1: int, flight: _Flight) -> None:
        a, b = p0 * PAGE, min(p1 * PAGE, entry.size)
        await self.budget.take(b - a)
        try:
            await self._fly(self._get_and_store_pages, entry, a, b, flight, self._page_flights, PAGE)
        finally:
            self.budget.give(b - a)

    def _get_and_store_pages(self, entry: Entry, a: int, b: int) -> None:
        _into_tier1(entry, entry.store_pages, a, self._get_own(entry, a, b))

    def _get_own(self, entry: Entry, a: int, b: int) -> memoryview:
        """[a, b) of the object in memory of its own size (taken from the budget by
        the caller). Unaligned: tier 1 writes it through the page cache, as an
        O_DIRECT write would wait for the device with the fetch slot held (a 100
        KiB object: 1,431 vs 658 us, bench/tier1cost.py, 10,000 objects, median of 3)."""
        buf = memoryview(bytearray(b - a))
        n = self.store.get_range_into(entry.key, a, b - a, buf, entry.etag)
        if n != b - a:
            raise StoreError(f"short read of {entry.key!r}: {n} of {b - a} bytes")
        return buf

    def prefetch(self, entry: Entry, start: int, end: int) -> None:
        """Start background fetches of every part of [start, end) not present or in flight."""
        if start >= end:
            return
        for a, b in self._widen(entry, entry.missing(start, end)):
            for pa, pb, flight, owner in self._claim(entry, a, b):
                if owner:
                    self.nursery.start_soon(self._fetch, entry, pa, pb, flight)

    def _stage(self, entry: Entry, start: int, end: int) -> None:
        """Ahead of a sequential reader of bytes already in tier 1, load the next
        parts into memory with one large O_DIRECT read each: the 1 MiB requests
        that follow are then memcpys instead of a device round trip apiece.
        At most half the landed memory is used ahead of any one stream."""
        if entry.state != "clean":
            return
        p = self.unit
        stop = min(end, start + self._landed.capacity // 2)
        for pa in range(start - start % p, stop, p):
            pb = min(pa + p, entry.size)
            key = (id(entry), pa)
            if key in self._staging or not entry.present(pa, pb) or self._landed.holds(entry, pa, pb):
                continue
            self._staging.add(key)
            self.nursery.start_soon(self._stage_part, entry, pa, pb)

    async def _stage_part(self, entry: Entry, a: int, b: int) -> None:
        try:
            buf = self._part_buffers.take_now(b - a)  # optional work: only with memory to spare
            if buf is not None:
                await self.workers.disk(self._load_part, buf, entry, a, b)
        except Exception as exc:  # the read needing these bytes reads tier 1 itself
            log.debug("staging [%d, %d) of %r: %s", a, b, entry.key, exc)
        finally:
            self._staging.discard((id(entry), a))

    def _load_part(self, buf: memoryview, entry: Entry, a: int, b: int) -> None:
        try:
            if len(entry.read_into(a, b - a, buf)) != b - a:  # aligned `a`: lands at buf[0]
                raise KeyError(f"{entry.key!r}: short tier-1 read")
        except BaseException:
            self._part_buffers.give(buf)
            raise
        self._landed.land(entry, a, b, buf, staged=True)

    def prefetching(self, entry: Entry) -> bool:
        return id(entry) in self._prefetching

    def prefetch_object(
        self, entry: Entry, done: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Fetch the whole object into tier 1 in the background, in order, with at most
        `prefetch_parallel` parts in flight (reads of other parts are not queued
        behind it). `done` runs at the end (e.g. to release the entry it holds).
        An object larger than half the cache is not fetched whole: it would evict itself."""
        if entry.size > self.capacity // 2:
            log.debug("not prefetching %r: larger than half of tier 1", entry.key)
            self.nursery.start_soon(self._done, done)
            return
        self._prefetching.add(id(entry))
        self.nursery.start_soon(self._prefetch_object, entry, done)

    @staticmethod
    async def _done(done: Callable[[], Awaitable[None]] | None) -> None:
        """Run a prefetch's end callback; what it fails with (say, a full cache disk
        while releasing) is logged, never the end of the daemon's nursery."""
        if done is None:
            return
        with trio.CancelScope(shield=True):
            try:
                await done()
            except Exception as exc:
                log.warning("ending a prefetch: %s", exc)

    async def _prefetch_object(
        self, entry: Entry, done: Callable[[], Awaitable[None]] | None
    ) -> None:
        started = time.monotonic()
        try:
            async with trio.open_nursery() as n:
                slots = trio.Semaphore(self.prefetch_parallel)
                for pa in range(0, entry.size, self.unit):
                    pb = min(pa + self.unit, entry.size)
                    use = self._uses.get(entry)
                    if use is not None and use.cap < self.ahead_max:
                        raise OSError(errno.ENOSPC, "tier 1 cannot hold it (chunks evicted unread)")
                    if not entry.missing(pa, pb):
                        continue
                    await slots.acquire()
                    miss = entry.missing(pa, pb)  # again: it may have arrived meanwhile
                    if not miss:
                        slots.release()
                        continue
                    claims = self._claim(entry, miss[0][0], miss[-1][1])
                    owned = [(x, y, f) for x, y, f, owner in claims if owner]
                    if not owned:
                        slots.release()
                        continue
                    n.start_soon(self._prefetch_parts, entry, owned, slots)
            log.info("prefetched %r (%d MiB) into tier 1 in %.1fs", entry.key,
                     entry.size >> 20, time.monotonic() - started)
        except Exception as exc:
            log.info("prefetch of %r stopped: %s", entry.key, exc)
        finally:
            self._prefetching.discard(id(entry))
            await self._done(done)

    async def _prefetch_parts(
        self, entry: Entry, owned: list[tuple[int, int, _Flight]], slots: trio.Semaphore
    ) -> None:
        try:
            for a, b, flight in owned:
                await self._fetch(entry, a, b, flight)
        finally:
            slots.release()

    def _align_parts(self, entry: Entry, a: int, b: int) -> tuple[int, int]:
        p = self.unit
        return (a // p) * p, min(-(-b // p) * p, entry.size)

    def _widen(self, entry: Entry, missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Missing ranges grown to whole parts, minus what is already present: the
        alignment must never fetch a chunk again (a herd would pay for it)."""
        out: list[tuple[int, int]] = []
        for a, b in missing:
            a, b = self._align_parts(entry, a, b)
            if out and a < out[-1][1]:
                a = out[-1][1]
            if a < b:
                out.extend(entry.missing(a, b))
        return out

    def _claim(self, entry: Entry, a: int, b: int) -> list[tuple[int, int, _Flight, bool]]:
        """Split [a, b) into pieces of at most a unit: runs of chunks nobody is
        fetching get a new flight (owner=True); chunks already in flight are
        answered with that flight (owner=False). Chunks fetched before and not
        served since are waste (see `_wasted`)."""
        cs = entry.chunk_size
        ident = id(entry)
        per_part = max(1, self.unit // cs)
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
        use = self._uses.get(entry)
        wasted = 0
        for c0, c1 in runs:
            flight = _Flight()
            for c in range(c0, c1):
                self._flights[(ident, c)] = flight
            out.append((c0 * cs, min(c1 * cs, entry.size), flight, True))
            if use is not None:
                wasted += use.unserved.count(1, c0, c1)
                use.unserved[c0:c1] = b"\1" * (c1 - c0)
        if wasted:
            self._wasted(entry, wasted)
        return out

    async def _fetch(self, entry: Entry, a: int, b: int, flight: _Flight) -> None:
        if entry.size <= self.whole_max:
            await self._fetch_small(entry, a, b, flight)
            return
        try:
            buf = await self._part_buffers.take(b - a)
        except BaseException:
            self._settle(flight, entry, a, b, self._flights, entry.chunk_size,
                         OSError(errno.EIO, "fetch cancelled: daemon stopping"))
            raise
        await self._fly(partial(self._get_and_store, buf), entry, a, b, flight, self._flights,
                        entry.chunk_size)

    async def _fetch_small(self, entry: Entry, a: int, b: int, flight: _Flight) -> None:
        """A small object's bytes into a buffer of their own size (a part buffer would
        hold part_size of the budget for 100 KB), then into tier 1; not kept in
        memory after (its reader reads tier 1)."""
        try:
            await self.budget.take(b - a)
        except BaseException:
            self._settle(flight, entry, a, b, self._flights, entry.chunk_size,
                         OSError(errno.EIO, "fetch cancelled: daemon stopping"))
            raise
        try:
            body = await self._fly(self._get_and_store_small, entry, a, b, flight, self._flights,
                                   entry.chunk_size, slots=self.workers.small)
        finally:
            self.budget.give(b - a)
        if isinstance(body, memoryview) and a == 0 and b == entry.size and entry.state == "clean":
            self.bodies.offer(entry.key, entry.etag, body)  # for its reader's read: no hop

    def _get_and_store_small(self, entry: Entry, a: int, b: int) -> memoryview:
        if entry.closed:
            raise _Abandoned(entry.key)
        body = self._get_own(entry, a, b)
        _into_tier1(entry, entry.store, a, body)
        return body

    async def _fly(
        self,
        fetch: Callable[[Entry, int, int], T],
        entry: Entry,
        a: int,
        b: int,
        flight: _Flight,
        table: dict[tuple[int, int], _Flight],
        unit: int,
        slots: Callable[..., Awaitable[T]] | None = None,
    ) -> T | None:
        """Run one fetch in a worker (a data slot unless `slots` says otherwise);
        waiters learn its outcome; its claims on `table` (units of `unit` bytes)
        are released whatever happens. What the fetch returned, None if it failed."""
        error: BaseException | None = None
        try:
            return await (slots or self.workers.data)(fetch, entry, a, b)
        except Exception as exc:
            error = _as_oserror(exc)
            return None
        except BaseException:
            error = OSError(errno.EIO, "fetch cancelled: daemon stopping")
            raise
        finally:
            self._settle(flight, entry, a, b, table, unit, error)

    @staticmethod
    def _settle(
        flight: _Flight, entry: Entry, a: int, b: int, table: dict[tuple[int, int], _Flight],
        unit: int, error: BaseException | None,
    ) -> None:
        flight.error = error
        ident = id(entry)
        for u in range(a // unit, -(-b // unit)):
            if table.get((ident, u)) is flight:
                del table[(ident, u)]
        flight.done.set()

    def _get_and_store(self, buf: memoryview, entry: Entry, a: int, b: int) -> None:
        if entry.closed:  # readahead for a reader that is gone
            self._part_buffers.give(buf)
            raise _Abandoned(entry.key)
        try:
            view = buf[: b - a]
            n = self.store.get_range_into(entry.key, a, b - a, view, entry.etag)
            if n != b - a:
                raise StoreError(f"short read of {entry.key!r}: {n} of {b - a} bytes")
            try:
                entry.store(a, view)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                # Fetched, but tier 1 has no room: the bytes serve from memory.
                self._landed.land(entry, a, b, buf)
                raise _NoRoom(entry.key) from exc
        except _NoRoom:
            raise
        except BaseException:
            self._part_buffers.give(buf)
            raise
        self._landed.land(entry, a, b, buf)


async def _wait_all(flights: list[_Flight]) -> None:
    for flight in flights:
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error


def _into_tier1(entry: Entry, put: Callable[[int, memoryview], None], a: int,
                buf: memoryview) -> None:
    """`put` fetched bytes into tier 1; a full cache disk is _NoRoom (read through)."""
    try:
        put(a, buf)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _NoRoom(entry.key) from exc
        raise


def _pages_ok(entry: Entry) -> bool:
    cs = entry.chunk_size
    return cs > PAGE and cs % PAGE == 0 and entry.state == "clean"


def _as_oserror(exc: BaseException) -> BaseException:
    if isinstance(exc, StoreError):
        return OSError(exc.errno, str(exc))
    return exc
