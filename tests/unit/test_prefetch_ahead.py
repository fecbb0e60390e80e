"""The next shard fetched ahead of its open (tierfs/read/prefetch.py, shards.py).

The read path as mount.py builds it (fetcher, whole-object prefetch, reader,
the shared tier before the origin), over real file:// stores and tier-1
caches, on trio's MockClock: the origin is a link whose every GET takes FETCH
virtual seconds, and a loader reads each shard to its end, then spends LOAD
seconds on it before it opens the next one. Shared-tier store calls run inline
in the trio thread, as in test_sharedtier_claims.py."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.read.bodies import Bodies
from tierfs.read.fetcher import Fetcher, fetch_unit
from tierfs.read.landed import LandedParts
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.reader import SERVE_BUFFER, Reader
from tierfs.read.sequential import ReadState
from tierfs.read.served import FileRange
from tierfs.read.shards import next_file_in, next_shard
from tierfs.read.sources import Below, Got, Sink, Source, StoreSource, Want
from tierfs.read.waste import WasteCaps
from tierfs.sharedtier.tier import SharedTier
from tierfs.store.base import ObjectInfo
from tierfs.store.local import LocalStore
from tierfs.workers import Kind, Workers

CS = 64 << 10  # tier-1 chunk
PART = 4 * CS  # a fetch part, and a shared block
FETCH = 1.0  # virtual seconds an origin GET of a part takes
LOAD = 0.5  # virtual seconds a loader spends on a shard after reading it
DIR = "llm"
T = TypeVar("T")


# -- which shard comes next ------------------------------------------------------


def test_the_next_shard_is_the_same_name_with_one_number_the_next_larger() -> None:
    hf = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    names = [*hf, "model.safetensors.index.json", "config.json",
             "model-00002-of-00003.safetensors",  # another checkpoint's shard
             "adapter_model.safetensors"]
    assert next_shard(hf[0], names) == hf[1]
    assert next_shard(hf[2], names) == hf[3]
    assert next_shard(hf[3], names) is None  # the last one
    assert next_shard("adapter_model.safetensors", names) is None  # no number
    assert next_shard("consolidated.00.pth", ["consolidated.01.pth", "consolidated.00.pth"]) == (
        "consolidated.01.pth")
    # numbers compare as numbers, and a gap is skipped
    assert next_shard("shard_2.pt", ["shard_10.pt", "shard_9.pt", "shard_1.pt"]) == "shard_9.pt"
    assert next_shard("shard_9.pt", ["shard_10.pt", "shard_9.pt"]) == "shard_10.pt"
    assert next_shard("model-00001-of-00004.safetensors", ["model-00001-of-00004.bin"]) is None


def test_the_next_file_comes_from_the_directory_listing() -> None:
    infos = {1: ObjectInfo("llm/a-1.safetensors", 10, "e1", 0.0),
             2: ObjectInfo("llm/a-2.safetensors", 20, "e2", 0.0)}
    listed = {"llm": {"a-1.safetensors": 1, "a-2.safetensors": 2}}
    next_file = next_file_in(listed.get, infos.get)
    assert next_file("llm/a-1.safetensors") == infos[2]
    assert next_file("llm/a-2.safetensors") is None
    assert next_file("other/a-1.safetensors") is None  # not listed: not known


# -- the read path -----------------------------------------------------------------


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class InlineKind(Kind):
    """Worker calls run in the trio thread: virtual time moves only while every
    task waits on the clock, never while a thread writes tier 1."""

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        async with self._sem:
            await trio.lowlevel.checkpoint()
            return fn(*args)


class InlineWorkers(Workers):
    def __init__(self) -> None:
        super().__init__(data=8, upload=1, meta=1, disk=4)
        self.kinds = {k: InlineKind(v.slots) for k, v in self.kinds.items()}


class Link:
    """The origin behind a narrow link: each GET takes FETCH virtual seconds.
    Records each GET (shard name, part, start time) and the most GETs of each
    shard in flight at once."""

    name = "origin"

    def __init__(self, store: LocalStore) -> None:
        self.inner = StoreSource(store)
        self.asked: list[tuple[str, int, float]] = []
        self.inflight: Counter[str] = Counter()
        self.most: Counter[str] = Counter()

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        shard = want.key.rsplit("/", 1)[-1]
        self.asked.append((shard, want.start // PART, trio.current_time()))
        self.inflight[shard] += 1
        self.most[shard] = max(self.most[shard], self.inflight[shard])
        try:
            await trio.sleep(FETCH)
        finally:
            self.inflight[shard] -= 1
        return await self.inner.fetch(want, sink, below)

    def first(self, shard: str) -> float:
        return min(t for s, _, t in self.asked if s == shard)


class Model:
    """Shards of `parts` parts each in the origin store, and its directory listing."""

    def __init__(self, root: Path, shards: int, parts: int) -> None:
        root.joinpath(DIR).mkdir(parents=True)
        self.store = LocalStore(str(root))
        self.names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        self.data: dict[str, bytes] = {}
        self.infos: dict[int, ObjectInfo] = {}
        for inode, name in enumerate(self.names, start=10):
            data = self.data[name] = os.urandom(parts * PART)
            root.joinpath(DIR, name).write_bytes(data)
            self.infos[inode] = ObjectInfo(f"{DIR}/{name}", len(data),
                                           self.store.head(f"{DIR}/{name}").etag, 1.0)
        self.listing = {DIR: {info.key.rsplit("/", 1)[-1]: i for i, info in self.infos.items()}}

    def info(self, name: str) -> ObjectInfo:
        return next(i for i in self.infos.values() if i.key == f"{DIR}/{name}")


class Node:
    """One node's read path: tier 1, fetcher (the shared tier, if any, before the
    link), reader and whole-object prefetch, the next shard fetched ahead or not."""

    def __init__(self, root: Path, model: Model, link: Source, nursery: trio.Nursery, *,
                 ahead: bool, shared: LocalStore | None = None, fetches: int = 1,
                 parallel: int = 4) -> None:
        self.model = model
        self.cache = Cache(root, capacity=1 << 30, chunk_size=CS, min_free=0)
        self.cache.bind("file:///src")
        budget = MemoryBudget(256 << 20)
        parts = BufferPool(budget, PART, keep=8)
        self.workers = InlineWorkers()
        sources: list[Source] = [link]
        if shared is not None:
            sources.insert(0, SharedTier(
                shared, source="file:///origin", block=PART, lease=30.0, origin_fetches=fetches,
                conditional=True, secret=None, budget=budget, meta=inline, data=inline,
                upload=inline))
        fetcher = Fetcher(
            sources, self.workers, nursery, cache=self.cache, budget=budget, parts=parts,
            landed=LandedParts(parts, 64 << 20), bodies=Bodies(budget, 0),
            waste=WasteCaps(1 << 30), unit=fetch_unit(PART, 1 << 30, CS), whole_max=CS,
            learned=lambda key, etag, meta: None)
        self.reader = Reader(fetcher, self.workers, nursery,
                             serve=BufferPool(budget, SERVE_BUFFER, keep=8), readahead_min=CS,
                             observe_read=lambda tier, n: None)
        self.prefetch = WholePrefetch(
            fetcher, self.cache, self.workers, nursery, parallel=parallel,
            globs=("*.safetensors",),
            next_file=next_file_in(model.listing.get, model.infos.get) if ahead else None,
            ahead_parallel=fetches + 1)
        self.opened: dict[str, float] = {}  # shard -> when the loader opened it

    async def load(self, names: list[str]) -> None:
        """A loader: each shard opened, read to its end, LOAD seconds of work, closed."""
        for name in names:
            await self.read_whole(name)
            await trio.sleep(LOAD)

    async def open(self, name: str) -> Entry:
        """An open as the daemon makes it: the entry, then the prefetch told. Kept
        open unless the caller releases it."""
        info = self.model.info(name)
        self.opened[name] = trio.current_time()
        entry = await self.workers.disk(self.cache.open, info.key, info.etag, info.size,
                                        info.mtime)
        await self.prefetch.opened(info.key, info.etag, info.size, info.mtime, entry)
        return entry

    async def read_whole(self, name: str) -> None:
        info = self.model.info(name)
        entry = await self.open(name)
        try:
            # The prefetch claims its first parts before the first read arrives (in
            # the daemon a read comes a FUSE round trip after the open's reply).
            await trio.testing.wait_all_tasks_blocked()
            st, got = ReadState(), bytearray()
            for off in range(0, info.size, PART):
                served = await self.reader.read(entry, st, off, PART, 4 * PART)
                assert not isinstance(served, FileRange)  # no lending without a splice probe
                got += served
            assert bytes(got) == self.model.data[name]
        finally:
            await self.workers.disk(self.cache.release, entry)


def model_behind_link(tmp_path: Path, mock_clock: trio.testing.MockClock, *, shards: int,
                      parts: int) -> tuple[Model, Link]:
    """A model of `shards` shards in the origin, behind its link; virtual time
    jumps as soon as every task waits."""
    mock_clock.autojump_threshold = 0
    model = Model(tmp_path / "origin", shards=shards, parts=parts)
    return model, Link(model.store)


def idle_gaps(link: Link) -> list[float]:
    """Stretches of virtual time, between the first GET and the last, with no GET
    on the link."""
    spans = sorted((t, t + FETCH) for _, _, t in link.asked)
    gaps, end = [], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    return gaps


@pytest.mark.parametrize("ahead", [True, False])
async def test_a_herd_keeps_the_link_busy_across_shard_boundaries(
    tmp_path: Path, mock_clock: trio.testing.MockClock, ahead: bool
) -> None:
    """Two nodes, one origin fetch each, load a model of three shards through the
    shared tier. With the next shard fetched ahead, its first blocks are claimed
    and on the link before any loader opens it, the link never idles, and still
    every block crosses it once. Without (`ahead=False`, as before), the link
    idles at each boundary while the loaders finish the shard before."""
    model, link = model_behind_link(tmp_path, mock_clock, shards=3, parts=4)
    shared_root = tmp_path / "shared"
    shared_root.mkdir()
    shared = LocalStore(str(shared_root))
    async with trio.open_nursery() as n:
        nodes = [Node(tmp_path / f"c{i}", model, link, n, ahead=ahead, shared=shared)
                 for i in range(2)]
        async with trio.open_nursery() as loaders:
            for node in nodes:
                loaders.start_soon(node.load, model.names)
        n.cancel_scope.cancel()
    blocks = sorted((s, p) for s, p, _ in link.asked)
    assert blocks == sorted((s, p) for s in model.names for p in range(4))  # each once
    if not ahead:
        assert len(idle_gaps(link)) >= 2  # what claim-ahead removes
        return
    assert idle_gaps(link) == []
    for before, name in zip(model.names, model.names[1:], strict=False):
        first_open = min(node.opened[name] for node in nodes)
        assert link.first(name) < first_open
        # ... and not before the shard before it had every block on the way.
        assert link.first(name) >= max(t for s, _, t in link.asked if s == before) - FETCH
    assert sum(node.prefetch.ahead_started for node in nodes) >= 2


async def test_few_parts_in_flight_until_its_reader_opens_it(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A reader's shard has every part on the way: the next shard is fetched ahead
    with at most `ahead_parallel` parts in flight; once its reader opens it, it
    gets the prefetch's full width."""
    model, link = model_behind_link(tmp_path, mock_clock, shards=2, parts=12)
    first, second = model.names
    async with trio.open_nursery() as n:
        node = Node(tmp_path / "c", model, link, n, ahead=True, fetches=1, parallel=4)
        assert node.prefetch.ahead_parallel == 2
        await node.read_whole(first)
        await trio.sleep(3 * FETCH)
        before = link.most[second]
        await node.open(second)  # no reads of its own: only the prefetch fetches it
        await trio.sleep(2 * FETCH)
        n.cancel_scope.cancel()
    assert (before, link.most[second]) == (2, 4)
    assert link.first(second) < node.opened[second]


