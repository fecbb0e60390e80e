"""Lines: how many blocks one node fetches from the origin, or takes from the
shared tier, at once, and in what order.

Why: a herd's nodes read the same blocks in the same order, each asking for a
whole window of them at once (a model prefetch keeps 15 parts in flight). Were
every block of the window claimed at once, the origin link would carry them
all together and, sharing it evenly, they would all land at the same moment at
the window's end; every put, every other node's GET and every load would then
queue behind that moment while the link idled (bench/sharedtier.py, 512 MiB in
two shards: each shard's 15 blocks landed within 0.4 s of each other, their
puts took 2-3 s more, and the link stood idle ~40% of the herd's time). With a
few slots per node the herd keeps a few blocks on the link at a time: they land
one after another, in the order they are read, and each block's put and GETs
overlap the fetch of the blocks after it.

A slot is a claim this node may hold on a block it has not fetched yet; a node
has one more slot than it fetches blocks at once. The extra claim waits, ready,
for the next fetch to end, and starts the moment it does: the link does not
idle while the next block is being claimed (trying the blocks other nodes
claimed first, a claim costs a few round trips: 0.4-1.1 s on the loaded bench
machine, with the link idle meanwhile). A free slot goes to the oldest fill
that wants one (tickets are handed out in the order fills start), so that
blocks are claimed in the order readers need them.

Blocks that land while a node waits for them (several at once, where one
listing shows them) are taken from the shared tier a few at a time, oldest
first, for the same reason: the reader needs the oldest first, and all taken at
once they would all arrive last (1 GiB, a herd of 4: the first blocks of a
shard taken 2-3 s after they were put, behind the blocks after them).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class Slot:
    """One slot taken; given back once, however often `give` is called."""

    def __init__(self, line: Line) -> None:
        self._line: Line | None = line

    def give(self) -> None:
        if self._line is not None:
            self._line._given()
            self._line = None


class Line:
    """`slots` slots, each free one for the oldest ticket in line."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._wanting: set[int] = set()  # tickets waiting for a slot
        self._changed = trio.Event()

    def try_take(self, ticket: int) -> Slot | None:
        """A slot, if one is free for `ticket` (fewer older tickets want one than are
        free); otherwise None, and `ticket` is noted as wanting one."""
        older = sum(1 for t in self._wanting if t < ticket)
        if older < self._free:
            self._free -= 1
            self._drop(ticket)
            return Slot(self)
        self._wanting.add(ticket)
        return None

    async def take(self, ticket: int) -> Slot:
        """A slot, once one is free for `ticket`."""
        try:
            while (slot := self.try_take(ticket)) is None:
                await self.changed(math.inf)
        except BaseException:
            self.leave(ticket)
            raise
        return slot

    def leave(self, ticket: int) -> None:
        """`ticket` wants no slot (any more): its block came, or its fill ended."""
        if ticket in self._wanting:
            self._drop(ticket)

    async def changed(self, timeout: float) -> None:
        """Wait until a slot is given back or the line moves, or `timeout` seconds."""
        with trio.move_on_after(timeout):
            await self._changed.wait()

    def _given(self) -> None:
        self._free += 1
        self._wake()

    def _drop(self, ticket: int) -> None:
        self._wanting.discard(ticket)
        self._wake()  # a younger fill may now be first in line for a free slot

    def _wake(self) -> None:
        """Wake the fills waiting in line, where a slot is free for one of them
        (they look for their block again when woken: no wake for nothing)."""
        if self._free > 0 and self._wanting:
            self._changed.set()
            self._changed = trio.Event()


class OriginSlots(Line):
    """Claims a node may hold on blocks it has not fetched yet: one more than it
    fetches at once."""

    def __init__(self, fetches: int) -> None:
        super().__init__(fetches + 1)
        self._fetches = trio.Semaphore(fetches)  # FIFO: claimed blocks start in order
        self._issued = 0

    def ticket(self) -> int:
        """A new fill's place in line."""
        self._issued += 1
        return self._issued

    @asynccontextmanager
    async def fetching(self, slot: Slot) -> AsyncIterator[None]:
        """While a claimed block comes from the origin: one of the node's fetches
        (it waits here for one), then its slot is given back."""
        try:
            async with self._fetches:
                yield
        finally:
            slot.give()
