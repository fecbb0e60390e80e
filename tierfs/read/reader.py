"""Serving reads (DESIGN §3): tier 1 first, memory where the bytes just were,
the fetcher (fetcher.py) for what is missing, with readahead.

A big read (more than a few pages) is answered without Python copying its
bytes: a view of the part buffer they landed in from the store (or were
staged into ahead of a sequential reader of tier 1: `_stage`; landed.py), or
else a `FileRange` of the tier-1 file, which libfuse reads itself (spliced
from its page cache) once every chunk of it was checked by this process; a
chunk not checked yet is read into a buffer and verified first (its first
read). A small object (up to
`whole_max`: an image, a clip, a JSON file) is fetched whole into tier 1 by
any read of it and served from memory (bodies.py) when its bytes are there.

Readahead follows the streams of sequential.py: a read with a window keeps up
to `max_parallel_gets` part-sized GETs in flight ahead of it. A read with no
window fetches only what it touches: whole chunks for a big read, just its
4 KiB pages for a small one, so a random 4 KiB read costs about 4 KiB from
the store.

A read pins the chunks it waits for (eviction never sheds them before it is
served); readahead reaches at most a share of tier 1 ahead, and what a tier 1
too small throws away cuts it, down to reading through memory (waste.py).
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Callable

import trio

from tierfs.budget import BufferPool
from tierfs.cache import ChunkCorrupt, Entry
from tierfs.cache.chunkmap import PAGE
from tierfs.cache.directio import ALIGN
from tierfs.read.bodies import Body
from tierfs.read.fetcher import Fetcher, NoRoom
from tierfs.read.sequential import SMALL_READ, Fronts, ReadState
from tierfs.read.served import FileRange, Served
from tierfs.workers import Workers

log = logging.getLogger(__name__)


SIZE_LOG_AFTER = 1024  # log the FUSE read size histogram once, after this many reads
SERVE_BUFFER = (1 << 20) + 2 * ALIGN  # a 1 MiB FUSE read at any offset, aligned for O_DIRECT


class Reader:
    """Every buffer it holds comes from the memory budget: part buffers (`parts`:
    staged parts; the fetcher's GETs take theirs), reply buffers of big reads
    (`serve`, SERVE_BUFFER each) and the bytes of small page reads."""

    def __init__(
        self,
        fetcher: Fetcher,
        workers: Workers,
        nursery: trio.Nursery,
        *,
        serve: BufferPool,
        readahead_min: int,
        observe_read: Callable[[str, int], None],
        lend: bool = False,
    ) -> None:
        self.fetcher = fetcher
        self.lend = lend  # checked tier-1 bytes answered as FileRanges (fuse/splice.py)
        self.lent = 0  # reads answered from a tier-1 file (status: reads_lent)
        self.workers = workers
        self.nursery = nursery
        self.readahead_min = readahead_min
        self.observe_read = observe_read
        self.bodies = fetcher.bodies
        self.whole_max = fetcher.whole_max
        self.waste = fetcher.waste
        self._landed = fetcher.landed
        self._part_buffers = fetcher.parts
        self._serve_buffers = serve
        self._staging: set[tuple[int, int]] = set()  # (entry identity, part start) loading
        self._fronts = Fronts(self._landed.capacity)
        self.request_sizes: Counter[int] = Counter()  # FUSE read sizes seen (KiB, rounded up)
        self._reads = 0

    # -- serving ---------------------------------------------------------------

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, readahead_max: int
    ) -> Served:
        """The bytes of [off, off+size) clipped at EOF, fetched into tier 1 first.

        A big read returns a view of a pooled buffer that is back in the pool when
        this returns, or a FileRange: the caller must hand it to the kernel before
        the trio loop runs anything else (pyfuse3 replies right after `read`
        returns, with no await in between). Buffers are only taken on the trio
        thread, so no worker can be filling it meanwhile."""
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
        use = self.waste.use(entry)
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
        whole = self.fetched_whole(entry)
        small = not whole and not window and end - off <= SMALL_READ and _pages_ok(entry)
        with entry.holding(off, end):
            try:
                data, fetched = await self._read_cached(entry, off, end, window, small, whole)
            except NoRoom:
                self.waste.go_through(entry, "the cache disk is full")
                fetched = True
                data = await self._through(entry, off, end, window)
        self.waste.served(entry, off, end)
        self.observe_read("store" if fetched else "cache", end - off)
        return data

    def _body(self, entry: Entry) -> Body | None:
        """The bytes of a clean small object kept in memory (bodies.py), if any."""
        if entry.size > self.whole_max or entry.state != "clean" or not self.bodies:
            return None
        body = self.bodies.get(entry.key, entry.etag)
        return body if body is not None and len(body) == entry.size else None

    def fetched_whole(self, entry: Entry) -> bool:
        """A small object: fetched whole by any read of it."""
        return entry.size <= self.whole_max and entry.state == "clean"

    async def _read_cached(
        self, entry: Entry, off: int, end: int, window: int, small: bool, whole: bool
    ) -> tuple[Served, bool]:
        """[off, end) through tier 1 (its chunks are held by the caller); the bytes,
        and whether any had to be fetched."""
        if whole:
            fetched = await self.fetcher.ensure(entry, 0, entry.size, in_parts=False)
            body = self._body(entry)  # this fetch's bytes (or a fetch ahead's)
            if body is not None:
                if end >= entry.size:
                    self.bodies.drop(entry.key, entry.etag)
                self.bodies.served += 1
                return memoryview(body)[off:end], fetched
        elif small:
            fetched = await self.fetcher.ensure_pages(entry, off, end)
        else:
            fetched = await self.fetcher.ensure(entry, off, end, in_parts=window > 0)
        if window:
            self.fetcher.prefetch(entry, end, min(end + window, entry.size))
        for _ in range(3):
            lent = None if small else self._lend(entry, off, end, window)
            if lent is not None:
                return lent, fetched
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
                fetched = await self.fetcher.ensure_pages(entry, off, end) or fetched
            else:
                fetched = await self.fetcher.ensure(entry, off, end, in_parts=False) or fetched
        raise OSError(errno.EIO, "cache keeps returning corrupt data")

    # -- a tier 1 too small or full: reads through memory ----------------------

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
                    await self.fetcher.through_memory(entry, pos).wait()
                    continue
                pos = part.end
                self._landed.unpin(part)
            buf = await self._serve_buffers.take(end - off + 2 * ALIGN)
            try:
                if self._copy_landed(entry, off, end, buf):
                    unit = self.fetcher.unit
                    ahead = ((end - 1) // unit + 1) * unit
                    if window and ahead < entry.size:
                        self.fetcher.through_memory(entry, ahead)
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

    def _lend(self, entry: Entry, off: int, end: int, window: int) -> memoryview | FileRange | None:
        """A big read answered without copying: from the landed part holding it, or
        from the tier-1 file if every chunk of it was checked and is in the page
        cache (None: it must be read, and verified where not checked yet)."""
        view = self._from_landed(entry, off, end, window)
        if view is not None:
            return view
        lent = entry.serve.lend(off, end - off) if self.lend else None
        if lent is None:
            return None
        self.lent += 1
        return FileRange(lent[0], off, end - off, lent[1])

    def _from_landed(self, entry: Entry, off: int, end: int, window: int) -> memoryview | None:
        """A view of the landed part holding [off, end) (LandedParts.view), if any."""
        part = self._landed.pin(entry, off, end)
        if part is None:
            return None
        staged = part.staged  # read before view unpins it
        view = self._landed.view(part, off, end)
        if window and staged:
            self._stage(entry, end, min(end + window, entry.size))
        return view

    async def _serve(
        self, entry: Entry, off: int, end: int, buf: memoryview | None, *, window: int, fetched: bool
    ) -> bytes | memoryview:
        """One attempt at answering [off, end): a small read from tier 1's pages, a
        big one (into `buf`) from tier 1, verifying what this process has not
        checked yet."""
        if buf is None:
            if not fetched and entry.serve.servable_now(off, end):
                # A few KiB from tier 1 with nothing to verify: cheaper on the loop
                # than a thread hop (warm random 4 KiB reads: ~1,350 -> ~3,800
                # reads/s in bench/randread.py). Anything more (a chunk's first
                # verification: a 1 MiB hash and an index read) goes to a worker.
                return entry.serve.read_pages(off, end - off)
            return await self.workers.disk(entry.serve.read_pages, off, end - off)
        # Waiting for `buf` let other tasks run: the bytes may have landed meanwhile
        # (with several cold streams, memory is short and that wait is common).
        view = self._from_landed(entry, off, end, window)
        if view is not None:
            return view
        data = await self.workers.disk(entry.serve.read_aligned, off, end - off, buf)
        if window and not fetched:
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

    def _stage(self, entry: Entry, start: int, end: int) -> None:
        """Ahead of a sequential reader of bytes already in tier 1, load the next
        parts into memory with one large O_DIRECT read each: the 1 MiB requests
        that follow are then memcpys instead of a device round trip apiece.
        At most half the landed memory is used ahead of any one stream."""
        if entry.state != "clean":
            return
        p = self.fetcher.unit
        stop = min(end, start + self._landed.capacity // 2)
        for pa in range(start - start % p, stop, p):
            pb = min(pa + p, entry.size)
            key = (id(entry), pa)
            if key in self._staging or not entry.serve.present(pa, pb) or self._landed.holds(entry, pa, pb):
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
            if len(entry.serve.read_aligned(a, b - a, buf)) != b - a:  # aligned `a`: lands at buf[0]
                raise KeyError(f"{entry.key!r}: short tier-1 read")
        except BaseException:
            self._part_buffers.give(buf)
            raise
        self._landed.land(entry, a, b, buf, staged=True)


def _pages_ok(entry: Entry) -> bool:
    cs = entry.chunk_size
    return cs > PAGE and cs % PAGE == 0 and entry.state == "clean"
