"""Read path without FUSE: stream detection, claims, single-flight, page-sized fetches.

The store is a real LocalStore (file://) over a temporary directory, with its
ETags: an object replaced under a reader is ESTALE, as on S3."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import trio

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.read.bodies import Bodies
from tierfs.read.fetcher import Fetcher, fetch_unit
from tierfs.read.landed import LandedParts
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.reader import SERVE_BUFFER, Reader
from tierfs.read.sequential import SMALL_READ, STREAM_SLACK, ReadState
from tierfs.read.sources import StoreSource
from tierfs.read.waste import WasteCaps
from tierfs.store import LocalStore
from tierfs.store.base import Received
from tierfs.workers import Workers

KiB, MiB = 1 << 10, 1 << 20
CS = 64 * KiB  # chunk
PART = 256 * KiB  # 4 chunks


# -- ReadState -----------------------------------------------------------------


def test_sequential_window_grows_geometrically_to_the_max() -> None:
    st = ReadState()
    windows = [st.advance(i * MiB, (i + 1) * MiB, MiB, 16 * MiB) for i in range(8)]
    assert windows == [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 16 * MiB, 16 * MiB, 16 * MiB]


def test_random_reads_get_no_window_and_reset() -> None:
    st = ReadState()
    for i in range(4):
        st.advance(i * MiB, (i + 1) * MiB, MiB, 64 * MiB)
    assert st.advance(500 * MiB, 500 * MiB + 4 * KiB, MiB, 64 * MiB) == 0
    assert st.advance(20 * MiB, 20 * MiB + 4 * KiB, MiB, 64 * MiB) == 0  # a jump: new stream
    # A small first read at offset 0 (a header) is not a sequential pass yet.
    assert ReadState().advance(0, 4 * KiB, MiB, 64 * MiB) == 0
    assert ReadState().advance(0, SMALL_READ + 1, MiB, 64 * MiB) == MiB


def test_random_read_near_a_young_stream_does_not_grow_it() -> None:
    st = ReadState()
    st.advance(10 * MiB, 10 * MiB + 4 * KiB, MiB, 64 * MiB)
    # lands inside the slack after the stream's end, but the stream never continued
    assert st.advance(10 * MiB + 64 * KiB, 10 * MiB + 68 * KiB, MiB, 64 * MiB) == 0
    assert st.advance(10 * MiB + STREAM_SLACK // 2, 10 * MiB + STREAM_SLACK // 2 + 4096, MiB, 64 * MiB) == 0


def test_established_stream_tolerates_out_of_order_requests() -> None:
    st = ReadState()
    for i in range(4):
        st.advance(i * MiB, (i + 1) * MiB, MiB, 64 * MiB)
    # the kernel's async readahead delivers 5M before 4M
    assert st.advance(5 * MiB, 6 * MiB, MiB, 64 * MiB) > 0
    assert st.advance(4 * MiB, 5 * MiB, MiB, 64 * MiB) > 0


def test_interleaved_streams_keep_their_own_windows() -> None:
    st = ReadState()
    a, b = 0, 1 << 30
    wa = wb = 0
    for i in range(5):
        wa = st.advance(a + i * MiB, a + (i + 1) * MiB, MiB, 256 * MiB)
        wb = st.advance(b + i * MiB, b + (i + 1) * MiB, MiB, 256 * MiB)
    assert wa == 16 * MiB
    assert wb == 8 * MiB  # stream b started at a non-zero offset: one step behind
    assert len(st.streams) == 2


# -- a Reader over a real cache and a real (file://) store --------------------------


class Recorded:
    """A LocalStore whose GETs are written down as (start, bytes): which ranges the
    read path asked for is what these tests check. Everything else is the real
    store (bytes, ETags, ESTALE); this only delegates and records."""

    def __init__(self, root: Path) -> None:
        self.store = LocalStore(str(root))
        self.root = root
        self.gets: list[tuple[int, int]] = []
        self._mu = threading.Lock()

    @property
    def bytes_fetched(self) -> int:
        with self._mu:
            return sum(n for _, n in self.gets)

    def put(self, key: str, data: bytes) -> str:
        """Write the object; its ETag."""
        (self.root / key).write_bytes(data)
        return self.store.head(key).etag

    def get_range_into(self, key: str, start: int, length: int, buf: memoryview, etag: str | None = None) -> Received:
        got = self.store.get_range_into(key, start, length, buf, etag)
        with self._mu:
            self.gets.append((start, got.length))
        return got


@pytest.fixture
def store(tmp_path: Path) -> Recorded:
    root = tmp_path / "store"
    root.mkdir()
    return Recorded(root)


def open_object(cache: Cache, store: Recorded, data: bytes, key: str = "k") -> Entry:
    """Put `data` in the store as `key` and open its (empty) tier-1 entry."""
    return cache.open(key, store.put(key, data), len(data), 1.0)


async def until_empty(pending: set | dict, limit: float = 10.0) -> None:
    """Poll (with a deadline) until the reader's background work in `pending` is done."""
    with trio.fail_after(limit):
        while pending:
            await trio.sleep(0.005)


