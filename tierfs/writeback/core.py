"""The write path's front (DESIGN §5): writable opens (write sessions), and the
namespace changes that reach the store: truncate by path, chmod/chown/utimens,
special files, unlink, mkdir, rmdir. Renames are rename.py's; recovery after
a restart recovery.py's; `tierfs pending|flush` pendingops.py's."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial

from tierfs.cache import Entry
from tierfs.policy import Policy
from tierfs.posix import Attrs, listing_misleads, to_metadata
from tierfs.queued_writes import QueuedWrites
from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal
from tierfs.writeback.lifecycle import Lifecycle
from tierfs.writeback.pending import DROPPED, UNLINKED, PendingFile
from tierfs.writeback.session import Read, WriteSession
from tierfs.writeback.tier1 import Tier1


class WriteBack:
    def __init__(
        self, journal: Journal, life: Lifecycle, tier1: Tier1, store: Store, workers: Workers,
        policy: Policy, queued: QueuedWrites, *, read: Read,
        invalidate: Callable[[int], None],
    ) -> None:
        self.journal = journal
        self.life = life
        self.tier1 = tier1
        self.store = store
        self.workers = workers
        self.policy = policy
        self.queued = queued
        self.read = read  # ReadPath.read: a writable handle's reads
        self.invalidate = invalidate  # drop the kernel's cached pages of an inode

    def _session(self, pf: PendingFile, entry: Entry, *, inode: int, flags: int,
                 keep_cache: bool, base_etag: str | None, dirty: bool) -> WriteSession:
        settings = self.policy.settings(pf.key)
        session = WriteSession(
            self.life, self.tier1, self.queued, self.read, self.invalidate, pf, entry,
            inode=inode, keep_cache=keep_cache,
            direct=settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY,
            base_etag=base_etag, dirty=dirty)
        pf.opened(session)
        return session

    # -- sessions -----------------------------------------------------------------------

    async def open(
        self, key: str, etag: str, size: int, mtime: float, *, flags: int, inode: int,
        attrs: Attrs | None = None,
    ) -> WriteSession:
        """A writable open of an existing file (O_TRUNC truncates it); `attrs`, its
        POSIX attributes if known, go with its next upload."""
        settings = self.policy.settings(key)
        entry, etag = await self.tier1.open_seen(key, etag, size, mtime)
        pf = self.journal.track(key, entry.size, entry.mtime)
        pf.take_attrs(attrs, unless_known=True)
        session = self._session(pf, entry, inode=inode, flags=flags,
                                keep_cache=settings.keep_cache, base_etag=etag or None,
                                dirty=False)
        if flags & os.O_TRUNC:
            try:
                await session.truncate(0)
            except BaseException:
                await session.release()
                raise
        return session

    async def create(self, key: str, *, flags: int, inode: int, attrs: Attrs,
                     fresh: bool = False) -> WriteSession:
        """A new, empty file (or one truncated to nothing by O_CREAT on a stale name).
        `fresh`: the namespace knows the store has no object under `key`."""
        now = attrs.mtime_ns / 1e9
        new = self.journal.get(key) is None
        pf = self.journal.track(key, 0, now)
        pf.set_fresh(fresh and (new or pf.fresh))
        pf.take_attrs(attrs)
        async with self.life.changing(pf):
            entry = await self.tier1.open(key, "", 0, now)
            had_bytes = pf.local
            pf.mark_written()  # before the bytes change: an upload reading them commits nothing
            try:
                await self.tier1.write(entry.local.truncate, 0)
            except BaseException:
                await self.tier1.release(entry)
                if not pf.sessions and not had_bytes:
                    self.journal.leave(pf, DROPPED)
                raise
            pf.touched(0, attrs.mtime_ns)
        return self._session(pf, entry, inode=inode, flags=flags, keep_cache=True,
                             base_etag=None, dirty=True)

    async def truncate(self, key: str, etag: str, size: int, mtime: float, *, to: int,
                       inode: int, attrs: Attrs | None = None) -> None:
        """truncate(2) by path: an open, a truncate and a close in one."""
        session = await self.open(key, etag, size, mtime, flags=os.O_WRONLY, inode=inode,
                                  attrs=attrs)
        try:
            await session.truncate(to, always=False)
            await session.flush()
        finally:
            await session.release()

    async def set_attrs(self, key: str, etag: str, attrs: Attrs) -> ObjectInfo | None:
        """chmod, chown, utimens. A file with bytes here (or open for writing) keeps
        them in its journal record: its upload stores them, no request now. A stored
        object gets them by CopyObject onto itself (its new version, returned; the
        cached bytes stay valid under the new ETag); a directory on its marker."""
        pf = self.journal.get(key)
        if pf is not None:
            pf.set_attrs(attrs)
            if pf.local:
                return None
        if key.endswith("/"):
            return await self.workers.meta(partial(
                self.store.put_bytes, key, b"", metadata=to_metadata(attrs)))
        if not etag:  # open for writing, nothing written yet, never stored: the journal has it
            return None
        meta = to_metadata(attrs)
        info = await self.workers.meta(partial(
            self.store.replace_metadata, key, meta, etag=etag,
            typed=listing_misleads(meta)))
        if info.etag != etag:
            await self.workers.disk(self.tier1.reetag, key, info)
        return info

    async def put_special(self, key: str, body: bytes, attrs: Attrs) -> ObjectInfo:
        """A symlink (body: its target), FIFO or socket: an object typed by its
        metadata, stored at once (a pending version of the name is void)."""
        pf = self.journal.get(key)
        if pf is not None:
            await self.life.replaced(pf)
        await self.workers.disk(self.tier1.cache.remove, key)
        meta = to_metadata(attrs)
        return await self.workers.meta(partial(
            self.store.put_bytes, key, body, metadata=meta, typed=listing_misleads(meta)))

    # -- namespace changes that reach the store ----------------------------------------------

    async def delete(self, key: str) -> None:
        """unlink: a pending file is dropped (writers still holding it keep it, and it
        is never uploaded); readers holding the object keep all of it; the object goes."""
        pf = self.journal.get(key)
        if pf is not None:
            async with self.life.settled(pf):
                self.life.streams.abandon(pf)
                self.journal.leave(pf, UNLINKED)
        held = await self.workers.disk(self.tier1.cache.held, key)
        if held is not None:
            try:  # POSIX: open descriptors keep reading the file after the name went
                if held.state == "clean" and not held.serve.complete():
                    await self.tier1.fetch(held, 0, held.size)
                await self.workers.disk(held.serve.verify)
            finally:
                await self.tier1.release(held)
        await self.workers.disk(self.tier1.cache.remove, key)
        await self.workers.meta(self.store.delete, key)

    async def make_dir(self, prefix: str, attrs: Attrs) -> None:
        """mkdir: an empty directory persists as a zero-byte `prefix/` marker. While
        the store is away (degraded, or the PUT says so) the marker is journaled
        like a sealed write-back file and lands with the uploads: a training job
        can still make `step-N/` and write its checkpoint into it."""
        if not self.life.health.degraded:
            try:
                await self.workers.meta(partial(
                    self.store.put_bytes, prefix, b"", metadata=to_metadata(attrs)))
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE_KINDS:
                    raise
        now = time.time()
        pf = self.journal.track(prefix, 0, now)
        entry = await self.tier1.open(prefix, "", 0, now)
        try:
            async with self.life.changing(pf):
                pf.mark_written()
                await self.workers.disk(entry.local.truncate, 0)
                await self.life.seal(pf, entry)
        finally:
            await self.tier1.release(entry)
        self.life.uploader.kick(pf)

    async def remove_dir(self, prefix: str) -> None:
        """rmdir: a journaled marker goes first, so it cannot land afterwards."""
        pf = self.journal.get(prefix)
        if pf is not None:
            async with self.life.settled(pf):
                self.journal.leave(pf, UNLINKED)
        await self.workers.disk(self.tier1.cache.remove, prefix)
        await self.workers.meta(self.store.delete, prefix)
