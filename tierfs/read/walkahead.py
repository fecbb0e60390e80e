"""Fetching ahead of a walk through a directory of small objects (issue 21,
DESIGN §3).

`cat dir/*`, `xargs -P8 cat` or a DataLoader over a directory of images opens
one small object after another; alone, each open waits for its own GET, so
the walk runs at one store round trip per file. walks.py sees a walk over the
positions of the directory's listing (sorted names, as `ls` and the store list
them); this module turns what it asks for into whole-object fetches into tier
1, so the reader's next opens find their objects there (and their bytes in
memory: bodies.py) or already in flight (the open waits for that fetch:
`reading`). A fetch ahead is the fetcher's `fetch_whole` (one worker hop: GET
and the new tier-1 file, one index transaction); what it fetched is then
opened ahead (`fetched`, taken by prepared.py), a batch per hop.

Bounds: at most `parallel` fetches at a time (one GET slot is left to demand
reads), each taking its object's bytes from the memory budget while in
flight; at most walks.py's window of files ahead of each walk, and QUEUED
objects waiting overall (more are not fetched ahead: the reader fetches them
itself). Only clean objects up to `whole_max` qualify (bigger files have their
own readahead), nothing is fetched while the store is known down, and a fetch
ahead is not a use for eviction (the reader's own open is).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping

import trio

from tierfs.health import StoreHealth
from tierfs.read.fetcher import Fetcher
from tierfs.read.walks import DIRS, Walks
from tierfs.store.base import ObjectInfo, StoreError

log = logging.getLogger(__name__)

QUEUED = 1024  # objects waiting to be fetched ahead, all walks together


class _Order:
    """A directory's names in listing order, and each one's position."""

    def __init__(self, children: Mapping[str, int]) -> None:
        self.children = children
        self.names = sorted(children)
        self.pos = {n: i for i, n in enumerate(self.names)}


class WalkAhead:
    def __init__(
        self,
        fetcher: Fetcher,
        health: StoreHealth,
        *,
        children: Callable[[str], Mapping[str, int] | None],
        stored: Callable[[int], ObjectInfo | None],
        whole_max: int,
        parallel: int,
        walks: Walks,
    ) -> None:
        self.fetcher = fetcher
        self.health = health
        self._children = children  # a directory's path -> its entries (name -> inode)
        self._stored = stored  # inode -> the file's store attributes, if it is a stored file
        self.whole_max = whole_max
        self.parallel = max(1, parallel)
        self.walks = walks
        self._orders: OrderedDict[str, _Order] = OrderedDict()
        self._send, self._queue = trio.open_memory_channel[ObjectInfo](QUEUED)
        self._wanted: set[str] = set()  # keys queued or being fetched
        self._ahead: OrderedDict[str, bool] = OrderedDict()  # fetched ahead, not opened since
        self._reading: Counter[str] = Counter()  # keys open by readers (handles.py)
        # Objects just fetched ahead, to be opened ahead too (prepared.py takes them:
        # their reader's open then needs no hop of its own); none kept when it lags.
        self._tell, self.fetched = trio.open_memory_channel[ObjectInfo](QUEUED)

    def opened(self, key: str, present: bool) -> list[ObjectInfo]:
        """The reader opened object `key` (from the trio loop), whole in tier 1 or
        not (`present`): if this open continues a walk, the objects its walk wants
        next. A walk over objects tier 1 held before (not fetched ahead here: a
        warm pass) gets them back, to be opened ahead (prepared.py: their next
        files are most likely in tier 1 too); for any other walk they are queued
        for fetching and none is returned."""
        directory, _, name = key.rpartition("/")
        order = self._order(directory)
        if order is None or name not in order.pos:
            return []
        infos = []
        for p in self.walks.opened(directory, order.pos[name], len(order.names)):
            inode = order.children.get(order.names[p])
            info = self._stored(inode) if inode is not None else None
            if info is not None and 0 < info.size <= self.whole_max:
                infos.append(info)
        if present and not self._ahead.pop(key, False) and key not in self._wanted:
            return infos
        self.fetch(infos)
        return []

    def fetch(self, infos: list[ObjectInfo]) -> None:
        """Fetch these objects ahead of their reader, as many as the queue takes."""
        for info in infos:
            if info.key in self._wanted:
                continue
            try:
                self._send.send_nowait(info)
            except trio.WouldBlock:
                return  # enough queued: the reader fetches the rest itself
            self._wanted.add(info.key)

    def _order(self, directory: str) -> _Order | None:
        children = self._children(directory)
        if children is None:
            return None
        order = self._orders.pop(directory, None)
        if order is None or order.children is not children or len(order.names) != len(children):
            order = _Order(children)  # a new listing, or entries added or removed here
        self._orders[directory] = order
        if len(self._orders) > DIRS:
            self._orders.popitem(last=False)
        return order

    async def run(self) -> None:
        """The fetchers, for the mount's life (in its nursery)."""
        async with trio.open_nursery() as n:
            for _ in range(self.parallel):
                n.start_soon(self._fetcher)

    async def reading(self, key: str) -> None:
        """A reader opens `key` (until `done_reading`): a fetch ahead of it in flight
        now is waited for (the open then finds it in tier 1 and its bytes in
        memory), and none starts while the reader holds it (its reads fetch what
        tier 1 lacks). Both sides decide on the trio loop, so a GET never runs
        twice beside itself."""
        self._reading[key] += 1
        flight = self.fetcher.objects.get(key)
        if flight is not None:
            await flight.done.wait()

    def done_reading(self, key: str) -> None:
        self._reading[key] -= 1
        if self._reading[key] <= 0:
            del self._reading[key]

    async def _fetcher(self) -> None:
        async for info in self._queue:
            if info.key in self._reading:
                self._wanted.discard(info.key)
                continue
            try:
                if not self.health.degraded:
                    await self._fetch(info)
            except (OSError, StoreError) as exc:  # the reader's own read reports it
                log.debug("fetch ahead of %r: %s", info.key, exc)
            finally:
                self._wanted.discard(info.key)

    async def _fetch(self, info: ObjectInfo) -> None:
        fetched, body = await self.fetcher.fetch_whole(info)
        if not fetched:
            return  # tier 1 had it
        if body is not None:
            self.fetcher.bodies.offer(info.key, info.etag, body)  # its reader's read: no hop
        self._ahead[info.key] = True
        with contextlib.suppress(trio.WouldBlock):
            self._tell.send_nowait(info)
        if len(self._ahead) > 2 * QUEUED:
            self._ahead.popitem(last=False)