def make_reader(store: Recorded, nursery: trio.Nursery, cache: Cache | None = None, **kw: int) -> Reader:
    """A Reader with its Fetcher (the store as its one source), as mount.py builds them;
    `cache` only for whole objects fetched ahead (test_walkahead.py)."""
    kw = {"part_size": PART, "cache_capacity": 1 << 30, "landed_bytes": 64 << 20,
          "whole_object_max": CS, **kw}
    budget = MemoryBudget(256 << 20)
    parts = BufferPool(budget, kw["part_size"], keep=8)
    fetcher = Fetcher(
        [StoreSource(store)], Workers(data=4, upload=1, meta=1, disk=4), nursery,  # type: ignore[arg-type]
        cache=cache,  # type: ignore[arg-type]
        budget=budget, parts=parts, landed=LandedParts(parts, kw["landed_bytes"]),
        bodies=Bodies(budget, 0), waste=WasteCaps(kw["cache_capacity"]),
        unit=fetch_unit(kw["part_size"], kw["cache_capacity"], CS),
        whole_max=kw["whole_object_max"], learned=lambda key, etag, meta: None)
    return Reader(fetcher, fetcher.workers, nursery, serve=BufferPool(budget, SERVE_BUFFER, keep=8),
                  readahead_min=CS, observe_read=lambda tier, n: None)


async def test_claim_splits_into_parts_and_shares_flights(cache: Cache, store: Recorded) -> None:
    data = os.urandom(3 * PART + 100)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        first = r.fetcher.claim(e, 0, len(data))
        assert [(a, b, owner) for a, b, _, owner in first] == [
            (0, PART, True), (PART, 2 * PART, True), (2 * PART, 3 * PART, True),
            (3 * PART, len(data), True),
        ]
        again = r.fetcher.claim(e, PART - CS, PART + CS)  # overlaps two owned flights
        assert [owner for *_, owner in again] == [False, False]
        assert again[0][2] is first[0][2] and again[1][2] is first[1][2]
        n.cancel_scope.cancel()
    cache.release(e)


async def test_concurrent_readers_of_a_cold_range_cause_one_get_per_part(cache: Cache, store: Recorded) -> None:
    data = os.urandom(8 * PART)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        got: list[bytes] = []

        async def one() -> None:
            st = ReadState()
            out = []
            for off in range(0, len(data), 512 * KiB):  # big reads: no page path
                out.append(bytes(await r.read(e, st, off, 512 * KiB, 4 * PART)))  # a pooled view: copy now
            got.append(b"".join(out))

        async with trio.open_nursery() as readers:
            for _ in range(6):
                readers.start_soon(one)
        n.cancel_scope.cancel()
    assert got == [data] * 6
    assert store.bytes_fetched == len(data)  # single-flight: every byte fetched once
    cache.release(e)


async def test_small_random_read_fetches_only_its_pages(cache: Cache, store: Recorded) -> None:
    data = os.urandom(64 * CS)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        st = ReadState()
        offs = [7 * CS + 3 * 4096, 40 * CS + 100, 63 * CS + CS - 4096]
        for off in offs:
            assert await r.read(e, st, off, 4096, 64 * MiB) == data[off : off + 4096]
        # 4096 at an unaligned offset spans two pages
        assert store.bytes_fetched == 4 * 4096
        before = len(store.gets)
        for off in offs:  # served from tier 1 now
            assert await r.read(e, ReadState(), off, 4096, 64 * MiB) == data[off : off + 4096]
        assert len(store.gets) == before
        # A whole-chunk fetch later supersedes the pages and reads stay right.
        await r.fetcher.ensure(e, 0, len(data), in_parts=True)
        assert e.serve.read(0, len(data)) == data
        n.cancel_scope.cancel()
    cache.release(e)


async def test_any_read_of_a_small_object_fetches_it_whole_into_tier1(
    cache: Cache, store: Recorded
) -> None:
    data = os.urandom(CS - 1000)  # an object up to whole_object_max (here one chunk)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        got: dict[int, bytes] = {}

        async def one(off: int) -> None:
            got[off] = bytes(await r.read(e, ReadState(), off, 4096, MiB))

        async with trio.open_nursery() as readers:
            for off in (0, 8192, 4096):
                readers.start_soon(one, off)
        assert got == {o: data[o : o + 4096] for o in (0, 8192, 4096)}
        assert store.gets == [(0, len(data))]  # one GET, whole, for three readers
        assert e.describe().cached_bytes == len(data)  # counted, checksummed, kept
        n.cancel_scope.cancel()
    cache.release(e)
    e = cache.open("k", e.etag, len(data), 1.0)
    try:
        assert e.serve.read(0, len(data)) == data  # verified against its checksum after reopen
    finally:
        cache.release(e)


