"""Just-fetched parts kept in memory (landed.py) and the aligned buffers under them."""

from __future__ import annotations

import os

from tierfs.cache import Cache
from tierfs.cache.directio import ALIGN, BufferPool, aligned_buffer, is_aligned
from tierfs.read.landed import LandedParts

KiB = 1 << 10
CS = 64 * KiB
PART = 4 * CS



def landed_part(pool: BufferPool, data: bytes) -> memoryview:
    buf = pool.take(len(data))
    buf[: len(data)] = data
    return buf


def test_buffers_are_aligned_and_reused() -> None:
    pool = BufferPool(PART, keep=2)
    a = pool.take(PART)
    assert is_aligned(a) and len(a) == PART
    assert not is_aligned(memoryview(bytes(8)))  # read-only memory never counts
    pool.give(a)
    assert pool.take(100) is a  # smaller requests share the pool's size
    big = pool.take(PART + 1)
    assert len(big) % ALIGN == 0 and len(big) > PART and is_aligned(big)
    pool.give(big)  # not the pool's size: dropped, not kept
    assert pool.take(PART) is not big


def test_a_landed_part_serves_ranges_inside_it_only(cache: Cache) -> None:
    data = os.urandom(2 * PART)
    e = cache.open("k", "e1", len(data), 1.0)
    pool = BufferPool(PART, keep=8)
    landed = LandedParts(pool, capacity=4 * PART)
    landed.land(e, PART, 2 * PART, landed_part(pool, data[PART:]))
    out = aligned_buffer(PART)
    part = landed.pin(e, PART + 5, PART + 5 + 1000)
    assert part is not None
    assert bytes(landed.copy_out(part, PART + 5, PART + 5 + 1000, out)) == data[PART + 5 : PART + 1005]
    assert landed.pin(e, PART - 1, PART + 10) is None  # starts before the part
    assert landed.pin(e, 0, 100) is None  # another part
    other = cache.open("k2", "e1", len(data), 1.0)
    assert landed.pin(other, PART, PART + 10) is None  # another object, same offsets
    cache.release(other)
    cache.release(e)


def test_a_local_write_stops_serving_the_fetched_bytes(cache: Cache) -> None:
    data = os.urandom(PART)
    e = cache.open("k", "e1", len(data), 1.0)
    e.store(0, data)
    pool = BufferPool(PART, keep=8)
    landed = LandedParts(pool, capacity=4 * PART)
    landed.land(e, 0, PART, landed_part(pool, data))
    assert landed.pin(e, 0, 10) is not None
    e.write(0, b"new")  # dirty now: tier 1 holds other bytes than the store sent
    assert landed.pin(e, 0, 10) is None
    cache.release(e)


def test_capacity_evicts_oldest_but_never_a_buffer_being_copied(cache: Cache) -> None:
    data = os.urandom(4 * PART)
    e = cache.open("k", "e1", len(data), 1.0)
    pool = BufferPool(PART, keep=8)
    landed = LandedParts(pool, capacity=2 * PART)
    bufs = [landed_part(pool, data[i * PART : (i + 1) * PART]) for i in range(3)]
    landed.land(e, 0, PART, bufs[0])
    landed.land(e, PART, 2 * PART, bufs[1])
    pinned = landed.pin(e, 0, 100)  # a read is copying out of part 0 ...
    assert pinned is not None
    landed.land(e, 2 * PART, 3 * PART, bufs[2])  # ... when part 2 pushes it out
    assert landed.pin(e, 0, 100) is None  # gone for new readers
    assert all(b is not bufs[0] for b in pool._free)  # but not reusable yet
    out = aligned_buffer(PART)
    assert bytes(landed.copy_out(pinned, 0, 100, out)) == data[:100]  # bytes intact
    assert any(b is bufs[0] for b in pool._free)  # back in the pool after the copy
    part = landed.pin(e, PART, PART + 1)
    assert part is not None
    landed.copy_out(part, PART, PART + 1, out)
    cache.release(e)
