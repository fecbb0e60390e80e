"""Parts of a write-back file sent while it is still being written (DESIGN §5).

A checkpoint written front to back leaves complete parts behind its writer.
Each goes up at once as a part of a multipart upload (with Content-MD5: the
store checks every part), so that the upload after the seal sends only what is
left, the tail and any part written again, before it completes: the time from
close to "in the bucket" shrinks to the tail's.

Rules:
- only write-back classes (a manifest's PUT is conditional; a temporary name
  is renamed, never uploaded under its name), files past two parts, and stores
  whose unfinished uploads a restart can abort (`Store.streams_parts`);
- a part goes up once the writer is a whole part past it. How far the writer
  got: the writes the daemon serves say it; a file the kernel writes itself
  (FUSE passthrough) tells the daemon nothing, so its backing file's length is
  read every FOLLOW_EVERY seconds while it is open;
- what a part was when it went up is kept as its chunks' checksums: at the
  seal, a part whose chunks' checksums differ (written again behind the
  writer, or while it was read) is sent again. The check is on the bytes, so it
  holds for writes the daemon never saw;
- S3 takes user metadata only when an upload is created: mode and owners known
  then go with it, the file's mtime is the store's Last-Modified (when the
  upload completed), and the whole-object digest goes as an object tag after
  Complete; an attribute change (chmod, chown, utimens) after the upload was
  created makes the seal start over;
- the upload id is journaled (`<cache>/streams/`) from its creation until it is
  completed or aborted; a restart aborts what it finds (the file itself is
  quarantined as any file never closed).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import trio
import xxhash

from tierfs.budget import BufferPool
from tierfs.cache import Cache, Entry
from tierfs.config import ClassSettings
from tierfs.posix import ATIME, CTIME, MTIME, Attrs, upload_metadata
from tierfs.queued_writes import QueuedWrites
from tierfs.store.base import Store, StoreError
from tierfs.workers import Workers
from tierfs.writeback.pending import PendingFile
from tierfs.writeback.records import StreamRecords

log = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit on the parts of one upload
# How often the length of a file the kernel writes (passthrough) is looked at: a
# part of 16 MiB takes a writer at 1 GB/s 16 ms, so parts go up in batches of a
# few, a fraction of a second behind the writer.
FOLLOW_EVERY = 0.1
TIMES = (ATIME, MTIME, CTIME)


def stream_metadata(attrs: Attrs | None, mtime_ns: int) -> dict[str, str]:
    """The user metadata an upload created before the seal carries: the file's
    attributes but its times (not known yet; the store's Last-Modified stands in)."""
    return {k: v for k, v in upload_metadata(attrs, mtime_ns).items() if k not in TIMES}


def content_md5(data: memoryview) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def chunk_digests(data: memoryview, chunk: int) -> bytes:
    """The cache's checksums (xxh3-64 per chunk, Entry's) of the bytes of a part."""
    return b"".join(xxhash.xxh3_64_digest(data[i:i + chunk]) for i in range(0, len(data), chunk))


def _sum_and_digests(data: memoryview, chunk: int) -> tuple[str, bytes]:
    return content_md5(data), chunk_digests(data, chunk)


class Followed(Protocol):
    """A write session whose writes the kernel applies (WriteSession)."""

    @property
    def backing_fd(self) -> int | None: ...

    @property
    def entry(self) -> Entry: ...

    @property
    def settings(self) -> ClassSettings: ...

    def observe(self) -> None: ...


@dataclass
class Stream:
    """One multipart upload of a file, opened while the file is written."""

    key: str
    part: int
    metadata: dict[str, str]
    upload_id: str | None = None
    sent: dict[int, tuple[bytes, str]] = field(default_factory=dict)  # part -> (chunk sums, ETag)
    sending: set[int] = field(default_factory=set)
    closing: bool = False
    failed: bool = False
    wake: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)


@dataclass
class Track:
    """What the write path knows of a file being written: how far its writers got,
    and its stream (if one was opened)."""

    high: int = 0
    attrs_set: int = 0  # PendingFile.attrs_set when the stream was opened
    stream: Stream | None = None
    followed: Followed | None = None  # the passthrough writer whose length is followed


