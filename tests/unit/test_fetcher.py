"""The fetcher (tierfs/read/fetcher.py) and its single-flight (flights.py), below
any mount: a real tier-1 cache, a real file:// store, and sources of the kinds
the source protocol (sources.py) is for: one that misses (a shared tier
without the block), one that writes into the tier-1 file itself from a thread
of its own (a transfer engine's C thread), one that fills a larger aligned
block than asked (a shared tier's block). They wrap the real store; what they
add is where the bytes go, which is what these tests check."""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import trio
import xxhash

from tests.unit.conftest import SMALL_CHUNK as CS
from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.read.bodies import Bodies
from tierfs.read.fetcher import Fetcher
from tierfs.read.flights import SingleFlight, wait_all
from tierfs.read.landed import LandedParts
from tierfs.read.sources import Below, Got, MemorySink, Sink, Source, StoreSource, Tier1Fill, Want
from tierfs.read.waste import WasteCaps
from tierfs.store import LocalStore
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers

PART = 4 * CS


class Missing:
    """A source that holds nothing (a shared tier without the block): asked, it
    says so and the next source is asked."""

    name = "missing"

    def __init__(self) -> None:
        self.asked: list[Want] = []

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        self.asked.append(want)
        return None


class WritesTier1:
    """A transfer engine that writes into the tier-1 file itself, from a thread of
    its own, in pieces out of order (as a CRT part's on_body callbacks), then
    commits with checksums taken by the cache (`digests=None`)."""

    name = "engine"

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.threads: set[int] = set()

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        return await sink.worker(self._get, want, sink)

    def _get(self, want: Want, sink: Sink) -> Got:
        fill_cm = sink.tier1(want.start, want.end)
        if fill_cm is None:  # a memory-only fetch: into the buffer
            got = self.store.get_range_into(want.key, want.start, len(want), sink.buffer(), want.etag)
            sink.land()
            return Got(got.etag, got.metadata)
        data = memoryview(bytearray(len(want)))
        got = self.store.get_range_into(want.key, want.start, len(want), data, want.etag)
        with fill_cm as fill:
            def on_body() -> None:  # the engine's own thread
                self.threads.add(threading.get_ident())
                for off in reversed(range(0, len(data), 8192)):
                    os.pwrite(fill.fd, data[off : off + 8192], want.start + off)

            t = threading.Thread(target=on_body)
            t.start()
            t.join()
            fill.commit(None)
        return Got(got.etag, got.metadata, in_tier1=True)


class Block:
    """A shared tier of BLOCK-byte blocks: it fills the whole aligned block holding
    the wanted range into tier 1 (more than asked), with its own checksums, and
    takes the block from the sources below it (the origin), waiting on the loop
    between (a claim another node holds) with no worker slot held."""

    name = "block"
    BLOCK = 2 * PART

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, int], bytes] = {}

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        a = want.start - want.start % self.BLOCK
        b = min(a + self.BLOCK, want.size)
        data = bytearray(b - a)
        got = await below(Want(want.key, want.etag, want.size, a, b), MemorySink(data, sink.worker))
        await trio.sleep(0)  # a wait on the loop (no slot held)
        self.blocks[(want.key, a)] = bytes(data)
        fill_cm = sink.tier1(a, b)
        if fill_cm is None:
            return None
        await sink.worker(self._fill, fill_cm, a, memoryview(data))
        return Got(got.etag, None, in_tier1=True)

    @staticmethod
    def _fill(fill_cm: AbstractContextManager[Tier1Fill], a: int, data: memoryview) -> None:
        with fill_cm as fill:
            os.pwrite(fill.fd, data, a)
            fill.commit([xxhash.xxh3_64_digest(data[o : o + CS]) for o in range(0, len(data), CS)])


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    root = tmp_path / "store"
    root.mkdir()
    return LocalStore(str(root))


