"""Model-like files fetched whole into tier 1 in the background (DESIGN §3.6).

safetensors and `torch.load(mmap=True)` read a model by page faults in tensor
order, widened only by kernel readahead: over a network mount that is the
known 30-50x slowdown. So a model-like file's first open starts one
background task that walks the object in order with at most `parallel` parts
in flight (reads that need other parts are not queued behind the whole
object: they claim their own chunks in the fetcher), while faults are served
as chunks arrive. An object larger than half of tier 1 is not fetched whole
(it would evict itself), and a prefetch stops once tier 1 throws its chunks
away (waste.py).

The next shard, ahead (`next_file`; only where a shared tier is configured:
mount.py). A loader reads a sharded model one file after another and opens
the next shard only once it is done with the one before, so the next file's
fetches used to start only then: over a narrow link the link idled at each
shard boundary (a herd of 4 through the shared tier: 0.8-1.5 s per boundary)
while the last blocks of the file before landed, were put and taken. So once
a reader's file has every part handed out (the last parts are in flight) or
is whole in tier 1 already, the file its loader opens next (shards.py names
it) is fetched ahead too: a file's first open, not a use for eviction, with
at most `ahead_parallel` parts in flight until a reader opens it (then
`parallel`). One file ahead only: a file fetched ahead starts the one after
it only once a reader opens it. Its fetches go through the same sources as
any other: in the shared tier, a fill that started later waits behind the
earlier ones for an origin slot (sharedtier/slots.py), so the next file's
blocks are claimed only when the node has none of the file before left to
claim, and a block another node claimed is waited for, never fetched again.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from tierfs.cache import Cache, Entry
from tierfs.globs import glob_to_regex
from tierfs.read.fetcher import Fetcher
from tierfs.read.flights import Flight
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers

log = logging.getLogger(__name__)

Done = Callable[[], Awaitable[None]]
# An object's key -> the file its loader opens next, as the namespace holds it.
NextFile = Callable[[str], ObjectInfo | None]


class _Run:
    """One running prefetch: at most `limit` parts in flight, which may grow (a
    file fetched ahead that a reader opens); whether a reader has opened it
    (`read`) and whether every part of it is handed out (`issued`): with both,
    the next file is fetched ahead."""

    def __init__(self, limit: int, *, read: bool) -> None:
        self.limit = limit
        self.read = read
        self.issued = False
        self._used = 0
        self._changed = trio.Event()

    async def acquire(self) -> None:
        while self._used >= self.limit:
            await self._changed.wait()
        self._used += 1

    def release(self) -> None:
        self._used -= 1
        self._wake()

    def widen(self, limit: int) -> None:
        if limit > self.limit:
            self.limit = limit
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class WholePrefetch:
    def __init__(self, fetcher: Fetcher, cache: Cache, workers: Workers, nursery: trio.Nursery, *,
                 parallel: int, globs: tuple[str, ...] = (), min_size: int = 0,
                 next_file: NextFile | None = None, ahead_parallel: int = 1) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.workers = workers
        self.nursery = nursery
        self.parallel = max(1, parallel)
        self._globs = [glob_to_regex(g) for g in globs]  # model-like names ([read] prefetch_globs)
        self._min_size = min_size
        self._next_file = next_file  # None: no file is fetched ahead of its open
        self.ahead_parallel = max(1, min(ahead_parallel, self.parallel))
        self._running: dict[int, _Run] = {}  # id() of entries with a prefetch running
        self._opening_ahead: set[str] = set()  # keys being opened to be fetched ahead
        self.ahead_started = 0  # files fetched ahead of their open

    def running(self, entry: Entry) -> bool:
        return id(entry) in self._running

    def wants(self, key: str, size: int) -> bool:
        """A model-like file: its name matches a prefetch glob, and it is big enough."""
        base = key.rsplit("/", 1)[-1]
        return size >= self._min_size and any(rx.match(base) for rx in self._globs)

    async def opened(self, key: str, etag: str, size: int, mtime: float, entry: Entry) -> None:
        """An open of `entry`: a model-like file tier 1 lacks some of is fetched whole
        in the background, holding a reference of its own (a close before the end
        does not stop it)."""
        if not self.wants(key, size) or entry.state != "clean":
            return
        run = self._running.get(id(entry))
        if run is not None:  # fetched ahead of this open, or opened before
            run.widen(self.parallel)
            run.read = True
            if run.issued:
                self._ahead(key)
            return
        if entry.serve.complete():
            self._ahead(key)  # the next shard may not be
            return
        held = await self.workers.disk(self.cache.open, key, etag, size, mtime)
        if held is not entry:  # replaced meanwhile: leave it to the next open
            await self.workers.disk(self.cache.release, held)
            return
        self.start(held, self._releasing(held))

    def start(self, entry: Entry, done: Done | None = None, *, ahead: bool = False) -> None:
        """Fetch the whole object into tier 1 in the background, in order. `done` runs
        at the end (e.g. to release the entry it holds). `ahead`: of its reader's
        open (fewer parts in flight until then)."""
        if entry.size > self.fetcher.waste.capacity // 2:
            log.debug("not prefetching %r: larger than half of tier 1", entry.key)
            self.nursery.start_soon(_finish, done)
            return
        run = self._running[id(entry)] = _Run(self.ahead_parallel if ahead else self.parallel,
                                              read=not ahead)
        self.nursery.start_soon(self._run, entry, done, run)

    def _releasing(self, held: Entry) -> Done:
        """A prefetch's end: give back the reference it held."""
        return partial(self.workers.disk, self.cache.release, held)

    def _ahead(self, key: str) -> None:
        """A reader's file `key` has all its parts on the way: fetch the file its
        loader opens next, if there is one and it is not whole in tier 1."""
        info = None if self._next_file is None else self._next_file(key)
        if info is None or not self.wants(info.key, info.size) or info.key in self._opening_ahead:
            return
        self._opening_ahead.add(info.key)
        self.nursery.start_soon(self._fetch_ahead, info)

    async def _fetch_ahead(self, info: ObjectInfo) -> None:
        try:
            held = await self.workers.disk(partial(self.cache.open, use=False), info.key,
                                           info.etag, info.size, info.mtime)
        except OSError as exc:
            log.debug("fetching %r ahead: %s", info.key, exc)
            return
        finally:
            self._opening_ahead.discard(info.key)
        if self.running(held) or held.state != "clean" or held.serve.complete():
            await _finish(self._releasing(held))
            return
        self.ahead_started += 1
        log.info("fetching %r ahead of its open (the shard after the one being read)", info.key)
        self.start(held, self._releasing(held), ahead=True)

    async def _run(self, entry: Entry, done: Done | None, slots: _Run) -> None:
        started = time.monotonic()
        f = self.fetcher
        try:
            async with trio.open_nursery() as n:
                for pa in range(0, entry.size, f.unit):
                    pb = min(pa + f.unit, entry.size)
                    if f.waste.cut(entry):
                        raise OSError(errno.ENOSPC, "tier 1 cannot hold it (chunks evicted unread)")
                    if not entry.serve.missing(pa, pb):
                        continue
                    await slots.acquire()
                    miss = entry.serve.missing(pa, pb)  # again: it may have arrived meanwhile
                    owned = [(x, y, fl) for x, y, fl, owner in
                             (f.claim(entry, miss[0][0], miss[-1][1]) if miss else ()) if owner]
                    if not owned:
                        slots.release()
                        continue
                    n.start_soon(self._parts, entry, owned, slots)
                slots.issued = True
                if slots.read:
                    self._ahead(entry.key)
            log.info("prefetched %r (%d MiB) into tier 1 in %.1fs", entry.key,
                     entry.size >> 20, time.monotonic() - started)
        except Exception as exc:
            log.info("prefetch of %r stopped: %s", entry.key, exc)
        finally:
            del self._running[id(entry)]
            await _finish(done)

    async def _parts(
        self, entry: Entry, owned: list[tuple[int, int, Flight]], slots: _Run
    ) -> None:
        try:
            for a, b, flight in owned:
                await self.fetcher.fetch_part(entry, a, b, flight)
        finally:
            slots.release()


async def _finish(done: Done | None) -> None:
    """Run a prefetch's end callback; what it fails with (say, a full cache disk
    while releasing) is logged, never the end of the daemon's nursery."""
    if done is None:
        return
    with trio.CancelScope(shield=True):
        try:
            await done()
        except Exception as exc:
            log.warning("ending a prefetch: %s", exc)
