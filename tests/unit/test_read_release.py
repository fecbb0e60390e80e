"""Releasing the tier-1 entries of closed read handles (ReadPath.run):
the closes of a walk, one every millisecond or so, share one worker hop and
one index commit, over a real ReadPath, a real tier-1 cache and a real
file:// store.

The clock is trio's MockClock: "closes 1 ms apart, then the gathering window
ends" is a statement about time that a real clock on a loaded machine would
only approximate. `Cache.release_many` is wrapped by a spy that counts each
batch and calls the real one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.unit.test_prepared import read_path
from tests.unit.test_reader import Recorded
from tests.unit.test_walkahead import directory, walk_ahead
from tierfs.cache import Cache, Entry
from tierfs.read.releases import RELEASE_GATHER_S


@pytest.fixture
def store(tmp_path: Path) -> Recorded:
    root = tmp_path / "store"
    root.mkdir()
    return Recorded(root)


async def gathered(landed: trio.Event, clock: trio.testing.MockClock) -> None:
    """End the gathering window until the batch has landed. Once is not always
    enough: the release loop may still be delivering the last batch's worker
    result (which wait_all_tasks_blocked counts as blocked) and start its wait
    after the jump. Ten seconds of wall time at most."""
    deadline = time.monotonic() + 10
    while not landed.is_set():
        # hang guard
        assert time.monotonic() < deadline, "no release batch in 10 s"
        clock.jump(RELEASE_GATHER_S)
        await trio.testing.wait_all_tasks_blocked()


async def test_closes_of_a_walk_share_one_release(
    cache: Cache, store: Recorded, mock_clock: trio.testing.MockClock
) -> None:
    children, infos = directory(store, [1000] * 6)
    batches: list[int] = []
    landed = trio.Event()
    token = trio.lowlevel.current_trio_token()
    release_many = cache.release_many

    def spy(entries: list[Entry]) -> None:
        release_many(entries)
        batches.append(len(entries))
        token.run_sync_soon(landed.set)

    cache.release_many = spy  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        w = walk_ahead(store, cache, n, children, infos)
        path = read_path(store, cache, n, children, infos, kernel_reads=False, walk=w)
        opened = []
        for info in infos.values():
            await w.reading(info.key)
            opened.append((info.key, cache.open(info.key, info.etag, info.size, info.mtime)))
        assert cache.stats().open_objects == 6
        for done, group in ((0, opened[:3]), (3, opened[3:])):
            landed = trio.Event()
            for key, entry in group:  # a serial walk: a close a millisecond
                path.release(key, entry)
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(0.001)
            assert sum(batches) == done  # this group: nothing released yet
            await gathered(landed, mock_clock)
        n.cancel_scope.cancel()
    assert batches == [3, 3]
    assert cache.stats().open_objects == 0