def make_fetcher(sources: list[Source], cache: Cache, nursery: trio.Nursery,
                 learned: list[tuple[str, str, dict[str, str]]] | None = None) -> Fetcher:
    budget = MemoryBudget(64 << 20)
    parts = BufferPool(budget, PART, keep=4)
    return Fetcher(sources, Workers(data=4, upload=1, meta=1, disk=2), nursery, cache=cache,
                   budget=budget, parts=parts, landed=LandedParts(parts, 16 * PART),
                   bodies=Bodies(budget, 1 << 20), waste=WasteCaps(cache.capacity), unit=PART,
                   whole_max=CS,
                   learned=lambda *seen: None if learned is None else learned.append(seen))


def put(store: LocalStore, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectInfo:
    return store.put_bytes(key, data, metadata=metadata)


def open_entry(cache: Cache, info: ObjectInfo) -> Entry:
    return cache.open(info.key, info.etag, info.size, info.mtime)


# -- SingleFlight -------------------------------------------------------------------


async def test_single_flight_one_fetch_for_all_its_waiters_and_keys_released() -> None:
    flights: SingleFlight[int] = SingleFlight()
    runs = []
    release = trio.Event()

    async def fetch() -> str:
        runs.append(1)
        await release.wait()
        return "done"

    async with trio.open_nursery() as n:
        flight = flights.claim([1, 2, 3])
        assert flights.get(2) is flight and len(flights) == 3
        results = []

        async def own() -> None:
            results.append(await flights.fly(flight, fetch))

        n.start_soon(own)
        joined = flights.join(3, lambda f: pytest.fail("a key in flight started again"))
        assert joined is flight
        release.set()
        await wait_all([joined])
    assert runs == [1] and results == ["done"]
    assert len(flights) == 0 and 2 not in flights


async def test_single_flight_waiters_learn_the_error_and_a_cancel() -> None:
    flights: SingleFlight[str] = SingleFlight()

    async def fails() -> None:
        raise OSError(5, "store said no")

    flight = flights.claim(["k"])
    assert await flights.fly(flight, fails) is None
    with pytest.raises(OSError, match="store said no"):
        await flight.wait()
    assert "k" not in flights

    cancelled = flights.claim(["k"])
    with trio.CancelScope() as scope:
        scope.cancel()
        await flights.fly(cancelled, trio.sleep_forever)
    with pytest.raises(OSError, match="daemon stopping"):
        await cancelled.wait()
    assert len(flights) == 0


# -- sources ------------------------------------------------------------------------


async def test_a_miss_asks_the_next_source_and_the_bytes_land_in_tier1(
    cache: Cache, store: LocalStore
) -> None:
    data = os.urandom(3 * PART + 100)
    e = open_entry(cache, put(store, "k", data))
    missing = Missing()
    async with trio.open_nursery() as n:
        f = make_fetcher([missing, StoreSource(store)], cache, n)
        assert await f.ensure(e, 0, len(data), in_parts=True)
        assert not await f.ensure(e, 0, len(data), in_parts=True)  # nothing left to fetch
        n.cancel_scope.cancel()
    assert sorted((w.start, w.end) for w in missing.asked) == [
        (0, PART), (PART, 2 * PART), (2 * PART, 3 * PART), (3 * PART, len(data))]
    assert e.serve.read(0, len(data)) == data
    assert f.landed.holds(e, 0, PART)  # the buffer path keeps parts in memory
    cache.release(e)


async def test_a_source_that_writes_tier1_itself_from_its_own_thread(
    cache: Cache, store: LocalStore
) -> None:
    data = os.urandom(2 * PART + 5)
    e = open_entry(cache, put(store, "k", data))
    engine = WritesTier1(store)
    async with trio.open_nursery() as n:
        f = make_fetcher([engine, StoreSource(store)], cache, n)
        assert await f.ensure(e, 0, len(data), in_parts=True)
        n.cancel_scope.cancel()
    assert engine.threads and threading.get_ident() not in engine.threads
    assert e.serve.missing(0, len(data)) == []
    assert not f.landed.holds(e, 0, PART)  # no part buffer was filled: none kept
    assert e.serve.read(0, len(data)) == data
    cache.release(e)
    # Committed with the checksums of the bytes written: checked against the file.
    again = cache.open("k", e.etag, len(data), 1.0)
    assert again.serve.verify() == [] and again.serve.read(0, len(data)) == data
    cache.release(again)


async def test_a_source_may_fill_a_larger_aligned_block(cache: Cache, store: LocalStore) -> None:
    data = os.urandom(4 * PART)
    e = open_entry(cache, put(store, "k", data))
    async with trio.open_nursery() as n:
        shared = Block()
        f = make_fetcher([shared, StoreSource(store)], cache, n)
        await f.ensure(e, PART, PART + CS, in_parts=False)  # one chunk asked
        n.cancel_scope.cancel()
    assert shared.blocks == {("k", 0): data[: 2 * PART]}  # the origin's block, put
    assert e.serve.missing(0, 2 * PART) == []  # its whole block came
    assert e.serve.missing(2 * PART, 4 * PART) == [(2 * PART, 4 * PART)]
    assert e.serve.read(0, 2 * PART) == data[: 2 * PART]
    cache.release(e)


async def test_what_a_get_says_of_the_object_goes_up_as_a_value(
    cache: Cache, store: LocalStore
) -> None:
    data = os.urandom(3 * CS)
    info = put(store, "m", data, {"mode": "0600"})
    e = open_entry(cache, info)
    learned: list[tuple[str, str, dict[str, str]]] = []
    async with trio.open_nursery() as n:
        f = make_fetcher([StoreSource(store)], cache, n, learned)
        await f.ensure(e, 0, len(data), in_parts=True)
        n.cancel_scope.cancel()
    assert learned == [("m", info.etag, {"mode": "0600"})]
    cache.release(e)


async def test_pages_and_reads_through_memory_never_get_a_tier1_file(
    cache: Cache, store: LocalStore
) -> None:
    """Pages of a small read and units read through memory take the buffer path
    even from a source that could write tier 1 itself: `Sink.tier1` is None."""
    data = os.urandom(4 * PART)
    e = open_entry(cache, put(store, "k", data))
    engine = WritesTier1(store)
    async with trio.open_nursery() as n:
        f = make_fetcher([engine], cache, n)
        assert await f.ensure_pages(e, 5 * CS + 100, 5 * CS + 200)
        await f.through_memory(e, 3 * PART + 7).wait()
        n.cancel_scope.cancel()
    assert not engine.threads
    assert e.serve.read_pages(5 * CS, 4096) == data[5 * CS : 5 * CS + 4096]
    assert e.serve.missing(0, len(data)) == [(0, len(data))]  # no chunk stored
    assert f.landed.holds(e, 3 * PART, 4 * PART)
    cache.release(e)


async def test_whole_objects_ahead_from_either_kind_of_source(cache: Cache, store: LocalStore) -> None:
    a = put(store, "d/a", os.urandom(CS - 10))
    b = put(store, "d/b", os.urandom(CS - 20))
    engine = WritesTier1(store)
    async with trio.open_nursery() as n:
        f = make_fetcher([StoreSource(store)], cache, n)
        fetched, body = await f.fetch_whole(a)
        assert fetched and body is not None and bytes(body) == store.get_range("d/a", 0, a.size)
        assert await f.fetch_whole(a) == (False, None)  # tier 1 has it
        f.sources = [engine]
        fetched, body = await f.fetch_whole(b)
        assert fetched and body is None and engine.threads  # the engine wrote the file
        n.cancel_scope.cancel()
    for info in (a, b):
        known = cache.lookup(info.key)
        assert known is not None and known.cached_bytes == info.size
        e = open_entry(cache, info)
        assert e.serve.read(0, info.size) == store.get_range(info.key, 0, info.size)
        cache.release(e)


def test_a_whole_fill_of_an_open_key_is_refused_and_leaves_no_file(
    cache: Cache, store: LocalStore
) -> None:
    data = os.urandom(CS)
    info = put(store, "k", data)
    e = open_entry(cache, info)
    files = set(os.listdir(cache.objects_dir))
    with cache.whole_fill("k", info.etag, 1.0, len(data)) as fill:
        os.pwrite(fill.fd, data, 0)
        fill.commit(None)
    assert not fill.kept
    assert set(os.listdir(cache.objects_dir)) == files
    cache.release(e)
