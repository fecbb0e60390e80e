"""Direct writes acknowledged before tier 1 has them (queued_writes.py), applied
to a real tier-1 entry."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from tierfs.budget import MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.queued_writes import COALESCE, QueuedWrites, WriteQueue

KiB = 1 << 10


class Applied:
    """The real write path (Entry.write in a worker thread), recording each call."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at

    async def __call__(self, entry: Entry, offset: int, data: bytes) -> None:
        self.calls.append((entry.key, offset, len(data)))
        if self.fail_at is not None and offset <= self.fail_at < offset + len(data):
            # A full disk cannot be produced at one chosen offset here; the mount
            # test test_full_cache_disk_gives_enospc_and_loses_nothing does it for real.
            raise OSError(errno.ENOSPC, "No space left on device")
        await trio.to_thread.run_sync(entry.local.write, offset, data)


async def test_writes_apply_in_order_joined_and_reads_wait(cache: Cache) -> None:
    entry = cache.open("ckpt/a.pt", "", 0, 0.0)
    applied = Applied()
    data = os.urandom(3 * COALESCE)
    async with trio.open_nursery() as nursery:
        qw = QueuedWrites(nursery, applied, limit=4 * COALESCE, budget=MemoryBudget(1 << 30))
        q = WriteQueue(entry)
        for off in range(0, len(data), 8 * KiB):  # a stream of small writes
            await qw.submit(q, entry, off, data[off : off + 8 * KiB])
        await qw.submit(q, entry, 100, b"X" * 10)  # overwrites, so it must come last
        await qw.drain_entry(entry)
        assert entry.serve.read(0, len(data)) == data[:100] + b"X" * 10 + data[110:]
        await qw.drain(q)
    assert len(applied.calls) < len(data) // (8 * KiB) // 4  # joined, not one per write
    assert max(n for _, _, n in applied.calls) <= COALESCE + 8 * KiB
    assert qw.queued_bytes == 0
    cache.release(entry)


async def test_queued_bytes_stay_under_the_cap(cache: Cache) -> None:
    entry = cache.open("ckpt/b.pt", "", 0, 0.0)
    peak = 0

    async def slow(e: Entry, off: int, data: bytes) -> None:
        nonlocal peak
        peak = max(peak, qw.queued_bytes)
        await trio.sleep(0.001)
        await trio.to_thread.run_sync(e.local.write, off, data)

    async with trio.open_nursery() as nursery:
        qw = QueuedWrites(nursery, slow, limit=256 * KiB, budget=MemoryBudget(1 << 30))
        q = WriteQueue(entry)
        for i in range(64):
            await qw.submit(q, entry, i * 64 * KiB, bytes([i]) * 64 * KiB)
            assert qw.queued_bytes <= 256 * KiB
        await qw.drain(q)
    assert 0 < peak <= 256 * KiB
    assert entry.serve.read(63 * 64 * KiB, 1) == bytes([63])
    cache.release(entry)


async def test_a_failed_write_sticks_to_its_handle(cache: Cache) -> None:
    entry = cache.open("ckpt/c.pt", "", 0, 0.0)
    other = cache.open("ckpt/d.pt", "", 0, 0.0)
    applied = Applied(fail_at=2 * 128 * KiB + 10)  # the third write fails
    async with trio.open_nursery() as nursery:
        budget = MemoryBudget(1 << 30)
        qw = QueuedWrites(nursery, applied, limit=1 << 30, budget=budget)
        q, q2 = WriteQueue(entry), WriteQueue(other)
        for i in range(8):  # gaps between writes: none are joined
            await qw.submit(q, entry, i * 128 * KiB, b"w" * 64 * KiB)
        await qw.submit(q2, other, 0, b"fine")
        with pytest.raises(OSError) as exc:
            await qw.drain(q)
        assert exc.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as exc:  # and every later write, fsync, close
            await qw.submit(q, entry, 0, b"again")
        assert exc.value.errno == errno.ENOSPC
        with pytest.raises(OSError):
            await qw.drain(q)
        await qw.drain(q2)  # another handle is not affected
    assert qw.queued_bytes == 0  # what was queued behind the failure is dropped
    assert budget.used == 0  # and its memory is given back
    assert [off for key, off, _ in applied.calls if key == entry.key] == [0, 128 * KiB, 256 * KiB]
    assert other.serve.read(0, 4) == b"fine"
    cache.release(entry)
    cache.release(other)
