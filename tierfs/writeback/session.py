"""A write session: what `open`/`create` return for a writable open (DESIGN §5).

Writes go to the file's tier-1 copy (a direct-write handle's are acknowledged
at once and applied in order behind it: queue.py). close(2) reaches the
daemon as FLUSH, synchronously, and seals the file as its class says:
write-back: fsynced and journaled, the upload follows; write-through: also
uploaded, close returns once the store has it or fails (and then nothing of
it is uploaded later); publish (manifests): its barrier journaled too, the
conditional PUT follows (or, with publish = "wait", close waits for the
barrier and the PUT). fsync does the same. RELEASE arrives after close(2) returned; once the
last writer is gone, the file is the uploader's (or dropped, if no close of
it succeeded).

Every change of a file's bytes or state holds the file's lock (PendingFile.
lock); reads do not take it, so a seal never holds up a reader.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tierfs.cache import Cache, Entry
from tierfs.config import ClassSettings
from tierfs.health import StoreHealth
from tierfs.policy import Policy
from tierfs.posix import Attrs
from tierfs.read.streams import ReadState
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal, PendingFile
from tierfs.writeback.publish import Publisher
from tierfs.writeback.queue import QueuedWrites, WriteQueue
from tierfs.writeback.streaming import Streams
from tierfs.writeback.uploader import NotVerified, Uploader

log = logging.getLogger(__name__)

Read = Callable[[Entry, ReadState, int, int, ClassSettings], Awaitable[bytes | memoryview]]


@dataclass
class WriteContext:
    """What every write session shares: the parts of the write path, the read and
    fetch of the read path, and the namespace's and kernel's hooks."""

    cache: Cache
    policy: Policy
    workers: Workers
    health: StoreHealth
    journal: Journal
    queued: QueuedWrites
    uploader: Uploader
    streams: Streams  # parts sent while a file is written
    publisher: Publisher
    read: Read  # ReadPath.read
    fetch: Callable[[Entry, int, int], Awaitable[object]]  # make bytes present in tier 1
    refresh: Callable[[str], Awaitable[ObjectInfo]]  # the store's current version of a key
    on_dropped: Callable[[str], None]  # the namespace forgets a local file
    invalidate: Callable[[int], None]  # drop the kernel's cached pages of an inode

    async def open_entry(self, key: str, etag: str, size: int, mtime: float) -> Entry:
        return await self.workers.disk(self.cache.open, key, etag, size, mtime)

    async def open_seen(self, key: str, etag: str, size: int, mtime: float) -> tuple[Entry, str]:
        """The entry of the version the namespace showed (Cache.open_seen: ETag "" is
        this mount's file, whatever became of it), and that version's store ETag
        ("" while only local). The store's current version if tier 1 no longer
        holds this mount's file (landed and evicted since the look)."""
        entry = await self.workers.disk(self.cache.open_seen, key, etag, size, mtime)
        if entry is None:
            info = await self.refresh(key)
            return await self.open_entry(key, info.etag, info.size, info.mtime), info.etag
        return entry, etag or (entry.etag if entry.state == "clean" else "")

    async def release_entry(self, entry: Entry) -> None:
        await self.workers.disk(self.cache.release, entry)

    async def local_write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A tier-1 write; on a full disk, evict clean data once and retry, else ENOSPC."""
        try:
            return await self.workers.disk(fn, *args)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await self.workers.disk(self.cache.reclaim)
            return await self.workers.disk(fn, *args)

    def mark_written(self, pf: PendingFile) -> None:
        """The file's bytes change: a sealed version is superseded."""
        if pf.sealed:
            pf.sealed_at = None
            pf.version += 1
        pf.local = True
        pf.through_failed = False
        self.journal.notify()

    async def seal_local(self, pf: PendingFile, entry: Entry, *, durable: bool = True) -> None:
        """Kept here: its sealed record in the index, with its checksums or, for bytes
        the kernel wrote itself, a mark that they follow (a daemon crash loses
        nothing); `durable`: the file fsynced too (a machine crash neither)."""
        await self.workers.disk(partial(entry.set_state, "sealed", durable=durable))
        if entry.unhashed:
            self.uploader.digest_soon(entry)
        pf.sealed_at = time.monotonic()
        pf.local = True
        pf.size = entry.size
        self.journal.notify()

    async def sync_sealed(self, entry: Entry) -> None:
        """An fsync(2) of a file a close sealed without fsyncing its bytes."""
        if entry.state != "dirty":
            await self.workers.disk(entry.sync)

    async def land_now(self, pf: PendingFile, entry: Entry) -> None:
        """A write-through close: upload now; the close fails if the store does not
        take it, and then nothing of it is uploaded later (`last_closed`)."""
        if self.health.degraded:
            pf.through_failed = True
            raise OSError(errno.EIO, f"{pf.key}: store unreachable; not saved")
        try:
            await self.uploader.land(pf, entry)
        except StoreError as exc:
            pf.through_failed = True
            raise OSError(exc.errno or errno.EIO, str(exc)) from None
        except (NotVerified, OSError) as exc:
            pf.through_failed = True
            raise OSError(errno.EIO, str(exc)) from None
        self.journal.landed(pf)

    async def last_closed(self, pf: PendingFile, failed: bool) -> None:
        """No writer left: the uploader takes a sealed write-back file; a file no
        close of which succeeded is dropped (never acknowledged)."""
        if pf.unlinked or pf.gone.is_set():
            return
        if not pf.local:  # never written here, or in the store already
            self.journal.leave(pf, "landed")
        elif failed or pf.through_failed or not pf.sealed or not self.hand_over(pf):
            # never acknowledged, or sealed by a close whose upload or publish failed
            await self.drop(pf, "dropped")

    def hand_over(self, pf: PendingFile) -> bool:
        """A sealed file with no writer left goes up as the class of its name says:
        write-back after the class's quiet delay, a journaled manifest once its
        barrier landed. False if its class uploads only in close (its close did)."""
        if pf.renaming:
            return True  # core.publish_rename hands it over (its barrier journaled)
        settings = self.policy.settings(pf.key)
        if settings.write_mode == "writeback" or pf.key.endswith("/"):
            pf.barrier = pf.condition = None  # (renamed away from a manifest name)
            self.uploader.kick(pf, settings.upload_delay)
            return True
        if settings.write_mode == "publish" and pf.barrier is not None:
            self.publisher.submit(pf)
            return True
        return False

    async def drop(self, pf: PendingFile, outcome: str) -> None:
        """Forget a local file's bytes (the store's version, if any, shows again)."""
        await self.uploader.stop(pf)
        self.streams.abandon(pf)
        await self.workers.disk(self.cache.remove, pf.key)
        self.on_dropped(pf.key)
        self.journal.leave(pf, outcome)


class WriteSession:
    flushes = True  # close(2) seals what it wrote (flush): the kernel must send it

    def __init__(
        self,
        wb: WriteContext,
        pf: PendingFile,
        entry: Entry,
        *,
        inode: int,
        direct: bool,
        keep_cache: bool,
        base_etag: str | None,
        dirty: bool,
    ) -> None:
        self._wb = wb
        self.pf = pf
        self.entry = entry
        self.inode = inode
        self.direct = direct  # writes skip the kernel page cache (ClassSettings.direct_writes)
        self.keep_cache = keep_cache
        self.base_etag = base_etag  # the store version this handle read (manifest If-Match)
        self.dirty = dirty  # written through this handle since its last seal
        self.closed = False  # close(2) reached us (FLUSH); RELEASE follows
        self.failed = False  # a close or fsync of it failed: nothing of it may land later
        self.state = ReadState()
        self._queue: WriteQueue | None = None  # a direct handle's acknowledged, unapplied writes
        # FUSE passthrough (fuse/modes.py): the kernel writes the cache file itself and
        # no WRITE reaches this session. The fd it writes; the file's (size, mtime,
        # ctime) when this handle's bytes were last sealed (a change since means
        # written); the (size, mtime) last shown by stat.
        self.backing_fd: int | None = None
        self._sealed_stat: tuple[int, int, int] | None = None
        self._observed: tuple[int, int] | None = None
        # A clean object made a local write at open (for the kernel to write it):
        # the ETag and attributes it had. While nothing changes, nothing is sealed;
        # at release it goes back to clean if its bytes still match their checksums.
        self._pristine: tuple[str, Attrs | None] | None = None

    @property
    def settings(self) -> ClassSettings:
        return self._wb.policy.settings(self.pf.key)  # the class of its current name

    # -- writes the kernel serves (FUSE passthrough) ---------------------------------------

    @property
    def passthrough(self) -> bool:
        return self.backing_fd is not None

    def may_pass_through(self) -> bool:
        """Whether the kernel may write this file itself: its whole content is local
        (created, truncated by O_TRUNC, a write-back file not uploaded yet, or a
        clean object complete and verified in tier 1) and its class is write-back
        (write-through and published classes act at close on what they saw
        written)."""
        entry = self.entry
        local = entry.state != "clean" or entry.completeness() == "verified"
        return (local and self.settings.write_mode == "writeback" and not self.pf.key.endswith("/")
                and not entry.detached and not self.pf.unlinked and self._queue is None)

    async def prepare_pass_through(self) -> None:
        """Before the kernel may write the file: no upload may read it meanwhile, and
        a clean object becomes a local write now (the daemon path does that at the
        first write(2); the kernel's never reach the daemon)."""
        pf = self.pf
        await self._wb.uploader.stop(pf)
        if self.entry.state != "clean":
            return
        async with pf.lock:
            if self.entry.state != "clean" or self.dirty:
                return
            etag = self.entry.etag
            await self._wb.workers.disk(self.entry.set_state, "dirty")
            self._wb.mark_written(pf)
            self.dirty = True
            self._pristine = (etag, pf.attrs)

    def begin_pass_through(self) -> int:
        """The kernel writes this file from now on: the fd to register as backing file
        (no I/O: callable on the trio loop between deciding and registering)."""
        fd = self.entry.begin_external()
        st = os.fstat(fd)
        self.backing_fd = fd
        self._sealed_stat = (None if self.dirty and self._pristine is None
                             else (st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        self._observed = (st.st_size, st.st_mtime_ns)
        self._wb.streams.follow(self.pf, self)
        return fd

    async def end_pass_through(self) -> None:
        """Registration failed, or the handle is released: the daemon's again."""
        if self.backing_fd is not None:
            self.backing_fd = None
            await self._wb.workers.disk(self.entry.end_external)

    def observe(self) -> None:
        """stat of a file the kernel writes: its size and mtime from the file (an
        fstat of an open fd: no disk I/O)."""
        if self.backing_fd is None:
            return
        try:
            st = os.fstat(self.backing_fd)
        except OSError:
            return
        seen = (st.st_size, st.st_mtime_ns)
        if seen != self._observed:
            self._observed = seen
            self.pf.size = st.st_size
            self.pf.written(st.st_mtime_ns)

    async def _take_external(self) -> None:
        """(holding pf.lock) Whether the kernel wrote the file since this handle last
        sealed it: then it is dirty, as if every byte had come by write()."""
        if self.backing_fd is None:
            return
        self.observe()
        st = os.fstat(self.backing_fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) == self._sealed_stat:
            return
        self._pristine = None  # written: sealed and uploaded whole
        if self.dirty:
            return
        if self.entry.state == "sealed":
            await self._wb.workers.disk(self.entry.set_state, "dirty")
        self._wb.mark_written(self.pf)
        self.dirty = True

    async def _restore(self, final: bool) -> bool:
        """(holding pf.lock) A clean object made a local write at open, unwritten so
        far: nothing to seal. At release (`final`) it goes back to the clean object
        it was, with no upload, if it is the only writer, its attributes are as
        they were and every byte still matches its recorded checksum (True)."""
        if self._pristine is None:
            return False
        pf = self.pf
        etag, attrs = self._pristine
        if pf.attrs is not attrs or pf.unlinked:  # chmod, utimens...: they go up with it
            self._pristine = None
            return False
        if not final:
            return True
        self._pristine = None
        if len(pf.sessions) > 1 or not await self._wb.workers.disk(self.entry.undirty, etag):
            return False
        self.dirty = False
        self._wb.journal.landed(pf)
        return True

    async def read(self, off: int, size: int) -> bytes | memoryview:
        return await self._wb.read(self.entry, self.state, off, size, self.settings)

    async def write(self, off: int, buf: bytes) -> int:
        pf = self.pf
        async with pf.lock:
            if not self.dirty:
                await self._begin_write()
            self._pristine = None
            await self._wb.queued.drain_entry(self.entry, but=self._queue)  # others' first
            if self.direct:  # acknowledged now, applied in order in the background
                if self._queue is None:
                    self._queue = WriteQueue(self.entry)
                await self._wb.queued.submit(self._queue, self.entry, off, buf)
                pf.size = max(pf.size, off + len(buf))
            else:
                await self._wb.local_write(self.entry.write, off, buf)
                pf.size = self.entry.size
            pf.written()
            self._wb.streams.wrote(pf, off, len(buf), self.settings)
        return len(buf)

    async def truncate(self, size: int, *, always: bool = True) -> None:
        """ftruncate, O_TRUNC (`always`: mtime and ctime move even when the size
        stays); truncate(2) by path moves them only when the size changes (as
        local filesystems do)."""
        pf = self.pf
        async with pf.lock:
            await self._settle()
            if self.entry.state != "clean":  # what the kernel wrote (passthrough), if it did
                await self._wb.workers.disk(self.entry.adopt_external)
            if size == self.entry.size and not always:
                return
            if not self.dirty:
                await self._wb.uploader.stop(pf)
            self._pristine = None
            await self._make_local(min(size, self.entry.size))
            await self._wb.local_write(self.entry.truncate, size)
            self._wb.streams.truncated(pf)
            self._wb.mark_written(pf)
            self.dirty = True
            pf.size = size
            pf.written()
            if self.backing_fd is not None:  # stat shows this truncate's time, not the file's
                st = os.fstat(self.backing_fd)
                self._observed = (st.st_size, st.st_mtime_ns)

    async def flush(self) -> None:
        """close(2): seal (and upload or publish) what this handle wrote. A write-back
        file's bytes are not fsynced by it, as close(2) on a local disk does not:
        safetensors and webdataset close without fsync and must not pay one (an
        fsync of 1 GiB costs more than writing it to the page cache)."""
        self.closed = True
        self._wb.journal.notify()
        await self._seal_reporting(durable=self.settings.write_mode != "writeback")

    async def fsync(self) -> None:
        """fsync(2): seal with the bytes fsynced, also those an earlier close sealed."""
        await self._seal_reporting(durable=True)
        await self._wb.sync_sealed(self.entry)

    async def release(self) -> None:
        """The last reference to the open file is gone (after close(2) returned)."""
        pf = self.pf
        try:
            if (self.dirty or self.backing_fd is not None) and not self.failed:
                # Written after its last close (a mapping kept past close), or a
                # close that never came: seal it now, as its class says.
                try:
                    await self._seal(final=True)
                except (OSError, StoreError, NotVerified) as exc:
                    self.failed = True
                    log.warning("%r: written after its last close and not saved: %s", pf.key, exc)
        finally:
            await self.end_pass_through()
            # Under the file's lock: a rename re-keying it (core._move_local) stops its
            # upload, then moves it; the hand-over of the last writer must not slip in
            # between (an upload under the old name, landed as the new one's).
            async with pf.lock:
                pf.sessions.discard(self)
                self._wb.journal.notify()
                if self._queue is not None:
                    # Pages other opens cached may predate these writes. Newer kernels
                    # drop them in the direct write itself (6.18 does); older ones don't.
                    self._wb.invalidate(self.inode)
                if not pf.sessions:
                    await self._wb.last_closed(pf, self.failed)
            await self._wb.release_entry(self.entry)

    # -- internals ------------------------------------------------------------------------

    async def _seal_reporting(self, *, durable: bool) -> None:
        if not self.dirty and self.backing_fd is None:
            return
        try:
            await self._seal(durable=durable)
        except BaseException:
            self.failed = True
            raise

    async def _seal(self, final: bool = False, *, durable: bool = False) -> None:
        pf = self.pf
        async with pf.lock:
            await self._settle()  # a file with a failed write is never sealed
            await self._take_external()
            if not self.dirty or await self._restore(final):
                return
            if pf.unlinked:  # lives on in its descriptors only: nothing to keep
                self.dirty = False
                return
            settings = self.settings
            mode = settings.write_mode
            if self.backing_fd is not None:
                # Taken before the seal reads the file: a write(2) after it moves the
                # mtime or ctime (the stat marks the inode for fine-grained times) and
                # the next flush seals again.
                st = os.fstat(self.backing_fd)
                before = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            await self._wb.seal_local(pf, self.entry, durable=durable)
            if self.backing_fd is not None:
                self._sealed_stat = before
            self.dirty = False
            if mode == "writeback":
                return  # durable here; the upload follows the last release
            try:
                if mode == "publish" and settings.publish == "background":
                    # durable here with its barrier; the publish follows the last release
                    await self._wb.publisher.journal_barrier(pf, if_match=self.base_etag)
                elif mode == "publish":
                    info = await self._wb.publisher.publish(pf, self.entry, if_match=self.base_etag)
                    self.base_etag = info.etag
                else:
                    await self._wb.land_now(pf, self.entry)
            except BaseException:
                self.dirty = True  # not saved: a later fsync or close tries again
                raise

    async def _settle(self) -> None:
        """Wait for the file's queued writes; raise this handle's failed one."""
        if self._queue is not None:
            await self._wb.queued.drain(self._queue)
        await self._wb.queued.drain_entry(self.entry)

    async def _begin_write(self) -> None:
        """First write through this handle since its last seal: the whole object
        must be local, and no upload may be reading the file while it changes."""
        await self._wb.uploader.stop(self.pf)
        await self._make_local(self.entry.size)
        self._wb.mark_written(self.pf)
        self.dirty = True

    async def _make_local(self, size: int) -> None:
        """Fetch the first `size` bytes of a clean entry into tier 1. If the object
        changed in the store since this handle opened it (ESTALE), write onto the
        store's current version instead."""
        if self.entry.state != "clean" or not size:
            return
        try:
            await self._wb.fetch(self.entry, 0, size)
            return
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
        info = await self._wb.refresh(self.pf.key)
        old = self.entry
        self.entry = await self._wb.open_entry(self.pf.key, info.etag, info.size, info.mtime)
        await self._wb.release_entry(old)
        await self._wb.fetch(self.entry, 0, min(size, self.entry.size))
