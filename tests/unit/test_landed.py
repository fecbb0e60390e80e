"""Just-fetched parts kept in memory (landed.py) and the aligned buffers under them,
all counted in the memory budget (budget.py)."""

from __future__ import annotations

import os

import trio
import trio.testing

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache
from tierfs.cache.directio import ALIGN, aligned_buffer, is_aligned
from tierfs.read.landed import LandedParts

KiB = 1 << 10
CS = 64 * KiB
PART = 4 * CS



async def landed_part(pool: BufferPool, data: bytes) -> memoryview:
    buf = await pool.take(len(data))
    buf[: len(data)] = data
    return buf


async def test_buffers_are_aligned_reused_and_counted() -> None:
    budget = MemoryBudget(16 * PART)
    pool = BufferPool(budget, PART, keep=2)
    a = await pool.take(PART)
    assert is_aligned(a) and len(a) == PART
    assert not is_aligned(memoryview(bytes(8)))  # read-only memory never counts
    pool.give(a)
    assert budget.used == PART  # an idle pooled buffer still counts
    assert await pool.take(100) is a  # smaller requests share the pool's size
    big = await pool.take(PART + 1)
    assert len(big) % ALIGN == 0 and len(big) > PART and is_aligned(big)
    assert budget.used == PART + len(big)
    pool.give(big)  # not the pool's size: dropped, not kept
    assert budget.used == PART
    assert await pool.take(PART) is not big


async def test_a_spent_budget_waits_and_takes_back_idle_buffers() -> None:
    budget = MemoryBudget(2 * PART + ALIGN)
    pool = BufferPool(budget, PART, keep=2)
    a, b = await pool.take(PART), await pool.take(PART)
    assert pool.take_now(PART) is None  # optional work gives up at once
    pool.give(a)  # idle: counted, and given up when someone needs the room
    with trio.fail_after(5):
        c = await pool.take(PART + 1)  # bigger than the pool's size: not a reuse
    assert budget.used == PART + len(c) == budget.limit
    got: list[memoryview] = []

    async def waiter() -> None:
        got.append(await pool.take(PART))

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert not got  # nothing to take: it waits (in trio)
            pool.give(c)
    assert len(got) == 1 and budget.used == 2 * PART
    pool.give(b)
    pool.give(got[0])


async def test_a_landed_part_serves_ranges_inside_it_only(cache: Cache) -> None:
    data = os.urandom(2 * PART)
    e = cache.open("k", "e1", len(data), 1.0)
    pool = BufferPool(MemoryBudget(16 * PART), PART, keep=8)
    landed = LandedParts(pool, capacity=4 * PART)
    landed.land(e, PART, 2 * PART, await landed_part(pool, data[PART:]))
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


async def test_a_local_write_stops_serving_the_fetched_bytes(cache: Cache) -> None:
    data = os.urandom(PART)
    e = cache.open("k", "e1", len(data), 1.0)
    e.serve.store(0, data)
    pool = BufferPool(MemoryBudget(16 * PART), PART, keep=8)
    landed = LandedParts(pool, capacity=4 * PART)
    landed.land(e, 0, PART, await landed_part(pool, data))
    assert landed.pin(e, 0, 10) is not None
    e.local.write(0, b"new")  # dirty now: tier 1 holds other bytes than the store sent
    assert landed.pin(e, 0, 10) is None
    cache.release(e)


async def test_capacity_evicts_oldest_but_never_a_buffer_being_copied(cache: Cache) -> None:
    data = os.urandom(4 * PART)
    e = cache.open("k", "e1", len(data), 1.0)
    pool = BufferPool(MemoryBudget(16 * PART), PART, keep=8)
    landed = LandedParts(pool, capacity=2 * PART)
    bufs = [await landed_part(pool, data[i * PART : (i + 1) * PART]) for i in range(3)]
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


async def test_landed_parts_give_memory_back_when_the_budget_asks(cache: Cache) -> None:
    data = os.urandom(3 * PART)
    e = cache.open("k", "e1", len(data), 1.0)
    budget = MemoryBudget(3 * PART)
    pool = BufferPool(budget, PART, keep=0)
    landed = LandedParts(pool, capacity=3 * PART)
    for i in range(3):
        landed.land(e, i * PART, (i + 1) * PART,
                    await landed_part(pool, data[i * PART : (i + 1) * PART]))
    assert budget.used == 3 * PART
    with trio.fail_after(5):
        buf = await pool.take(PART)  # the budget is spent: the oldest landed part goes
    assert landed.pin(e, 0, 10) is None and landed.pin(e, 2 * PART, 2 * PART + 10) is not None
    assert budget.used == 3 * PART
    pool.give(buf)
    cache.release(e)


async def test_a_capped_pool_makes_room_from_idle_buffers_of_another_size() -> None:
    """Upload part buffers: a pool capped at one part, exact sizes (a file's last
    part is shorter). An idle full-size buffer must make room for a short one,
    not wait for itself (a hang seen with max_parallel_puts = 1)."""
    budget = MemoryBudget(16 * PART)
    pool = BufferPool(budget, PART, keep=1, cap=PART, exact=True)
    full = await pool.take(PART)
    assert len(full) == PART and isinstance(full.obj, bytearray)
    pool.give(full)  # idle now, and it fills the cap
    with trio.fail_after(5):
        short = await pool.take(PART // 2)
    assert len(short) == PART // 2 and budget.used == PART // 2
    pool.give(short)
    assert budget.used == 0  # not the pool's size: not kept