async def test_a_shard_still_coming_ahead_when_opened_has_the_next_one_fetched_ahead(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    model, link = model_behind_link(tmp_path, mock_clock, shards=3, parts=4)
    first, second, third = model.names
    async with trio.open_nursery() as n:
        node = Node(tmp_path / "c", model, link, n, ahead=True, fetches=1, parallel=4)
        await node.load(model.names)
        n.cancel_scope.cancel()
    # the second shard's last parts were still coming when its reader opened it
    assert max(t for s, _, t in link.asked if s == second) + FETCH > node.opened[second]
    assert link.first(third) < node.opened[third]
    assert Counter(s for s, _, _ in link.asked) == {name: 4 for name in model.names}


async def test_one_file_ahead_only(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    """A shard fetched ahead does not start the one after it, even once every part
    of it is on the way; its reader's open does."""
    model, link = model_behind_link(tmp_path, mock_clock, shards=3, parts=4)
    first, second, third = model.names
    async with trio.open_nursery() as n:
        node = Node(tmp_path / "c", model, link, n, ahead=True, fetches=1, parallel=4)
        await node.read_whole(first)
        await trio.sleep(10 * FETCH)  # long enough to fetch all of the second shard ahead
        assert {s for s, _, _ in link.asked} == {first, second}
        await node.load([second, third])
        n.cancel_scope.cancel()
    assert link.first(third) < node.opened[third]
    assert Counter(s for s, _, _ in link.asked) == {name: 4 for name in model.names}


async def test_a_shard_whole_in_tier1_still_has_the_next_one_fetched_ahead(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    model, link = model_behind_link(tmp_path, mock_clock, shards=2, parts=4)
    first, second = model.names
    async with trio.open_nursery() as n:
        node = Node(tmp_path / "c", model, link, n, ahead=False)
        await node.read_whole(first)  # whole in tier 1, nothing fetched ahead
        assert second not in {s for s, _, _ in link.asked}
        node.prefetch._next_file = next_file_in(model.listing.get, model.infos.get)
        asked = len(link.asked)
        await node.read_whole(first)  # warm: no GET for it, but its next shard comes
        await trio.sleep(3 * FETCH)
        assert {s for s, _, _ in link.asked[asked:]} == {second}
        await node.read_whole(second)
        n.cancel_scope.cancel()
    assert Counter(s for s, _, _ in link.asked) == {first: 4, second: 4}
    assert link.first(second) < node.opened[second]
