"""Fetching ahead of a walk through a directory (tierfs/read/walkahead.py) over a
real Reader, a real tier-1 cache and a real file:// store: what gets fetched,
what does not, and how often.

The namespace's side (a directory's entries and each file's store attributes)
is two dicts here: walkahead only reads them, and a namespace would need a
store listing to build them."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from tests.unit.test_reader import CS, Recorded, make_reader
from tierfs.cache import Cache
from tierfs.health import StoreHealth
from tierfs.read.walkahead import WalkAhead
from tierfs.read.walks import Walks
from tierfs.store.base import ObjectInfo

N = 40


@pytest.fixture
def store(tmp_path: Path) -> Recorded:
    root = tmp_path / "store"
    root.mkdir()
    return Recorded(root)


def directory(store: Recorded, sizes: list[int]) -> tuple[dict[str, int], dict[int, ObjectInfo]]:
    """Objects d/f-00.. of `sizes` in the store: the directory's entries (name ->
    inode) and each inode's store attributes."""
    (store.root / "d").mkdir()
    children, infos = {}, {}
    for i, size in enumerate(sizes):
        key = f"d/f-{i:02d}"
        etag = store.put(key, os.urandom(size))
        children[key[2:]] = 100 + i
        infos[100 + i] = ObjectInfo(key, size, etag, 1.0)
    return children, infos


def walk_ahead(store: Recorded, cache: Cache, n: trio.Nursery, children: dict[str, int],
               infos: dict[int, ObjectInfo], health: StoreHealth | None = None) -> WalkAhead:
    w = WalkAhead(make_reader(store, n, cache).fetcher, health or StoreHealth(probe_every=5.0),
                  children=lambda path: children if path == "d" else None,
                  stored=infos.get, whole_max=CS, parallel=4, walks=Walks(4, 16))
    n.start_soon(w.run)
    return w


async def settled(w: WalkAhead) -> None:
    with trio.fail_after(10):
        while w._wanted:
            await trio.sleep(0.005)


def cached(cache: Cache, info: ObjectInfo) -> bool:
    known = cache.lookup(info.key)
    return known is not None and known.cached_bytes == info.size


async def test_a_serial_walk_gets_the_rest_of_its_directory_fetched_once(
    cache: Cache, store: Recorded
) -> None:
    sizes = [CS - 100 * i for i in range(N)]
    sizes[20] = 3 * CS  # bigger than whole_max: its own readahead's business
    children, infos = directory(store, sizes)
    async with trio.open_nursery() as n:
        w = walk_ahead(store, cache, n, children, infos)
        for name in sorted(children):
            w.opened(f"d/{name}", present=False)
            await settled(w)
        n.cancel_scope.cancel()
    ahead = [infos[100 + i] for i in range(3, N) if i != 20]  # from the third open on
    assert all(cached(cache, i) for i in ahead)
    assert not cached(cache, infos[120]) and not cached(cache, infos[100])
    assert sorted(store.gets) == sorted((0, i.size) for i in ahead)  # each once, whole


async def test_shuffled_opens_fetch_nothing_ahead(cache: Cache, store: Recorded) -> None:
    children, infos = directory(store, [CS // 2] * N)
    order = sorted(children)
    random.Random(4).shuffle(order)
    async with trio.open_nursery() as n:
        w = walk_ahead(store, cache, n, children, infos)
        for name in order[: N // 2]:
            w.opened(f"d/{name}", present=False)
        await settled(w)
        n.cancel_scope.cancel()
    assert store.gets == []


async def test_nothing_is_fetched_ahead_while_the_store_is_down(
    cache: Cache, store: Recorded
) -> None:
    children, infos = directory(store, [CS // 2] * N)
    health = StoreHealth(probe_every=5.0)
    health.mark_down("test: unreachable")
    async with trio.open_nursery() as n:
        w = walk_ahead(store, cache, n, children, infos, health)
        for name in sorted(children)[:10]:
            w.opened(f"d/{name}", present=False)
        await settled(w)
        n.cancel_scope.cancel()
    assert store.gets == []


async def test_a_warm_walk_fetches_nothing_and_names_what_to_open_ahead(
    cache: Cache, store: Recorded
) -> None:
    """Objects tier 1 held before the walk: nothing is queued for fetching (finding
    each present would cost a disk-worker hop); the walk's next objects come back
    to be opened ahead (prepared.py), each once."""
    children, infos = directory(store, [CS // 2] * N)
    named: list[str] = []
    async with trio.open_nursery() as n:
        w = walk_ahead(store, cache, n, children, infos)
        for name in sorted(children):
            named += [i.key for i in w.opened(f"d/{name}", present=True)]
            assert not w._wanted
        n.cancel_scope.cancel()
    assert store.gets == []
    assert named == [f"d/{name}" for name in sorted(children)[3:]]  # from the third open on
