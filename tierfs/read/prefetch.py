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
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable

import trio

from tierfs.cache import Cache, Entry
from tierfs.globs import glob_to_regex
from tierfs.read.fetcher import Fetcher
from tierfs.read.flights import Flight
from tierfs.workers import Workers

log = logging.getLogger(__name__)

Done = Callable[[], Awaitable[None]]


class WholePrefetch:
    def __init__(self, fetcher: Fetcher, cache: Cache, workers: Workers, nursery: trio.Nursery, *,
                 parallel: int, globs: tuple[str, ...] = (), min_size: int = 0) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.workers = workers
        self.nursery = nursery
        self.parallel = max(1, parallel)
        self._globs = [glob_to_regex(g) for g in globs]  # model-like names ([read] prefetch_globs)
        self._min_size = min_size
        self._running: set[int] = set()  # id() of entries with a prefetch running

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
        if (not self.wants(key, size) or self.running(entry) or entry.state != "clean"
                or entry.serve.complete()):
            return
        held = await self.workers.disk(self.cache.open, key, etag, size, mtime)
        if held is not entry:  # replaced meanwhile: leave it to the next open
            await self.workers.disk(self.cache.release, held)
            return

        async def done() -> None:
            await self.workers.disk(self.cache.release, held)

        self.start(held, done)

    def start(self, entry: Entry, done: Done | None = None) -> None:
        """Fetch the whole object into tier 1 in the background, in order. `done` runs
        at the end (e.g. to release the entry it holds)."""
        if entry.size > self.fetcher.waste.capacity // 2:
            log.debug("not prefetching %r: larger than half of tier 1", entry.key)
            self.nursery.start_soon(_finish, done)
            return
        self._running.add(id(entry))
        self.nursery.start_soon(self._run, entry, done)

    async def _run(self, entry: Entry, done: Done | None) -> None:
        started = time.monotonic()
        f = self.fetcher
        try:
            async with trio.open_nursery() as n:
                slots = trio.Semaphore(self.parallel)
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
            log.info("prefetched %r (%d MiB) into tier 1 in %.1fs", entry.key,
                     entry.size >> 20, time.monotonic() - started)
        except Exception as exc:
            log.info("prefetch of %r stopped: %s", entry.key, exc)
        finally:
            self._running.discard(id(entry))
            await _finish(done)

    async def _parts(
        self, entry: Entry, owned: list[tuple[int, int, Flight]], slots: trio.Semaphore
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
