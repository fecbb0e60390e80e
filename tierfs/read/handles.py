"""Read-only opens: what `open` returns for reading, and how any handle reads.

`ReadPath.open` gets the object's tier-1 entry, decides whether to fetch a
model-like file whole in the background (DESIGN §3.6) and tells walkahead.py
of the open (a walk through a directory of small objects gets its next files
fetched). `ReadPath.read` is the
read of every handle, read-only or writable: it first waits for writes to the
file that were acknowledged and not yet applied (`settle`: the write path's
queued direct writes), a store known to be down fails at once for bytes tier
1 lacks, and each read's latency is recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from tierfs.cache import Cache, ChunkCorrupt, Entry
from tierfs.config import ClassSettings
from tierfs.globs import glob_to_regex
from tierfs.health import StoreHealth
from tierfs.read.reader import Reader
from tierfs.read.streams import ReadState
from tierfs.read.walkahead import WalkAhead
from tierfs.store.base import StoreError
from tierfs.workers import Workers

# Closes gathered into one release batch: a serial walk closes a file every ~1 ms,
# so a batch started at once held one close (a hop and a commit per file).
RELEASE_GATHER_S = 0.005
RELEASE_BATCH_MAX = 256

log = logging.getLogger(__name__)


class ReadPath:
    def __init__(
        self,
        reader: Reader,
        cache: Cache,
        workers: Workers,
        health: StoreHealth,
        *,
        prefetch_globs: tuple[str, ...],
        prefetch_min_size: int,
        observe_latency: Callable[[float], None],
        settle: Callable[[Entry], Awaitable[None]],
        walk_ahead: WalkAhead,
    ) -> None:
        self.reader = reader
        self.walk_ahead = walk_ahead
        self.settle = settle
        self.cache = cache
        self.workers = workers
        self.health = health
        self._prefetch = [glob_to_regex(g) for g in prefetch_globs]
        self._prefetch_min = prefetch_min_size
        self._observe_latency = observe_latency
        self._releasing: list[Entry] = []  # entries of read handles closed, to release
        self._release_due = trio.Event()

    async def open(
        self, key: str, etag: str, size: int, mtime: float, settings: ClassSettings
    ) -> ReadHandle:
        await self.walk_ahead.reading(key)
        try:
            return await self._open_handle(key, etag, size, mtime, settings)
        except BaseException:
            self.walk_ahead.done_reading(key)
            raise

    async def _open_handle(
        self, key: str, etag: str, size: int, mtime: float, settings: ClassSettings
    ) -> ReadHandle:
        entry, body = await self.workers.disk(self._open, key, etag, size, mtime)
        if body is not None:
            self.reader.bodies.offer(key, entry.etag, body)
        try:
            if self._wants_prefetch(key, size) and not self.reader.prefetching(entry):
                await self._prefetch_object(key, etag, size, mtime, entry)
        except BaseException:
            await self.workers.disk(self.cache.release, entry)
            raise
        self.walk_ahead.opened(key, present=entry.state == "clean" and not entry.missing(0, size))
        return ReadHandle(self, key, entry, settings)

    def _open(self, key: str, etag: str, size: int, mtime: float) -> tuple[Entry, bytes | None]:
        """(In a worker) the tier-1 entry, and a whole small object's bytes if tier 1
        holds all of them and none was served since the daemon started (a warm pass
        after a remount: its first read would verify them in a worker hop of its
        own): loaded and verified in this same hop, its reads need none (bodies.py).
        An object served before is not loaded: the kernel may well still hold its
        pages (keep_cache), and a load for nothing would cost a device read per open."""
        entry = self.cache.open(key, etag, size, mtime)
        if (
            not 0 < entry.size <= self.reader.whole_max
            or entry.state != "clean"
            or self.reader.bodies.cap < entry.size
            or self.reader.bodies.has(key, entry.etag)
            or entry.missing(0, entry.size)
            or entry.servable_now(0, entry.size)
        ):
            return entry, None
        try:
            return entry, entry.read_whole()
        except (KeyError, ChunkCorrupt):  # evicted meanwhile, or corrupt: the read path refetches
            return entry, None
        except BaseException:
            self.cache.release(entry)
            raise

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, settings: ClassSettings
    ) -> bytes | memoryview:
        await self.settle(entry)
        started = time.perf_counter()
        if self.health.degraded and entry.state == "clean" and entry.missing_pages(off, off + size):
            # The store is known down: bytes tier 1 lacks fail at once, not after
            # another store deadline (the kernel retries a failed readahead with
            # a second read, which would double the caller's wait).
            raise StoreError("store unreachable (degraded mode)", kind="unreachable")
        data = await self.reader.read(entry, state, off, size, settings.readahead_max)
        self._observe_latency(time.perf_counter() - started)
        return data

    def release(self, key: str, entry: Entry) -> None:
        """A read handle of `key` was closed: its entry is released by `run_releases`."""
        self.walk_ahead.done_reading(key)
        self._releasing.append(entry)
        self._release_due.set()

    async def run_releases(self) -> None:
        """For the mount's life (in its nursery): release the entries of closed read
        handles, all those closed since the last batch in one worker hop and one
        index transaction (Cache.release_many). A walk through 10,000 small
        files closes one a file: a hop and a commit each were a fifth of the
        daemon's CPU (issue 21), so a batch waits RELEASE_GATHER_S for the
        closes that follow its first. An entry released a few ms late only
        stays unevictable that long. What is left at shutdown is released then."""
        try:
            while True:
                await self._release_due.wait()
                if len(self._releasing) < RELEASE_BATCH_MAX:
                    await trio.sleep(RELEASE_GATHER_S)
                self._release_due = trio.Event()
                await self._release_batch()
        finally:
            with trio.CancelScope(shield=True):
                await self._release_batch()

    async def _release_batch(self) -> None:
        batch, self._releasing = self._releasing, []
        if not batch:
            return
        try:
            await self.workers.disk(self.cache.release_many, batch)
        except (OSError, ValueError) as exc:  # the index: its uses are lost, nothing else
            log.warning("releasing %d closed file(s): %s", len(batch), exc)

    def _wants_prefetch(self, key: str, size: int) -> bool:
        if size < self._prefetch_min:
            return False
        base = key.rsplit("/", 1)[-1]
        return any(rx.match(base) for rx in self._prefetch)

    async def _prefetch_object(
        self, key: str, etag: str, size: int, mtime: float, entry: Entry
    ) -> None:
        """Model-like file (DESIGN §3.6): fetch it whole into tier 1 in the background,
        holding a reference of its own so a close before the end does not stop it."""
        if entry.state != "clean" or not entry.missing(0, entry.size):
            return
        held = await self.workers.disk(self.cache.open, key, etag, size, mtime)
        if held is not entry:  # replaced meanwhile: leave it to the next open
            await self.workers.disk(self.cache.release, held)
            return

        async def done() -> None:
            await self.workers.disk(self.cache.release, held)

        self.reader.prefetch_object(held, done)


class ReadHandle:
    """A handle opened for reading only."""

    direct = False  # reads keep the kernel page cache (keep_cache per class)
    flushes = False  # its flush does nothing: the kernel need not send it (FOPEN_NOFLUSH)

    def __init__(self, path: ReadPath, key: str, entry: Entry, settings: ClassSettings) -> None:
        self._path = path
        self._key = key
        self.entry = entry
        self.settings = settings
        self.state = ReadState()

    @property
    def keep_cache(self) -> bool:
        return self.settings.keep_cache

    async def read(self, off: int, size: int) -> bytes | memoryview:
        return await self._path.read(self.entry, self.state, off, size, self.settings)

    async def flush(self) -> None:
        """close(2) of a read-only handle: nothing to do."""

    async def fsync(self) -> None:
        """Nothing written through this handle."""

    async def release(self) -> None:
        self._path.release(self._key, self.entry)
