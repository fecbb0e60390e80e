"""Opens of a warm walk, prepared ahead of its reader (issue 21, DESIGN §3).

A walk through a directory whose objects tier 1 holds already (a second epoch,
a pass after a remount) has nothing to fetch ahead, yet each open still cost a
worker hop in the reader's path: the index record read, the cache file opened
and, for an object not served since the daemon started, its bytes read and
checked against their checksums (passthrough hands the kernel only verified
files). The reader waited for all of it, the device read included, file after
file. Here the next files of a walk (walkahead.py says which) are opened in
batches, one worker hop per batch while the reader reads the files before
them, so its open finds its entry ready: no hop, no wait.

Bounds: at most PREPARED entries ready or being opened, all walks together;
an entry nobody took within TTL_S is released (each one is a reference: not
evictable while held), so a walk that stops holds nothing for long.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import trio

from tierfs.cache import Cache, Entry
from tierfs.read.bodies import Body
from tierfs.read.releases import Releases
from tierfs.read.walkahead import WalkAhead
from tierfs.read.warm import WarmLoads
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers

log = logging.getLogger(__name__)

PREPARED = 256  # entries ready or queued, all walks together (8 readers x a window of 32)
BATCH = 32  # opens per worker hop; one hop at a time (two made a warm walk slower: GIL)
TTL_S = 2.0  # an entry not taken by then is released


class PreparedOpens:
    def __init__(
        self,
        cache: Cache,
        workers: Workers,
        warm: WarmLoads,
        releases: Releases,
        walk_ahead: WalkAhead,
    ) -> None:
        self.cache = cache
        self.workers = workers
        self.warm = warm  # which opens read the file at once, and their loads (bodies)
        self.releases = releases  # entries nobody took go back in the next batch
        self.walk_ahead = walk_ahead  # fetches ahead what tier 1 lacks; tells what it fetched
        self._queued: OrderedDict[str, ObjectInfo] = OrderedDict()
        self._opening: dict[str, trio.Event] = {}
        self._ready: OrderedDict[str, tuple[Entry, float]] = OrderedDict()  # key -> entry, when
        self._due = trio.Event()
        self.taken = 0  # opens that found their entry ready (tests)

    def want(self, infos: list[ObjectInfo]) -> None:
        """Open these objects ahead of their reader (from the trio loop)."""
        for info in infos:
            k = info.key
            if k in self._queued or k in self._opening or k in self._ready:
                continue
            if len(self._queued) + len(self._opening) + len(self._ready) >= PREPARED:
                break
            self._queued[k] = info
        if self._queued:
            self._due.set()

    async def take(self, key: str, etag: str, size: int) -> Entry | None:
        """The entry of `key` opened ahead, if one is (waiting for its open in
        flight); the caller owns its reference. None: open it yourself."""
        self._queued.pop(key, None)
        opening = self._opening.get(key)
        if opening is not None:
            await opening.wait()
        got = self._ready.pop(key, None)
        if got is None:
            return None
        entry = got[0]
        if entry.etag != etag or entry.size != size:  # the object changed meanwhile
            self.releases.later(entry)
            return None
        self.taken += 1
        return entry

    async def run(self) -> None:
        """For the mount's life (in its nursery): open what is wanted, a batch per
        hop, and release what waited too long. What is ready at shutdown is
        released then."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._take_fetched)
                while True:
                    with trio.move_on_after(TTL_S):
                        await self._due.wait()
                    self._due = trio.Event()
                    self._expire(trio.current_time() - TTL_S)
                    while self._queued:
                        await self._open_batch()
        finally:
            self._expire(float("inf"))

    async def _take_fetched(self) -> None:
        """Objects just fetched ahead of a walk are opened ahead too: their reader's
        open then needs no hop of its own."""
        async for info in self.walk_ahead.fetched:
            self.want([info])

    async def _open_batch(self) -> None:
        batch = [self._queued.popitem(last=False)[1] for _ in range(min(BATCH, len(self._queued)))]
        for info in batch:
            self._opening[info.key] = trio.Event()
        opened: list[tuple[ObjectInfo, Entry | None, Body | None]] = []
        try:
            opened = await self.workers.disk(self._open_all, batch)
        finally:
            now = trio.current_time()
            absent = []
            for info, entry, body in opened:
                if entry is None:
                    absent.append(info)
                    continue
                self._ready[info.key] = (entry, now)
                if body is not None:
                    self.warm.bodies.offer(info.key, entry.etag, body)
            for info in batch:
                self._opening.pop(info.key).set()
            if absent:
                self.walk_ahead.fetch(absent)

    def _open_all(
        self, batch: list[ObjectInfo]
    ) -> list[tuple[ObjectInfo, Entry | None, Body | None]]:
        """(In a worker) open each object whole in tier 1 at its listed version and
        load it; None for one tier 1 lacks (or cannot open: its reader will say
        why). The files to read (to verify them, or the kernel's passthrough
        reads) are all asked of the device first (readahead): their reads are in
        flight together, not one after the other."""
        out: list[tuple[ObjectInfo, Entry | None, Body | None]] = []
        opened: list[tuple[ObjectInfo, Entry]] = []
        for info in batch:
            try:
                entry = self.cache.open_existing(info.key, use=True)
                if entry is not None and not (entry.state == "clean" and entry.etag == info.etag
                                              and entry.size == info.size
                                              and entry.serve.complete()):
                    self.cache.release(entry)  # another version, or not whole: fetch it
                    entry = None
            except (OSError, ValueError) as exc:
                log.debug("opening %r ahead: %s", info.key, exc)
                continue
            if entry is None:
                out.append((info, None, None))
                continue
            if self.warm.read_soon(entry):
                entry.serve.will_need()
            opened.append((info, entry))
        for info, entry in opened:
            try:
                out.append((info, *self.warm.load(entry)))
            except (OSError, ValueError) as exc:  # released by `load`
                log.debug("loading %r ahead: %s", info.key, exc)
        return out

    def _expire(self, before: float) -> None:
        while self._ready:
            key, (entry, at) = next(iter(self._ready.items()))
            if at > before:
                return
            del self._ready[key]
            self.releases.later(entry)
