"""Blocking calls off the trio loop (workers.py): outcome, slots, backoff, cancellation."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from tierfs.store import retry
from tierfs.workers import Kind


async def test_a_call_runs_in_another_thread_and_returns_or_raises() -> None:
    kind = Kind(2)
    loop = threading.get_ident()
    assert await kind.run(threading.get_ident) != loop
    with pytest.raises(ZeroDivisionError):
        await kind.run(lambda: 1 // 0)
    assert await kind.run(sum, [1, 2, 3]) == 6


async def test_no_more_calls_run_at_once_than_the_kind_has_slots() -> None:
    kind = Kind(2)
    gate = threading.Event()
    running = 0
    peak = 0
    changed = threading.Condition()

    def call() -> None:
        nonlocal running, peak
        with changed:
            running += 1
            peak = max(peak, running)
            changed.notify_all()
        gate.wait(10)
        with changed:
            running -= 1

    def two_inside() -> None:  # the two that hold slots have entered their threads
        with changed:
            assert changed.wait_for(lambda: running == 2, timeout=10)

    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(kind.run, call)
        await trio.testing.wait_all_tasks_blocked()
        await trio.to_thread.run_sync(two_inside)
        gate.set()
    assert peak == 2


async def test_a_call_backing_off_lends_its_slot_and_takes_it_back(mock_clock: trio.testing.MockClock) -> None:
    """store/retry.py's pause, from the worker thread, waits in trio with the
    slot free meanwhile (trio's clock stands still until the test moves it)."""
    kind = Kind(1)
    pausing = threading.Event()
    order: list[str] = []

    def backs_off() -> str:
        pause = retry._current.pause  # what Kind.run installed for this thread
        pausing.set()
        pause(60)
        order.append("retried")
        return "done"

    async with trio.open_nursery() as n:
        async def first() -> None:
            assert await kind.run(backs_off) == "done"

        n.start_soon(first)
        await trio.to_thread.run_sync(pausing.wait)
        await kind.run(order.append, "other")  # in the lent slot
        assert order == ["other"]
        mock_clock.jump(60)
    assert order == ["other", "retried"]


async def test_a_started_call_is_waited_for_when_its_caller_is_cancelled() -> None:
    """A thread cannot be stopped: its caller learns its end, so no fd or buffer
    it uses is given back while it still runs."""
    kind = Kind(1)
    started = threading.Event()
    release = threading.Event()
    finished: list[bool] = []

    def call() -> None:
        started.set()
        release.wait(10)
        finished.append(True)

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as n:
            n.start_soon(kind.run, call)
            await trio.to_thread.run_sync(started.wait)
            # The thread ends only after the cancel: a caller let go at the cancel
            # would leave the nursery with `finished` still empty.
            threading.Timer(0.2, release.set).start()
            scope.cancel()
    assert finished == [True]