async def test_pages_survive_close_and_reopen(cache: Cache, store: Recorded) -> None:
    data = os.urandom(16 * CS)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        assert await r.read(e, ReadState(), 5 * CS, 4096, MiB) == data[5 * CS : 5 * CS + 4096]
        cache.release(e)
        e = cache.open("k", e.etag, len(data), 1.0)
        assert e.serve.missing_pages(5 * CS, 5 * CS + 4096) == []
        assert await r.read(e, ReadState(), 5 * CS, 4096, MiB) == data[5 * CS : 5 * CS + 4096]
        assert len(store.gets) == 1
        n.cancel_scope.cancel()
    cache.release(e)


async def test_readahead_never_refetches_present_chunks(cache: Cache, store: Recorded) -> None:
    data = os.urandom(4 * PART)
    e = open_object(cache, store, data)
    e.serve.store(CS, data[CS : 3 * CS])  # chunks 1-2 of the first part already cached
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        await r.fetcher.ensure(e, 0, len(data), in_parts=True)
        n.cancel_scope.cancel()
    assert e.serve.read(0, len(data)) == data
    assert store.bytes_fetched == len(data) - 2 * CS
    cache.release(e)


async def test_prefetch_object_fills_tier1_and_releases(cache: Cache, store: Recorded) -> None:
    data = os.urandom(10 * PART + 5)
    e = open_object(cache, store, data)
    released = trio.Event()

    async def done() -> None:
        released.set()

    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        whole = WholePrefetch(r.fetcher, cache, r.workers, n, parallel=4)
        whole.start(e, done)
        assert whole.running(e)
        # a read elsewhere is answered while the prefetch runs
        assert await r.read(e, ReadState(), 9 * PART, 100, MiB) == data[9 * PART : 9 * PART + 100]
        with trio.fail_after(10):
            await released.wait()
        assert not whole.running(e)
        n.cancel_scope.cancel()
    assert e.serve.missing(0, len(data)) == []
    assert store.bytes_fetched <= len(data) + 4096
    cache.release(e)


