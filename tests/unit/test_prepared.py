"""Opens of a warm walk prepared ahead of the reader (tierfs/read/prepared.py),
over a real ReadPath, a real tier-1 cache reopened as after a restart (nothing
verified in memory) and a real file:// store.

The second test's clock is trio's MockClock: "an entry nobody took is released
after TTL_S" is a statement about time. Worker threads run in real time: the
tests wait for them by condition (`until`), bounded in wall time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.unit.conftest import SMALL_CHUNK
from tests.unit.test_reader import Recorded, make_reader
from tests.unit.test_walkahead import directory, walk_ahead
from tierfs.budget import MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.config import DEFAULT_CLASSES
from tierfs.health import StoreHealth
from tierfs.queued_writes import QueuedWrites
from tierfs.read.handles import ReadPath
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.prepared import TTL_S, PreparedOpens
from tierfs.read.releases import Releases
from tierfs.read.walkahead import WalkAhead
from tierfs.read.warm import WarmLoads
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers

N = 24
DATASET = DEFAULT_CLASSES["dataset"]


@pytest.fixture
def store(tmp_path: Path) -> Recorded:
    root = tmp_path / "store"
    root.mkdir()
    return Recorded(root)


Restarted = tuple[Cache, dict[str, int], dict[int, ObjectInfo]]


@pytest.fixture
def restarted(tmp_path: Path, store: Recorded) -> Iterator[Restarted]:
    """N objects of a directory whole in tier 1, the cache closed and opened again."""
    children, infos = directory(store, [SMALL_CHUNK // 2] * N)
    first = Cache(tmp_path / "c", capacity=1 << 30, chunk_size=SMALL_CHUNK, min_free=0)
    first.bind("file:///src")
    for info in infos.values():
        data = (store.root / info.key).read_bytes()
        first.put_whole(info.key, info.etag, info.mtime, memoryview(data))
    first.close()
    cache = Cache(tmp_path / "c", capacity=1 << 30, chunk_size=SMALL_CHUNK, min_free=0)
    cache.bind("file:///src")
    yield cache, children, infos
    cache.close()


def read_path(store: Recorded, cache: Cache, n: trio.Nursery, children: dict[str, int],
              infos: dict[int, ObjectInfo], *, kernel_reads: bool = True,
              walk: WalkAhead | None = None) -> ReadPath:
    """A ReadPath built as mount.py builds it, running."""
    reader = make_reader(store, n, cache)
    workers = Workers(data=1, upload=1, meta=1, disk=2)
    w = walk or walk_ahead(store, cache, n, children, infos)
    warm = WarmLoads(cache, reader.bodies, whole_max=reader.whole_max,
                     kernel_reads=lambda: kernel_reads)
    releases = Releases(cache, workers)
    path = ReadPath(reader, cache, workers, StoreHealth(probe_every=5.0), walk_ahead=w,
                    prepared=PreparedOpens(cache, workers, warm, releases, w), warm=warm,
                    releases=releases, prefetch=WholePrefetch(reader.fetcher, cache, workers, n, parallel=1),
                    observe_latency=lambda s: None,
                    queued=no_writes(n), refresh=partial(trio.to_thread.run_sync, store.store.head))
    n.start_soon(path.run)
    return path


class Recording:
    """PreparedOpens's collaborators (warm loads, batched releases, the walk
    ahead), recorded: these tests are about PreparedOpens alone, what it
    releases, when, and what it hands on to be fetched."""

    def __init__(self) -> None:
        self.released: list[Entry] = []
        self.absent: list[ObjectInfo] = []
        self.bodies = self
        self._tell, self.fetched = trio.open_memory_channel[ObjectInfo](0)

    def later(self, entry: Entry) -> None:
        self.released.append(entry)

    def fetch(self, infos: list[ObjectInfo]) -> None:
        self.absent.extend(infos)

    def read_soon(self, entry: Entry) -> bool:
        return True

    def load(self, entry: Entry) -> tuple[Entry, None]:
        return entry, None

    def offer(self, key: str, etag: str, body: object) -> None:
        """Nothing is loaded here."""


def no_writes(nursery: trio.Nursery) -> QueuedWrites:
    """Direct writes queued before a read (none here: reads are this test's business)."""

    async def never(entry: Entry, offset: int, data: bytes) -> None:
        raise AssertionError("no write is queued in this test")

    return QueuedWrites(nursery, never, 1 << 20, MemoryBudget(1 << 30))


async def until(cond: Callable[[], bool]) -> None:
    """Let the loop run (worker threads deliver their results through it) until
    `cond` holds; ten seconds of wall time at most, whatever the trio clock."""
    deadline = time.monotonic() + 10
    while not cond():
        # hang guard
        assert time.monotonic() < deadline, "condition not reached in 10 s"
        await trio.lowlevel.checkpoint()


def settled(path: ReadPath) -> bool:
    """Nothing fetched ahead waits to be opened ahead, nothing is being opened.

    What was fetched waits in the `fetched` channel's buffer or, when
    PreparedOpens._take_fetched was waiting for it, was handed straight to
    that task (a memory channel skips its buffer then) and is not yet wanted
    until the task runs: so the task must be back waiting too."""
    told = path.walk_ahead.fetched.statistics()
    taker_idle = not told.current_buffer_used and told.tasks_waiting_receive > 0
    return taker_idle and not path.prepared._queued and not path.prepared._opening


async def test_a_warm_walk_finds_its_entries_opened_and_verified(
    restarted: Restarted, store: Recorded
) -> None:
    cache, children, infos = restarted
    async with trio.open_nursery() as n:
        path = read_path(store, cache, n, children, infos)
        for info in sorted(infos.values(), key=lambda i: i.key):
            h = await path.open(info.key, info.etag, info.size, info.mtime, DATASET)
            # passthrough takes only verified files: the open verified this one
            assert h.entry.serve.servable_now(0, info.size)
            await h.release()
            await until(lambda: settled(path))
        taken = path.prepared.taken
        n.cancel_scope.cancel()
    # the walk is seen at its third open (Walks: two continuations); every later
    # open found its entry ready, and nothing came from the store
    assert taken == N - 3
    assert store.gets == []
    assert cache.stats().open_objects == 0  # what was left ahead is released at shutdown


async def test_a_cold_walk_opens_what_it_fetched_ahead(cache: Cache, store: Recorded) -> None:
    children, infos = directory(store, [SMALL_CHUNK // 2] * N)
    async with trio.open_nursery() as n:
        path = read_path(store, cache, n, children, infos)
        for info in sorted(infos.values(), key=lambda i: i.key):
            h = await path.open(info.key, info.etag, info.size, info.mtime, DATASET)
            await h.release()
            await until(lambda: not path.walk_ahead._wanted and settled(path))
        taken = path.prepared.taken
        n.cancel_scope.cancel()
    # fetched ahead from the walk's third open on, each then opened ahead
    assert taken == N - 3
    assert sorted(store.gets) == [(0, SMALL_CHUNK // 2)] * (N - 3)


async def test_entries_nobody_takes_are_released(
    restarted: Restarted, mock_clock: trio.testing.MockClock
) -> None:
    """PreparedOpens alone: what is released, when, and what goes to be fetched."""
    cache, _, infos = restarted
    rec = Recording()
    released, absent = rec.released, rec.absent
    first, changed, *rest = sorted(infos.values(), key=lambda i: i.key)[:6]
    unknown = ObjectInfo("d/not-in-tier-1", 10, "e", 1.0)
    async with trio.open_nursery() as n:
        p = PreparedOpens(cache, Workers(data=1, upload=1, meta=1, disk=1), rec, rec, rec)  # type: ignore[arg-type]
        n.start_soon(p.run)
        p.want([first, changed, *rest, unknown])
        await until(lambda: not p._queued and not p._opening)
        assert absent == [unknown]
        assert cache.stats().open_objects == 6  # held ahead
        got = await p.take(first.key, first.etag, first.size)
        assert got is not None and got.key == first.key and p.taken == 1
        assert await p.take(changed.key, "another-etag", changed.size) is None
        assert [e.key for e in released] == [changed.key]  # not what the reader opens
        await trio.testing.wait_all_tasks_blocked()  # no hop in flight: `run` waits
        mock_clock.jump(TTL_S - 0.1)
        await trio.testing.wait_all_tasks_blocked()
        assert len(released) == 1
        mock_clock.jump(0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(e.key for e in released) == sorted([changed.key] + [i.key for i in rest])
        assert await p.take(rest[0].key, rest[0].etag, rest[0].size) is None  # expired
        n.cancel_scope.cancel()
    cache.release_many([got, *released])
    assert cache.stats().open_objects == 0


async def test_what_is_ready_at_shutdown_is_released(restarted: Restarted) -> None:
    cache, _, infos = restarted
    rec = Recording()
    released = rec.released
    async with trio.open_nursery() as n:
        p = PreparedOpens(cache, Workers(data=1, upload=1, meta=1, disk=1), rec, rec, rec)  # type: ignore[arg-type]
        n.start_soon(p.run)
        p.want(list(infos.values())[:4])
        await until(lambda: not p._queued and not p._opening)
        n.cancel_scope.cancel()
    assert len(released) == 4
