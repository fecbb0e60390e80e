"""Tier-1 eviction: capacity and free-space bounds, SLRU scan resistance, streaming
through a file bigger than the cache, pinned and pending objects."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from tierfs.cache import Cache, Entry
from tierfs.cache.eviction import shed_order
from tierfs.cache.index import ABSENT, VERIFIED

CS = 4096


def new_cache(root: Path, capacity: int, min_free: int = 0) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=CS, min_free=min_free)
    c.bind("file:///src")
    return c


def store(c: Cache, e: Entry, offset: int, data: bytes) -> None:
    """A fetched store, then the eviction pass the Evictor runs beside it (the mount
    runs it in a thread of its own; here it runs right after, to be counted)."""
    e.serve.store(offset, data)
    c.evictor.make_room()


def fill(c: Cache, key: str, size: int) -> None:
    """One complete use of an object: open, cache all of it, read it, release."""
    e = c.open(key, "e", size, 0.0)
    for a, b in e.serve.missing(0, size):
        store(c, e, a, bytes(b - a))
    e.serve.read(0, size)
    c.release(e)


def cached(c: Cache, key: str) -> int:
    obj = c.lookup(key)
    return 0 if obj is None else obj.cached_bytes


def test_total_stays_within_capacity(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c", capacity=10 * CS)
    for i in range(40):
        fill(c, f"obj{i}", 3 * CS)
        assert c.stats().used_bytes <= 10 * CS
    st = c.stats()
    assert st.evictions_total >= 30 and st.evicted_bytes_total >= 90 * CS
    assert cached(c, "obj39") == 3 * CS and cached(c, "obj0") == 0
    on_disk = sum(p.stat().st_blocks * 512 for p in (tmp_path / "c" / "objects").iterdir())
    assert on_disk <= 10 * CS + 4 * CS  # filesystem block rounding aside
    c.close()


def test_scan_does_not_flush_objects_used_twice(tmp_path: Path) -> None:
    cap = 32 * CS
    c = new_cache(tmp_path / "c", capacity=cap)
    fill(c, "model.safetensors", 8 * CS)
    fill(c, "model.safetensors", 8 * CS)  # used again: protected
    for i in range(3 * cap // (2 * CS)):  # one pass over 3x the capacity
        fill(c, f"shard-{i:04d}.tar", 2 * CS)
        assert c.stats().used_bytes <= cap
    assert cached(c, "model.safetensors") == 8 * CS
    c.close()


def test_plain_lru_victim_order_without_reuse(tmp_path: Path) -> None:
    """Objects used once go in first-in first-out order."""
    c = new_cache(tmp_path / "c", capacity=4 * CS)
    for k in "abcd":
        fill(c, k, CS)
    fill(c, "e", CS)
    assert [k for k in "abcde" if cached(c, k)] == ["b", "c", "d", "e"]
    c.close()


def test_protected_segment_survives_restart(tmp_path: Path) -> None:
    cap = 16 * CS
    c = new_cache(tmp_path / "c", capacity=cap)
    fill(c, "weights.pt", 4 * CS)
    c.close()
    c = new_cache(tmp_path / "c", capacity=cap)
    fill(c, "weights.pt", 4 * CS)  # read on every restart: promoted now
    c.close()
    c = new_cache(tmp_path / "c", capacity=cap)
    for i in range(3 * cap // CS):
        fill(c, f"scan{i}", CS)
    assert cached(c, "weights.pt") == 4 * CS
    c.close()


def test_protected_segment_is_bounded(tmp_path: Path) -> None:
    """Reuse alone cannot pin everything: protected holds at most 80% of capacity."""
    cap = 10 * CS
    c = new_cache(tmp_path / "c", capacity=cap)
    for k in ["p1", "p2", "p3"]:
        fill(c, k, 3 * CS)
        fill(c, k, 3 * CS)
    for i in range(30):
        fill(c, f"scan{i}", CS)
    assert sum(cached(c, k) for k in ["p1", "p2", "p3"]) <= 8 * CS
    assert cached(c, "p3") == 3 * CS  # the most recent reuse stays
    c.close()


def test_object_bigger_than_cache_streams_through(tmp_path: Path) -> None:
    cap = 8 * CS
    c = new_cache(tmp_path / "c", capacity=cap)
    data = os.urandom(24 * CS + 100)
    e = c.open("huge.bin", "e", len(data), 0.0)
    out = bytearray()
    step = 2 * CS
    for off in range(0, len(data), step):
        for a, b in e.serve.missing(off, off + step):
            store(c, e, a, data[a:b])
            assert c.stats().used_bytes <= cap
        out += e.serve.read(off, step)
    assert bytes(out) == data
    # what stays is the most recent part, the oldest chunks went first
    assert e.serve.present(len(data) - 6 * CS, len(data)) and not e.serve.present(0, CS)
    c.release(e)
    c.close()


def test_big_store_keeps_its_own_chunks(tmp_path: Path) -> None:
    """A single store bigger than the capacity is kept whole until the next one."""
    c = new_cache(tmp_path / "c", capacity=2 * CS)
    e = c.open("k", "e", 8 * CS, 0.0)
    store(c, e, 0, bytes(4 * CS))
    assert e.serve.present(0, 4 * CS)
    store(c, e, 4 * CS, bytes(CS))
    assert c.stats().used_bytes <= 2 * CS and e.serve.present(3 * CS, 5 * CS)
    c.release(e)
    c.close()


def test_open_objects_are_evicted_last(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c", capacity=6 * CS)
    held = c.open("held", "e", 2 * CS, 0.0)
    store(c, held, 0, bytes(2 * CS))
    fill(c, "idle", 2 * CS)  # newer than "held", but not open
    fill(c, "new", 3 * CS)
    assert cached(c, "idle") == 0 and cached(c, "held") == 2 * CS
    c.release(held)
    c.close()


def test_pending_writes_are_never_evicted(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c", capacity=4 * CS)
    for state in ["dirty", "sealed"]:
        e = c.open(f"ckpt-{state}.pt", "", 0, 0.0)
        e.local.write(0, os.urandom(3 * CS))
        if state == "sealed":
            e.local.seal()
        c.release(e)
        c.evictor.make_room()
    for i in range(10):
        fill(c, f"scan{i}", CS)
    assert cached(c, "ckpt-dirty.pt") == 3 * CS and cached(c, "ckpt-sealed.pt") == 3 * CS
    assert c.evict("ckpt-dirty.pt") is False and c.evict("ckpt-sealed.pt") is False
    c.close()


def test_free_space_floor(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    c = new_cache(tmp_path / "c", capacity=1 << 40, min_free=st.f_bavail * st.f_frsize + (1 << 40))
    fill(c, "old", 2 * CS)
    assert cached(c, "old") == 2 * CS  # nothing else to evict while it was open
    e = c.open("next", "e", 4 * CS, 0.0)
    store(c, e, 0, bytes(2 * CS))
    assert cached(c, "old") == 0  # the floor cannot be met: everything else goes
    store(c, e, 2 * CS, bytes(2 * CS))
    assert e.serve.missing(0, 4 * CS) == [(0, 2 * CS)]  # and the open object sheds its past
    c.release(e)
    c.close()


def test_explicit_evict(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c", capacity=1 << 30)
    fill(c, "a", 2 * CS)
    e = c.open("b", "e", 2 * CS, 0.0)
    store(c, e, 0, bytes(2 * CS))
    assert c.evict("a") is True and cached(c, "a") == 0
    assert c.evict("b") is True and e.serve.missing(0, 2 * CS) == [(0, 2 * CS)]
    assert c.evict("nope") is False
    assert c.stats().used_bytes == 0
    c.release(e)
    c.close()


@pytest.mark.parametrize(
    ("present", "keep", "order"),
    [
        ("11111111", (3, 4), [0, 1, 2, 7, 6, 5]),
        ("10101111", (6, 7), [0, 2, 4, 5]),
        ("11110000", (-1, -1), [3, 2, 1, 0]),
        ("00111100", (2, 5), []),
    ],
)
def test_shed_order(present: str, keep: tuple[int, int], order: list[int]) -> None:
    states = bytearray(VERIFIED if ch == "1" else ABSENT for ch in present)
    assert list(shed_order(states, *keep)) == order


async def test_eviction_runs_beside_the_fills_not_inside_them(tmp_path: Path) -> None:
    """A fill only counts its bytes: tier 1 is over its capacity right after it, and
    the Evictor's pass (its own task, a worker thread each pass, as the mount runs
    it) brings it back within bounds without the filler waiting for it."""
    c = new_cache(tmp_path / "c", capacity=4 * CS)
    passes: list[int] = []
    passed = trio.Event()

    async def disk(fn: Callable[[], None]) -> None:
        await trio.to_thread.run_sync(fn)
        passes.append(c.stats().used_bytes)
        passed.set()

    async with trio.open_nursery() as n:
        n.start_soon(c.evictor.run, disk)
        for k in "abc":
            e = c.open(k, "e", 2 * CS, 0.0)
            e.serve.store(0, bytes(2 * CS))
            c.release(e)
        assert c.stats().used_bytes == 6 * CS  # the stores evicted nothing themselves
        with trio.fail_after(10):  # hang guard: a pass takes milliseconds
            await passed.wait()
        n.cancel_scope.cancel()
    assert passes and passes[-1] <= 4 * CS
    assert cached(c, "a") == 0 and cached(c, "c") == 2 * CS  # oldest first
    c.close()
