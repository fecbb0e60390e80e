"""A write session: what `open`/`create` return for a writable open (DESIGN §5).

Writes go to the file's tier-1 copy (a direct-write handle's are acknowledged
at once and applied in order behind it: queued_writes.py). close(2) reaches the
daemon as FLUSH, synchronously, and seals the file as its class says:
write-back: fsynced and journaled, the upload follows; write-through: also
uploaded, close returns once the store has it or fails (and then nothing of
it is uploaded later); publish (manifests): its barrier journaled too, the
conditional PUT follows (or, with publish = "wait", close waits for the
barrier and the PUT). fsync does the same. RELEASE arrives after close(2)
returned; once the last writer is gone, the file is the uploader's (or
dropped, if no close of it succeeded).

Every change of a file's state holds the file's lock (PendingFile.lock) for
that change only (lifecycle.py): a write applies its bytes, a fetch runs, a
close uploads or publishes with the lock let go. Reads never take it.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable

from tierfs.cache import Entry
from tierfs.config import ClassSettings
from tierfs.posix import Attrs
from tierfs.queued_writes import QueuedWrites, WriteQueue
from tierfs.read.sequential import ReadState
from tierfs.read.served import Served
from tierfs.store.base import StoreError
from tierfs.writeback.lifecycle import Lifecycle
from tierfs.writeback.pending import FileState, PendingFile
from tierfs.writeback.tier1 import Tier1
from tierfs.writeback.transfer import NotVerified

log = logging.getLogger(__name__)

Read = Callable[[Entry, ReadState, int, int, ClassSettings], Awaitable[Served]]


class WriteSession:
    flushes = True  # close(2) seals what it wrote (flush): the kernel must send it

    def __init__(
        self,
        life: Lifecycle,
        tier1: Tier1,
        queued: QueuedWrites,
        read: Read,
        invalidate: Callable[[int], None],
        pf: PendingFile,
        entry: Entry,
        *,
        inode: int,
        direct: bool,
        keep_cache: bool,
        base_etag: str | None,
        dirty: bool,
    ) -> None:
        self._life = life  # the file's state changes
        self._tier1 = tier1  # its bytes
        self._queued = queued
        self._read = read  # ReadPath.read
        self._invalidate = invalidate  # drop the kernel's cached pages of an inode
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
        return self._life.settings(self.pf.key)  # the class of its current name

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
        local = entry.state != "clean" or entry.serve.completeness() == "verified"
        return (local and self.settings.write_mode == "writeback" and not self.pf.key.endswith("/")
                and not entry.detached and not self.pf.unlinked and self._queue is None)

    async def prepare_pass_through(self) -> None:
        """Before the kernel may write the file: no upload may read it meanwhile, and
        a clean object becomes a local write now (the daemon path does that at the
        first write(2); the kernel's never reach the daemon)."""
        pf = self.pf
        await self._life.let_go(pf)
        if self.entry.state != "clean":
            return
        async with self._life.changing(pf):
            if self.entry.state != "clean" or self.dirty:
                return
            etag = self.entry.etag
            await self._tier1.disk(self.entry.local.make_dirty)
            pf.mark_written()
            self.dirty = True
            self._pristine = (etag, pf.attrs)

    def begin_pass_through(self) -> int:
        """The kernel writes this file from now on: the fd to register as backing file
        (no I/O: callable on the trio loop between deciding and registering)."""
        fd = self.entry.local.begin_external()
        st = os.fstat(fd)
        self.backing_fd = fd
        self._sealed_stat = (None if self.dirty and self._pristine is None
                             else (st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        self._observed = (st.st_size, st.st_mtime_ns)
        self._life.follow(self.pf, self)
        return fd

    async def end_pass_through(self) -> None:
        """Registration failed, or the handle is released: the daemon's again."""
        if self.backing_fd is not None:
            self.backing_fd = None
            await self._tier1.disk(self.entry.local.end_external)

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
            self.pf.touched(st.st_size, st.st_mtime_ns)

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
            await self._tier1.disk(self.entry.local.make_dirty)
        self.pf.mark_written()
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
        if len(pf.sessions) > 1 or not await self._tier1.disk(self.entry.local.undirty, etag):
            return False
        self.dirty = False
        pf.mark_restored()
        return True

    # -- the daemon path --------------------------------------------------------------------

    async def read(self, off: int, size: int) -> Served:
        return await self._read(self.entry, self.state, off, size, self.settings)

    async def write(self, off: int, buf: bytes) -> int:
        pf = self.pf
        await self._make_local(self.entry.size)  # (a clean object: fetched, no lock held)
        async with self._life.changing(pf):
            await self._make_local(self.entry.size)  # (written back and evicted meanwhile)
            if not self.dirty or pf.state is not FileState.WRITTEN:
                pf.mark_written()  # (another handle sealed it since this one's last write)
                self.dirty = True
            self._pristine = None
            pf.write_began()
        try:
            await self._queued.drain_entry(self.entry, but=self._queue)  # others' first
            if self.direct:  # acknowledged now, applied in order in the background
                if self._queue is None:
                    self._queue = WriteQueue(self.entry)
                await self._queued.submit(self._queue, self.entry, off, buf)
                pf.touched(max(pf.size, off + len(buf)))
            else:
                await self._tier1.write(self.entry.local.write, off, buf)
                pf.touched(self.entry.size)
            self._life.wrote(pf, off, len(buf), self.settings)
        finally:
            pf.write_ended()
        return len(buf)

    async def truncate(self, size: int, *, always: bool = True) -> None:
        """ftruncate, O_TRUNC (`always`: mtime and ctime move even when the size
        stays); truncate(2) by path moves them only when the size changes (as
        local filesystems do)."""
        pf = self.pf
        await self._make_local(min(size, self.entry.size))
        async with self._life.changing(pf):
            await self._settle()
            await pf.writes_done()
            if self.entry.state != "clean":  # what the kernel wrote (passthrough), if it did
                await self._tier1.disk(self.entry.local.adopt_external)
            if size == self.entry.size and not always:
                return
            self._pristine = None
            await self._make_local(min(size, self.entry.size))
            pf.mark_written()  # before the bytes change: an upload reading them commits nothing
            self.dirty = True
            await self._tier1.write(self.entry.local.truncate, size)
            self._life.truncated(pf)
            pf.touched(size)
            if self.backing_fd is not None:  # stat shows this truncate's time, not the file's
                st = os.fstat(self.backing_fd)
                self._observed = (st.st_size, st.st_mtime_ns)

    async def flush(self) -> None:
        """close(2): seal (and upload or publish) what this handle wrote. A write-back
        file's bytes are not fsynced by it, as close(2) on a local disk does not:
        safetensors and webdataset close without fsync and must not pay one (an
        fsync of 1 GiB costs more than writing it to the page cache)."""
        self.closed = True
        self._life.notify()
        await self._seal_reporting(durable=self.settings.write_mode != "writeback")

    async def fsync(self) -> None:
        """fsync(2): seal with the bytes fsynced, also those an earlier close sealed."""
        await self._seal_reporting(durable=True)
        await self._life.sync_sealed(self.entry)

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
            # Under the file's lock: a rename re-keying it (rename.py) waits for its
            # upload, then moves it; the hand-over of the last writer must not slip
            # in between (an upload under the old name, landed as the new one's).
            async with pf.lock:
                pf.released(self)
                if self._queue is not None:
                    # Pages other opens cached may predate these writes. Newer kernels
                    # drop them in the direct write itself (6.18 does); older ones don't.
                    self._invalidate(self.inode)
                if not pf.sessions:
                    await self._life.last_closed(pf, self.failed)
            await self._tier1.release(self.entry)

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
        if durable and self.dirty:
            await self._tier1.flush_bytes(self.entry)  # the bulk of the fsync, no lock held
        async with pf.lock:
            sealed = await self._seal_locked(final, durable)
            if sealed is None:
                return
            mode, version = sealed
            self._life.close_upload_began(pf)  # writers of the file wait for it from here
        ok = False
        try:  # with the lock let go: a release, a stat, a read of it do not wait
            if mode == "publish":
                self.base_etag = await self._life.publish(pf, self.entry, version,
                                                          if_match=self.base_etag)
            else:
                await self._life.land_now(pf, self.entry, version)
            ok = True
        except BaseException:
            self.dirty = True  # not saved: a later fsync or close tries again
            raise
        finally:
            await self._life.close_upload_ended(pf, version, ok)

    async def _seal_locked(self, final: bool, durable: bool) -> tuple[str, int] | None:
        """(holding pf.lock) Seal what this handle wrote; what its close must still
        send (write-through, a publish waited for), and the version sealed."""
        pf = self.pf
        await self._settle()  # a file with a failed write is never sealed
        await pf.writes_done()
        await self._take_external()
        if not self.dirty or await self._restore(final):
            return None
        if pf.state is FileState.STORED and self.entry.state == "clean":
            self.dirty = False  # another handle's close sealed and landed these writes
            return None
        if pf.state is FileState.GONE:
            self.dirty = False
            if pf.unlinked:  # lives on in its descriptors only: nothing to keep
                return None
            raise OSError(errno.ESTALE, f"{pf.key}: no longer pending here ({pf.outcome})")
        settings = self.settings
        mode = settings.write_mode
        if self.backing_fd is not None:
            # Taken before the seal reads the file: a write(2) after it moves the
            # mtime or ctime (the stat marks the inode for fine-grained times) and
            # the next flush seals again.
            st = os.fstat(self.backing_fd)
            before = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        version = await self._life.seal(pf, self.entry, durable=durable)
        if self.backing_fd is not None:
            self._sealed_stat = before
        self.dirty = False
        if mode == "writeback":
            return None  # durable here; the upload follows the last release
        if mode == "publish" and settings.publish == "background":
            # durable here with its barrier; the publish follows the last release
            try:
                await self._life.journal_barrier(pf, if_match=self.base_etag)
            except BaseException:
                self.dirty = True  # not saved: a later fsync or close tries again
                raise
            return None
        return mode, version

    async def _settle(self) -> None:
        """Wait for the file's queued writes; raise this handle's failed one."""
        if self._queue is not None:
            await self._queued.drain(self._queue)
        await self._queued.drain_entry(self.entry)

    async def _make_local(self, size: int) -> None:
        """Fetch the first `size` bytes of a clean entry into tier 1. If the object
        changed in the store since this handle opened it (ESTALE), write onto the
        store's current version instead."""
        if self.entry.state != "clean" or not size:
            return
        try:
            await self._tier1.fetch(self.entry, 0, size)
            return
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
        info = await self._tier1.refresh(self.pf.key)
        old = self.entry
        self.entry = await self._tier1.open(self.pf.key, info.etag, info.size, info.mtime)
        await self._tier1.release(old)
        await self._tier1.fetch(self.entry, 0, min(size, self.entry.size))