def fresh(s: Stream, i: int, sums: bytes) -> str | None:
    """Part i's ETag if what went up is what the sealed file holds there (`sums`:
    the checksums of its chunks)."""
    got = s.sent.get(i)
    return got[1] if got is not None and got[0] == sums else None


class Streams:
    def __init__(
        self, store: Store, cache: Cache, workers: Workers,
        parts: BufferPool, queued: QueuedWrites, records: StreamRecords, nursery: trio.Nursery,
        *, part_size: int, parallel: int,
    ) -> None:
        self.store = store
        self.cache = cache
        self.workers = workers
        self.parts = parts
        self.queued = queued
        self.records = records
        self.nursery = nursery
        self.part = part_size
        self.parallel = max(1, parallel)
        # A part is checked at the seal by its chunks' checksums: it must hold whole chunks.
        self.enabled = store.streams_parts and part_size % cache.chunk_size == 0
        self._tracks: weakref.WeakKeyDictionary[PendingFile, Track] = weakref.WeakKeyDictionary()

    # -- the write path's side ----------------------------------------------------------

    def wrote(self, pf: PendingFile, off: int, n: int, settings: ClassSettings) -> None:
        """A write of [off, off+n) was applied or queued (loop): parts the writer
        left a whole part behind may go up now."""
        if not n:
            return
        t = self._tracks.get(pf)
        if t is None:
            t = self._tracks[pf] = Track()
        t.high = max(t.high, off + n)
        s = t.stream
        if s is not None and s.key != pf.key:  # renamed while written: start over
            self.abandon(pf)
            s = None
        if s is not None:
            s.wake.set()
            return
        if (self.enabled and settings.stream_parts and t.high >= 2 * self.part
                and settings.write_mode == "writeback"
                and settings.name != "staged" and not pf.key.endswith("/")):
            s = t.stream = Stream(pf.key, self.part, stream_metadata(pf.attrs, pf.mtime_ns))
            t.attrs_set = pf.attrs_set
            self.nursery.start_soon(self._pump, pf, t, s)

    def follow(self, pf: PendingFile, session: Followed) -> None:
        """The kernel writes `pf` through `session` from now on (passthrough, loop):
        where its class streams parts, its length is followed while it does."""
        if not (self.enabled and session.settings.stream_parts):
            return
        t = self._tracks.get(pf)
        if t is None:
            t = self._tracks[pf] = Track()
        following, t.followed = t.followed is not None, session
        if not following:
            self.nursery.start_soon(self._follow, pf, t)

    async def _follow(self, pf: PendingFile, t: Track) -> None:
        try:
            while (session := t.followed) is not None and session.backing_fd is not None:
                if pf.unlinked:
                    break
                # The entry takes the kernel's writes in (its length: parts are read
                # through it), and the session its size and mtime, as a stat would.
                st = await self.workers.disk(session.entry.local.adopt_external)
                if session.backing_fd is not None:
                    session.observe()
                    if st.st_size > t.high:
                        self.wrote(pf, t.high, st.st_size - t.high, session.settings)
                await trio.sleep(FOLLOW_EVERY)
        except (OSError, ValueError, KeyError) as exc:  # the entry went (unlinked, dropped)
            log.info("%r: stopped following its writer (%s)", pf.key, exc)
        finally:
            t.followed = None

    def truncated(self, pf: PendingFile) -> None:
        """Bytes went away or moved: what was sent no longer describes the file."""
        self.abandon(pf)
        self._tracks.pop(pf, None)

    def abandon(self, pf: PendingFile) -> None:
        """The file will not complete this stream (unlinked, renamed, dropped)."""
        t = self._tracks.get(pf)
        if t is None or t.stream is None:
            return
        s, t.stream = t.stream, None
        s.failed = s.closing = True
        s.wake.set()
        self.nursery.start_soon(self._abort, s)

    # -- the uploader's side ------------------------------------------------------------

    async def take(self, pf: PendingFile, key: str, size: int, attrs_meta: dict[str, str],
                   *, usable: bool) -> Stream | None:
        """At the upload of a sealed file: its stream, stopped and with every part in
        flight settled, if the upload can complete it (`usable`: unconditional,
        with a digest); else it is aborted and None."""
        t = self._tracks.get(pf)
        if t is None or t.stream is None:
            return None
        s, t.stream = t.stream, None
        s.closing = True
        s.wake.set()
        await s.ended.wait()
        count = -(-size // s.part)
        # An upload created before the seal stores no times: a file whose times were
        # set after its last write (cp -a, tar x) goes up the usual way.
        if (not usable or s.failed or s.upload_id is None or s.key != key or size <= s.part
                or count > MAX_PARTS or attrs_meta != s.metadata or pf.attrs_set != t.attrs_set):
            s.failed = True
            await self._abort(s)
            return None
        return s

    async def completed(self, s: Stream) -> None:
        if s.upload_id is not None:
            await self.workers.disk(self.records.drop, s.upload_id)

    async def aborted(self, s: Stream) -> None:
        await self._abort(s)

    # -- internals ------------------------------------------------------------------------

    async def _pump(self, pf: PendingFile, t: Track, s: Stream) -> None:
        """Send each part the writer left behind, a few at once, until the seal takes
        the stream over (or it is abandoned)."""
        entry = await self.workers.disk(self.cache.open_existing, s.key)
        try:
            if entry is None:
                s.failed = True
                return
            try:
                s.upload_id = await self.workers.upload(
                    partial(self.store.create_upload, s.key, metadata=s.metadata))
                await self.workers.disk(self.records.save, s.key, s.upload_id)
            except (StoreError, OSError) as exc:
                log.info("%r: parts wait for the seal (%s)", s.key, exc)
                s.failed = True
                return
            slots = trio.Semaphore(self.parallel)
            async with trio.open_nursery() as nursery:
                while not s.closing:
                    i = self._next(t, s)
                    if i is None:
                        s.wake = trio.Event()
                        await s.wake.wait()
                        continue
                    await slots.acquire()
                    if s.closing:
                        slots.release()
                        break
                    s.sending.add(i)
                    nursery.start_soon(self._send, s, entry, i, slots)
        finally:
            if entry is not None:
                with trio.CancelScope(shield=True):
                    await self.workers.disk(self.cache.release, entry)
            s.ended.set()

    def _next(self, t: Track, s: Stream) -> int | None:
        for i in range(t.high // s.part - 1):  # the writer is a whole part past these
            if i not in s.sent and i not in s.sending:
                return i
        return None

    async def _send(self, s: Stream, entry: Entry, i: int, slots: trio.Semaphore) -> None:
        try:
            etag, sums = await self.send_part(s, entry, i, s.part)
            s.sent[i] = (sums, etag)
        except (StoreError, OSError) as exc:
            log.info("%r: part %d waits for the seal (%s)", s.key, i + 1, exc)
        finally:
            s.sending.discard(i)
            slots.release()
            s.wake.set()

    async def send_part(self, s: Stream, entry: Entry, i: int, n: int) -> tuple[str, bytes]:
        """Part i (n bytes) as the file holds it now (writes queued before the call
        applied first); its ETag and the checksums of its chunks as sent. Raises
        StoreError, or OSError (reading tier 1)."""
        assert s.upload_id is not None
        await self.queued.drain_entry(entry)
        buf = await self.parts.take(n)
        try:
            view = buf[:n]
            got = await self.workers.disk(entry.local.read_into, i * s.part, view)
            if got != n:
                raise OSError(errno.EIO, f"{s.key}: tier-1 copy ended at {i * s.part + got}")
            md5, sums = await self.workers.disk(_sum_and_digests, view, entry.chunk_size)
            return await self.workers.upload(partial(
                self.store.upload_part, s.key, s.upload_id, i + 1, i * s.part, view,
                content_md5=md5)), sums
        finally:
            self.parts.give(buf)

    async def _abort(self, s: Stream) -> None:
        await s.ended.wait()
        if s.upload_id is None:
            return
        with trio.CancelScope(shield=True):
            await self.workers.upload(self.store.abort_upload, s.key, s.upload_id)
            await self.workers.disk(self.records.drop, s.upload_id)

    async def recover(self) -> None:
        """After a restart: abort every upload a stream left open (their files were
        never sealed, or are sealed and upload again from the start)."""
        for key, upload_id in await self.workers.disk(self.records.load):
            log.info("aborting the upload of %r left open before the restart", key)
            await self.workers.upload(self.store.abort_upload, key, upload_id)  # best effort
            await self.workers.disk(self.records.drop, upload_id)
