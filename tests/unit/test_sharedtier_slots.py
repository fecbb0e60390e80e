"""The origin slots' line (tierfs/sharedtier/slots.py): who gets a free slot, and
when a fill in line is woken. A node fetching F blocks at once has F + 1 slots."""

from __future__ import annotations

import trio
import trio.testing

from tierfs.sharedtier.slots import Line, OriginSlots


def one_slot_left() -> OriginSlots:
    """A node fetching one block at once (two slots), one of them taken for good."""
    slots = OriginSlots(1)
    assert slots.try_take(slots.ticket()) is not None
    return slots


def test_a_free_slot_goes_to_the_oldest_fill_that_wants_one() -> None:
    slots = one_slot_left()
    first, second, third = slots.ticket(), slots.ticket(), slots.ticket()
    held = slots.try_take(second)
    assert held is not None
    assert slots.try_take(third) is None  # none free: third waits in line
    assert slots.try_take(first) is None  # so does first
    held.give()
    assert slots.try_take(third) is None  # first is older
    taken = slots.try_take(first)
    assert taken is not None
    taken.give()
    assert slots.try_take(third) is not None


def test_a_fill_that_leaves_the_line_lets_younger_ones_take_the_slot() -> None:
    slots = one_slot_left()
    busy = slots.try_take(slots.ticket())
    old, young = slots.ticket(), slots.ticket()
    assert slots.try_take(old) is None
    assert busy is not None
    busy.give()
    assert slots.try_take(young) is None  # old still wants it
    slots.leave(old)  # its block came from the shared tier
    assert slots.try_take(young) is not None


def test_a_slot_is_given_back_once() -> None:
    slots = OriginSlots(1)
    a = slots.try_take(slots.ticket())
    assert a is not None
    a.give()
    a.give()
    assert slots.try_take(slots.ticket()) is not None
    assert slots.try_take(slots.ticket()) is not None
    assert slots.try_take(slots.ticket()) is None  # still two slots, not three


async def test_fills_in_line_wake_when_a_slot_is_given_back(
    mock_clock: trio.testing.MockClock,
) -> None:
    slots = one_slot_left()
    held = slots.try_take(slots.ticket())
    waiting = slots.ticket()
    assert held is not None and slots.try_take(waiting) is None
    woke: list[float] = []

    async def wait() -> None:
        await slots.changed(100.0)
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(3.0)
        held.give()
    assert woke == [3.0]


async def test_a_fill_cancelled_while_in_line_leaves_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    mock_clock.autojump_threshold = 0
    line = Line(1)
    held = line.try_take(1)
    assert held is not None
    with trio.move_on_after(1.0):
        await line.take(2)  # waits: cancelled before the slot is back
    held.give()
    assert line.try_take(3) is not None  # 2 is not ahead of it any more
