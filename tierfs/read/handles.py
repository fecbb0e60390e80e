"""Read-only opens: what `open` returns for reading, and how any handle reads.

`ReadPath.open` gets the object's tier-1 entry (opened ahead by prepared.py
when a warm walk reaches it), decides whether to fetch a model-like file whole
in the background (DESIGN §3.6) and tells walkahead.py of the open (a walk
through a directory of small objects gets its next files fetched, or opened
ahead when tier 1 holds them). `ReadPath.read` is the
read of every handle, read-only or writable: it first waits for writes to the
file that were acknowledged and not yet applied (queued_writes.py: direct
writes), a store known to be down fails at once for bytes tier
1 lacks, and each read's latency is recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from tierfs.cache import Cache, Entry
from tierfs.config import ClassSettings
from tierfs.health import StoreHealth
from tierfs.queued_writes import QueuedWrites
from tierfs.read.bodies import Body
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.prepared import PreparedOpens
from tierfs.read.reader import Reader
from tierfs.read.releases import Releases
from tierfs.read.sequential import ReadState
from tierfs.read.served import Served
from tierfs.read.walkahead import WalkAhead
from tierfs.read.warm import WarmLoads
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)


class ReadPath:
    def __init__(
        self,
        reader: Reader,
        cache: Cache,
        workers: Workers,
        health: StoreHealth,
        *,
        walk_ahead: WalkAhead,
        prepared: PreparedOpens,
        warm: WarmLoads,
        releases: Releases,
        prefetch: WholePrefetch,
        observe_latency: Callable[[float], None],
        queued: QueuedWrites,
        refresh: Callable[[str], Awaitable[ObjectInfo]],
    ) -> None:
        self.reader = reader
        self.cache = cache
        self.workers = workers
        self.health = health
        self.walk_ahead = walk_ahead
        self.prepared = prepared
        self.warm = warm
        self.releases = releases
        self.whole_prefetch = prefetch
        self._observe_latency = observe_latency
        self.queued = queued  # writes acknowledged, not yet in tier 1
        self.refresh = refresh  # the store's current version of a key (Namespace.refresh)

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
        ready = await self.prepared.take(key, etag, size)
        if ready is not None:
            entry = ready
        else:
            opened = await self.workers.disk(self._open, key, etag, size, mtime)
            if opened is None:  # this mount's file, landed and evicted since the look
                info = await self.refresh(key)
                etag, size = info.etag, info.size
                opened = await self.workers.disk(self._open, key, etag, size, info.mtime)
                assert opened is not None
            entry, body = opened
            if body is not None:
                self.warm.bodies.offer(key, entry.etag, body)
        try:
            await self.whole_prefetch.opened(key, etag, size, mtime, entry)
        except BaseException:
            await self.workers.disk(self.cache.release, entry)
            raise
        warm = self.walk_ahead.opened(key, present=entry.state == "clean" and entry.serve.complete())
        if warm:
            self.prepared.want(warm)
        return ReadHandle(self, key, entry, settings)

    def _open(self, key: str, etag: str, size: int, mtime: float) -> tuple[Entry, Body | None] | None:
        """(In a worker) the tier-1 entry of an object, loaded (`load`) in the same
        hop; None for a file this mount wrote (`etag` "") that tier 1 no longer
        holds (Cache.open_seen)."""
        entry = self.cache.open_seen(key, etag, size, mtime)
        return None if entry is None else self.warm.load(entry)

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, settings: ClassSettings
    ) -> Served:
        await self.queued.drain_entry(entry)
        started = time.perf_counter()
        if self.health.degraded and entry.state == "clean" and entry.serve.missing_pages(off, off + size):
            # The store is known down: bytes tier 1 lacks fail at once, not after
            # another store deadline (the kernel retries a failed readahead with
            # a second read, which would double the caller's wait).
            raise StoreError("store unreachable (degraded mode)", kind="unreachable")
        data = await self.reader.read(entry, state, off, size, settings.readahead_max)
        self._observe_latency(time.perf_counter() - started)
        return data

    def release(self, key: str, entry: Entry) -> None:
        """A read handle of `key` was closed: its entry is released by `run`."""
        self.walk_ahead.done_reading(key)
        self.releases.later(entry)

    async def run(self) -> None:
        """For the mount's life (in its nursery): open ahead what warm walks want
        (prepared.py) and release the entries of closed read handles in batches
        (releases.py). What is left at shutdown (entries opened ahead included)
        is released then."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.prepared.run)
                nursery.start_soon(self.releases.run)
        finally:
            with trio.CancelScope(shield=True):
                await self.releases.flush()


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

    async def read(self, off: int, size: int) -> Served:
        return await self._path.read(self.entry, self.state, off, size, self.settings)

    async def flush(self) -> None:
        """close(2) of a read-only handle: nothing to do."""

    async def fsync(self) -> None:
        """Nothing written through this handle."""

    async def release(self) -> None:
        self._path.release(self._key, self.entry)
