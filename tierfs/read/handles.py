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

from tierfs.cache import Cache, ChunkCorrupt, Entry
from tierfs.config import ClassSettings
from tierfs.globs import glob_to_regex
from tierfs.health import StoreHealth
from tierfs.queued_writes import QueuedWrites
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.prepared import PreparedOpens
from tierfs.read.reader import Reader
from tierfs.read.streams import ReadState
from tierfs.read.walkahead import WalkAhead
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers

# Closes gathered into one release batch: a warm walk closes a file every ~0.5 ms.
# A batch started at once held one close (a hop and a commit per file); one
# gathered for 5 ms about ten, and its hops were still a tenth of a warm walk's
# time (1.70 s vs 1.50 s for 3,000 files gathered for 50 ms: worker wake-ups and
# GIL hand-offs with the loop). A closed entry stays unevictable that long.
RELEASE_GATHER_S = 0.05
RELEASE_BATCH_MAX = 256

log = logging.getLogger(__name__)


class ReadPath:
    def __init__(
        self,
        reader: Reader,
        cache: Cache,
        workers: Workers,
        health: StoreHealth,
        prefetch: WholePrefetch,
        *,
        prefetch_globs: tuple[str, ...],
        prefetch_min_size: int,
        observe_latency: Callable[[float], None],
        queued: QueuedWrites,
        walk_ahead: WalkAhead,
        kernel_reads: Callable[[], bool],
        refresh: Callable[[str], Awaitable[ObjectInfo]],
    ) -> None:
        self.reader = reader
        self.whole_prefetch = prefetch
        self.walk_ahead = walk_ahead
        self.queued = queued  # writes acknowledged, not yet in tier 1
        self.refresh = refresh  # the store's current version of a key (Namespace.refresh)
        # Whether the kernel reads a verified object's tier-1 file itself (passthrough
        # on): the file's pages are then worth keeping and its bytes in memory not.
        self._kernel_reads = kernel_reads
        self.cache = cache
        self.workers = workers
        self.health = health
        self._prefetch = [glob_to_regex(g) for g in prefetch_globs]
        self._prefetch_min = prefetch_min_size
        self._observe_latency = observe_latency
        self._releasing: list[Entry] = []  # entries of read handles closed, to release
        self._release_due = trio.Event()
        self.prepared = PreparedOpens(cache, workers, read_soon=self.read_soon, load=self.load,
                                      offer=reader.bodies.offer, release=self._release_later,
                                      absent=walk_ahead.fetch)
        walk_ahead.on_fetched = self.prepared.want

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
                self.reader.bodies.offer(key, entry.etag, body)
        try:
            if self._wants_prefetch(key, size) and not self.whole_prefetch.running(entry):
                await self._prefetch_object(key, etag, size, mtime, entry)
        except BaseException:
            await self.workers.disk(self.cache.release, entry)
            raise
        warm = self.walk_ahead.opened(key, present=entry.state == "clean" and entry.serve.complete())
        if warm:
            self.prepared.want(warm)
        return ReadHandle(self, key, entry, settings)

    def _open(self, key: str, etag: str, size: int, mtime: float) -> tuple[Entry, bytes | None] | None:
        """(In a worker) the tier-1 entry of an object, loaded (`load`) in the same
        hop; None for a file this mount wrote (`etag` "") that tier 1 no longer
        holds (Cache.open_seen)."""
        entry = self.cache.open_seen(key, etag, size, mtime)
        return None if entry is None else self.load(entry)

    def _whole(self, entry: Entry) -> bool:
        """A whole small clean object in tier 1."""
        return (0 < entry.size <= self.reader.whole_max and entry.state == "clean"
                and entry.serve.complete())

    def loads(self, entry: Entry) -> bool:
        """Whether `load` reads `entry`: a whole small object tier 1 holds all of and
        none of which was served since the daemon started (a warm pass after a
        remount: its first read would verify it in a hop of its own, and
        passthrough takes verified files only). An object served before is not
        loaded: the kernel may well still hold its pages (keep_cache), and a load
        for nothing would cost a device read per open."""
        return (
            self._whole(entry)
            and entry.serve.unverified()
            and (self._kernel_reads() or (self.reader.bodies.cap >= entry.size
                                          and not self.reader.bodies.has(entry.key, entry.etag)))
        )

    def read_soon(self, entry: Entry) -> bool:
        """Whether the device is read for `entry` right after its open: it `loads`,
        or the kernel reads its file through passthrough (with no page cache of
        the mount's own in front: the next epoch reads tier 1 again)."""
        return self.loads(entry) or (self._kernel_reads() and self._whole(entry))

    def load(self, entry: Entry) -> tuple[Entry, bytes | None]:
        """(In a worker) an open entry, verified if it `loads`, and its bytes for the
        daemon's reads (bodies.py); with passthrough the kernel reads the file, so
        its pages are kept instead. Released if this fails other than by tier 1
        lacking or spoiling the bytes (the read path refetches those)."""
        if not self.loads(entry):
            return entry, None
        kernel = self._kernel_reads()
        try:
            body = entry.serve.read_whole(keep_pages=kernel)
        except (KeyError, ChunkCorrupt):
            return entry, None
        except BaseException:
            self.cache.release(entry)
            raise
        return entry, None if kernel else body

    async def read(
        self, entry: Entry, state: ReadState, off: int, size: int, settings: ClassSettings
    ) -> bytes | memoryview:
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
        self._release_later(entry)

    def _release_later(self, entry: Entry) -> None:
        self._releasing.append(entry)
        self._release_due.set()

    async def run(self) -> None:
        """For the mount's life (in its nursery): open ahead what warm walks want
        (prepared.py) and release the entries of closed read handles, all those
        closed since the last batch in one worker hop and one index transaction
        (Cache.release_many). A walk through 10,000 small files closes one a
        file: a hop and a commit each were a fifth of the daemon's CPU (issue
        21), so a batch waits RELEASE_GATHER_S for the closes that follow its
        first. An entry released up to 50 ms late only stays unevictable that long.
        A batch taken is released even if the mount stops meanwhile (cancelled
        before its hop started, its references were lost). What is left at
        shutdown (entries opened ahead included) is released then."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.prepared.run)
                while True:
                    await self._release_due.wait()
                    if len(self._releasing) < RELEASE_BATCH_MAX:
                        await trio.sleep(RELEASE_GATHER_S)
                    self._release_due = trio.Event()
                    with trio.CancelScope(shield=True):  # a batch taken is released whole
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
        if entry.state != "clean" or entry.serve.complete():
            return
        held = await self.workers.disk(self.cache.open, key, etag, size, mtime)
        if held is not entry:  # replaced meanwhile: leave it to the next open
            await self.workers.disk(self.cache.release, held)
            return

        async def done() -> None:
            await self.workers.disk(self.cache.release, held)

        self.whole_prefetch.start(held, done)


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