async def test_bytes_that_just_landed_are_served_from_memory(
    cache: Cache, store: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequential read of a part right after its GET is a memcpy from the part
    buffer; once the part aged out of memory the same bytes come from tier 1,
    and a sequential reader of tier-1 bytes gets the next part staged."""
    part = 2 * PART  # reads of a whole part are then bigger than SMALL_READ
    assert part > SMALL_READ
    data = os.urandom(8 * part)
    e = open_object(cache, store, data)
    tier1_reads: list[int] = []
    real = e.serve.read_aligned

    def counted(offset: int, length: int, buf: memoryview) -> memoryview:
        tier1_reads.append(offset)
        return real(offset, length, buf)

    monkeypatch.setattr(e.serve, "read_aligned", counted)  # observe which path served a read
    async with trio.open_nursery() as n:
        r = make_reader(store, n, part_size=part, landed_bytes=2 * part)
        st = ReadState()
        assert bytes(await r.read(e, st, 0, part, part)) == data[:part]
        assert bytes(await r.read(e, st, part, part, part)) == data[part : 2 * part]
        assert tier1_reads == []
        # Four more parts land (readahead and reads); the first ones age out.
        for off in range(2 * part, 6 * part, part):
            assert bytes(await r.read(e, st, off, part, part)) == data[off : off + part]
        st = ReadState()
        assert bytes(await r.read(e, st, 0, part, part)) == data[:part]
        # That read came from tier 1, and it staged the next part (present in
        # tier 1, no longer in memory) with one read ahead of the stream ...
        await until_empty(r._staging)
        assert tier1_reads == [0, part]
        # ... which the stream's next request then finds in memory.
        assert bytes(await r.read(e, st, part, part, part)) == data[part : 2 * part]
        await until_empty(r._staging)
        assert sorted(tier1_reads) == [0, part, 2 * part]  # staging moved on ahead
        assert store.bytes_fetched <= len(data)  # nothing fetched twice
        n.cancel_scope.cancel()
    cache.release(e)


async def test_a_herd_reading_in_turns_fetches_whole_parts(cache: Cache, store: Recorded) -> None:
    """N processes reading one cold file take turns: the kernel sends each one's
    next request only for what the page cache lacks, so each handle sees reads
    that continue none of its streams. Near the entry's sequential front such a
    read continues the front (whole parts, readahead); far from it, it is still
    a random read that fetches only its pages."""
    data = os.urandom(32 * PART)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        handles = [ReadState() for _ in range(4)]
        step = 5 * CS  # big reads (no page path), not part-aligned
        for i, off in enumerate(range(0, 16 * PART, step)):  # a relay: handle i % 4 reads piece i
            got = await r.read(e, handles[i % 4], off, step, 4 * PART)
            assert bytes(got) == data[off : off + step]
        assert all(start % PART == 0 and length == PART for start, length in store.gets), store.gets
        await until_empty(r.fetcher.chunks)
        # The relay's window grew as one reader's would: readahead is a full window ahead.
        assert not e.serve.missing(16 * PART, 20 * PART)
        # Random 4 KiB reads that land near the front by chance (another handle,
        # bytes already there) do not move it: no readahead, no GET.
        gets = len(store.gets)
        front = max(range(0, 16 * PART, step)) + step
        for off in (front - 3 * PART + 8 * KiB, front - 5 * CS, front + PART + 4 * KiB):
            assert await r.read(e, ReadState(), off, 4 * KiB, 4 * PART) == data[off : off + 4 * KiB]
            assert not r.fetcher.chunks  # readahead would have claimed its chunks by now
        assert len(store.gets) == gets and e.serve.missing(21 * PART, 22 * PART), store.gets[gets:]
        # Far from the front: a random read, its pages only.
        far = 28 * PART + 8 * KiB
        before = store.bytes_fetched
        assert await r.read(e, ReadState(), far, 4 * KiB, 4 * PART) == data[far : far + 4 * KiB]
        assert store.bytes_fetched - before == 4 * KiB
        n.cancel_scope.cancel()
    cache.release(e)


async def test_an_object_replaced_in_the_store_is_estale(cache: Cache, store: Recorded) -> None:
    """The ETag the entry was opened with travels with every GET: bytes of another
    version are never mixed into it."""
    data = os.urandom(4 * PART)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        assert bytes(await r.read(e, ReadState(), 0, PART, 0)) == data[:PART]
        store.put("k", os.urandom(4 * PART + 1))  # another node replaced it
        with pytest.raises(OSError) as exc:
            await r.read(e, ReadState(), 2 * PART, PART, 0)
        assert exc.value.errno == errno.ESTALE
        assert bytes(await r.read(e, ReadState(), 0, PART, 0)) == data[:PART]  # tier 1: old version
        n.cancel_scope.cancel()
    cache.release(e)


async def test_chunks_evicted_unread_turn_readahead_off_then_reads_go_through_memory(
    tmp_path: Path, store: Recorded
) -> None:
    """Far less room in tier 1 than the reader was told (as when most of the cache
    is held by files being written): what is fetched ahead is evicted before it
    is read. The reader notices and cuts readahead (down to reading the object
    from the store through memory if waste goes on): from then on every byte is
    fetched about once (no eviction loop), and every read is right throughout.
    How many cuts it takes depends on when the fetches land relative to the
    reads (thread timing; eviction runs beside the fetches, in a thread of its
    own), so the test bounds the refetches after the first cut, not the cuts."""
    small = Cache(tmp_path / "small", capacity=6 * CS, chunk_size=CS, min_free=0)
    small.bind("file:///src")
    data = os.urandom(256 * CS)
    e = open_object(small, store, data)
    cut_at: int | None = None  # the offset read when the first cut was seen
    try:
        async with trio.open_nursery() as n:
            n.start_soon(small.evictor.run, trio.to_thread.run_sync)  # as the mount runs it
            r = make_reader(store, n, part_size=2 * CS, cache_capacity=64 * CS)
            st = ReadState()
            for off in range(0, len(data), 2 * CS):
                use = r.waste.use(e)
                assert use is not None
                if cut_at is None and r.waste.wasted_bytes:
                    assert use.cap <= r.waste.ahead_max // 4  # noticed; cut
                    cut_at, before = off, store.bytes_fetched
                assert bytes(await r.read(e, st, off, 2 * CS, len(data))) == data[off : off + 2 * CS]
            n.cancel_scope.cancel()
        assert cut_at is not None
        # Once each, plus what at most two more cuts can refetch (readahead of 4
        # chunks, then 1) and the readahead past the end: never a loop.
        assert store.bytes_fetched - before <= len(data) - cut_at + 12 * CS
    finally:
        small.release(e)
        small.close()


async def test_readahead_for_a_closed_object_is_not_fetched(cache: Cache, store: Recorded) -> None:
    data = os.urandom(32 * PART)
    e = open_object(cache, store, data)
    async with trio.open_nursery() as n:
        r = make_reader(store, n)
        r.fetcher.prefetch(e, 0, len(data))  # 32 parts queued behind 4 data threads
        cache.release(e)  # the last reader is gone before most of them start
        await until_empty(r.fetcher.chunks)
        n.cancel_scope.cancel()
    assert store.bytes_fetched <= 8 * PART, store.bytes_fetched // PART
