"""The write path's front (DESIGN §5): sessions, namespace changes that reach the
store, recovery, the barrier, and what `tierfs pending` asks for."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict

from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.writeback.barrier import Barrier, FlushOutcome, Progress
from tierfs.writeback.journal import PendingFile
from tierfs.writeback.quarantine import Note, Quarantine
from tierfs.writeback.session import WriteContext, WriteSession

log = logging.getLogger(__name__)


class WriteBack:
    def __init__(
        self, ctx: WriteContext, store: Store, quarantine: Quarantine, barrier: Barrier
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.quarantine = quarantine
        self.barrier = barrier
        self.journal = ctx.journal
        self.cache = ctx.cache
        self.workers = ctx.workers
        self.uploader = ctx.uploader

    # -- sessions -----------------------------------------------------------------------

    async def open(
        self, key: str, etag: str, size: int, mtime: float, *, flags: int, inode: int
    ) -> WriteSession:
        """A writable open of an existing file (O_TRUNC truncates it)."""
        settings = self.ctx.policy.settings(key)
        entry = await self.ctx.open_entry(key, etag, size, mtime)
        pf = self.journal.track(key, entry.size, entry.mtime)
        session = WriteSession(
            self.ctx, pf, entry, inode=inode, keep_cache=settings.keep_cache,
            direct=settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY,
            base_etag=etag or None, dirty=False)
        pf.sessions.add(session)
        self.journal.notify()
        if flags & os.O_TRUNC and entry.size:
            try:
                await session.truncate(0)
            except BaseException:
                await session.release()
                raise
        return session

    async def create(self, key: str, *, flags: int, inode: int) -> WriteSession:
        """A new, empty file (or one truncated to nothing by O_CREAT on a stale name)."""
        settings = self.ctx.policy.settings(key)
        now = time.time()
        pf = self.journal.track(key, 0, now)
        async with pf.lock:
            await self.uploader.stop(pf)
            entry = await self.ctx.open_entry(key, "", 0, now)
            try:
                await self.ctx.local_write(entry.truncate, 0)
            except BaseException:
                await self.ctx.release_entry(entry)
                if not pf.sessions and not pf.local:
                    self.journal.leave(pf, "dropped")
                raise
            self.ctx.mark_written(pf)
            pf.size, pf.mtime = 0, now
        session = WriteSession(
            self.ctx, pf, entry, inode=inode, keep_cache=True,
            direct=settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY,
            base_etag=None, dirty=True)
        pf.sessions.add(session)
        self.journal.notify()
        return session

    async def truncate(self, key: str, etag: str, size: int, mtime: float, *, to: int,
                       inode: int) -> None:
        """truncate(2) by path: an open, a truncate and a close in one."""
        session = await self.open(key, etag, size, mtime, flags=os.O_WRONLY, inode=inode)
        try:
            await session.truncate(to)
            await session.flush()
        finally:
            await session.release()

    def set_mtime(self, key: str, mtime: float) -> None:
        pf = self.journal.get(key)
        if pf is not None:
            pf.mtime = mtime

    # -- namespace changes that reach the store ----------------------------------------------

    async def delete(self, key: str) -> None:
        """unlink: a pending file is dropped (writers still holding it keep it, and it
        is never uploaded); readers holding the object keep all of it; the object goes."""
        pf = self.journal.get(key)
        if pf is not None:
            async with pf.lock:
                await self.uploader.stop(pf)
                pf.unlinked = bool(pf.sessions)
                self.journal.leave(pf, "unlinked")
        held = await self.workers.disk(self.cache.held, key)
        if held is not None:
            try:  # POSIX: open descriptors keep reading the file after the name went
                if held.state == "clean" and held.missing(0, held.size):
                    await self.ctx.fetch(held, 0, held.size)
                await self.workers.disk(held.verify)
            finally:
                await self.ctx.release_entry(held)
        await self.workers.disk(self.cache.remove, key)
        await self.workers.meta(self.store.delete, key)

    async def make_dir(self, prefix: str) -> None:
        """mkdir: an empty directory persists as a zero-byte `prefix/` marker. While
        the store is away (degraded, or the PUT says so) the marker is journaled
        like a sealed write-back file and lands with the uploads: a training job
        can still make `step-N/` and write its checkpoint into it."""
        if not self.ctx.health.degraded:
            try:
                await self.workers.meta(self.store.put_bytes, prefix, b"")
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE_KINDS:
                    raise
        now = time.time()
        pf = self.journal.track(prefix, 0, now)
        entry = await self.ctx.open_entry(prefix, "", 0, now)
        try:
            async with pf.lock:
                await self.workers.disk(entry.truncate, 0)
                self.ctx.mark_written(pf)
                await self.ctx.seal_local(pf, entry)
        finally:
            await self.ctx.release_entry(entry)
        self.uploader.kick(pf)

    async def remove_dir(self, prefix: str) -> None:
        """rmdir: a journaled marker goes first, so it cannot land afterwards."""
        pf = self.journal.get(prefix)
        if pf is not None:
            await self.uploader.stop(pf)
            self.journal.leave(pf, "unlinked")
        await self.workers.disk(self.cache.remove, prefix)
        await self.workers.meta(self.store.delete, prefix)

    async def rename_file(self, old: str, new: str) -> list[ObjectInfo]:
        """A file with local bytes is re-keyed here (a journal update); a stored one is
        copied server-side and deleted. Returns the store attributes of what was copied."""
        if await self._move_local(old, new):
            # An older version of `old` may be in the store; it must not survive the rename.
            await self.workers.meta(self.store.delete, old)
            return []
        return [await self._move_stored(old, new)]

    async def publish_rename(self, old: str, new: str, *, if_match: str | None) -> ObjectInfo:
        """os.replace(tmp, manifest) is the commit point of a checkpoint: publish it
        like a manifest close (barrier + conditional PUT), then drop the source."""
        src = await self.workers.disk(self.cache.open_existing, old)
        info = None
        try:
            if src is None:
                obj = await self.ctx.refresh(old)
                src = await self.ctx.open_entry(old, obj.etag, obj.size, obj.mtime)
            await self.ctx.queued.drain_entry(src)  # it moves with every byte written
            if src.state == "clean":
                await self.ctx.fetch(src, 0, src.size)
            info = await self.ctx.publisher.publish_rename(src, new, if_match=if_match)
        finally:
            if src is not None:
                await self.ctx.release_entry(src)
        dst = self.journal.get(new)
        if dst is not None:
            await self._supersede(dst)
        await self.workers.disk(self.cache.remove, new)
        await self.delete(old)
        return info

    async def rename_tree(self, old: str, new: str) -> list[ObjectInfo]:
        """Directory rename (`old`, `new` are 'a/b/' prefixes): every object below is
        moved one by one (S3 has no atomic rename); markers keep empty dirs."""
        keys, dirs = await self._walk(old)
        local = [pf.key for pf in self.journal.under(old)]
        for key in {*keys, *dirs, *local}:  # every new key must fit before anything moves
            self.store.check_key(new + key[len(old):])
        moved = set()
        for key in local:
            if await self._move_local(key, new + key[len(old):]):
                moved.add(key)
        copied = []
        for key in keys:
            if key in moved:  # pending under the new name already; this is a stale version
                await self.workers.meta(self.store.delete, key)
                continue
            copied.append(await self._move_stored(key, new + key[len(old):]))
        for d in [old, *dirs]:
            await self.workers.meta(self.store.put_bytes, new + d[len(old):], b"")
        for d in [*reversed(dirs), old]:
            await self.workers.meta(self.store.delete, d)
        return copied

    async def _move_local(self, old: str, new: str) -> bool:
        """Re-key a file with local bytes, with its writers and its queued writes.
        False if `old` has none here (a stored object: only a store-side copy puts
        its bytes under `new`)."""
        pf = self.journal.get(old)
        if pf is None or not pf.local:
            return False
        async with pf.lock:
            await self.uploader.stop(pf)
            held = await self.workers.disk(self.cache.held, old)
            if held is not None:
                await self.ctx.queued.drain_entry(held)  # files move with the bytes written
                await self.ctx.release_entry(held)
            dst = self.journal.get(new)
            if dst is not None and dst is not pf:
                await self._supersede(dst)
            await self.workers.disk(self.cache.rename, old, new)
            self.journal.rekey(pf, new)
        if pf.sealed and not pf.sessions:
            self.uploader.kick(pf)
        return True

    async def _move_stored(self, old: str, new: str) -> ObjectInfo:
        dst = self.journal.get(new)
        if dst is not None:
            await self._supersede(dst)
        info = await self.workers.meta(self.store.copy, old, new)
        await self.workers.meta(self.store.delete, old)
        await self.workers.disk(self._rekey_cached, old, new, info)
        pf = self.journal.get(old)
        if pf is not None:  # open for writing, not written yet: its writers follow
            self.journal.rekey(pf, new)
        return info

    async def _supersede(self, pf: PendingFile) -> None:
        """A rename replaces `pf`'s file: its pending bytes are void (its writers,
        if any, keep them, like those of an unlinked file)."""
        async with pf.lock:
            await self.uploader.stop(pf)
            pf.unlinked = bool(pf.sessions)
            self.journal.leave(pf, "replaced")

    def _rekey_cached(self, old: str, new: str, info: ObjectInfo) -> None:
        """Cached bytes of a server-side copy stay valid: move them under the copy's ETag.
        What the cache held for `new` is void either way: a sealed record left there
        by a cancelled upload would otherwise be uploaded again over the copy."""
        if not self.cache.rename(old, new):
            self.cache.remove(new)
            return
        entry = self.cache.open_existing(new)
        if entry is None:
            return
        try:
            if entry.state == "clean":
                entry.set_state("clean", etag=info.etag, mtime=info.mtime)
        finally:
            self.cache.release(entry)

    async def _walk(self, prefix: str) -> tuple[list[str], list[str]]:
        """Every object key and every sub-prefix below `prefix`, from the store."""
        keys: list[str] = []
        dirs: list[str] = []
        todo = [prefix]
        while todo:
            p = todo.pop()
            listing = await self.workers.meta(self.store.list_dir, p)
            keys.extend(info.key for info in listing.files)
            for name in listing.dirs:
                sub = f"{p}{name}/"
                dirs.append(sub)
                todo.append(sub)
        return keys, dirs

    # -- recovery, the barrier, pending files -------------------------------------------------

    async def recover(self) -> None:
        """After a restart: every sealed write-back file uploads again; what a close
        never finished (dirty, or sealed but waiting for the store) is quarantined."""
        objs = await self.workers.disk(lambda: list(self.cache.iter_objects()))
        for obj in objs:
            mode = self.ctx.policy.settings(obj.key).write_mode
            if obj.state == "sealed" and (mode == "writeback" or obj.key.endswith("/")):
                pf = self.journal.track(obj.key, obj.size, obj.mtime)
                pf.local, pf.sealed_at = True, time.monotonic()
                log.info("resuming upload of %r (%d bytes) sealed before a restart", obj.key, obj.size)
                self.uploader.kick(pf)
            elif obj.state == "sealed":
                # A manifest was never published: publishing it now would skip the
                # barrier and the condition its writer was promised.
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "unfinished",
                    f"its {mode} close had not returned when the daemon stopped: not uploaded")
            elif obj.state == "dirty":
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "never_closed",
                    "written but never closed before the daemon stopped")

    async def flush(
        self, prefix: str = "", *, stall: float | None = None, progress: Progress | None = None
    ) -> FlushOutcome:
        return await self.barrier.flush(prefix, stall=stall, progress=progress)

    def summary(self, prefix: str = "") -> dict[str, object]:
        return self.journal.summary(prefix)

    async def notes(self) -> list[Note]:
        return await self.workers.disk(self.quarantine.notes)

    async def pending(self, prefix: str = "") -> dict[str, object]:
        """What `tierfs pending list` shows: files here only, and files kept aside."""
        files = [pf.describe() for pf in self.journal.under(prefix) if pf.local]
        notes = [asdict(n) for n in await self.notes() if n.key.startswith(prefix)]
        return {"files": files, "quarantined": notes}

    async def discard(self, key: str) -> str:
        """Forget a quarantined file, or a pending one's local bytes. What was done."""
        note = await self.workers.disk(self.quarantine.find, key)
        if note is not None:
            await self.workers.disk(self.quarantine.discard, note)
            return "discarded from quarantine"
        pf = self.journal.get(key)
        if pf is None or not pf.local:
            raise FileNotFoundError(f"{key}: nothing pending or quarantined")
        if pf.sessions:
            raise OSError(f"{key}: open for writing; close it first")
        async with pf.lock:
            await self.ctx.drop(pf, "discarded")
        log.warning("discarded the local bytes of %r (never uploaded), on request", key)
        return "local bytes discarded, not uploaded"

    async def retry(self, key: str) -> str:
        """Upload a quarantined file again, or a pending one now (not after its backoff)."""
        note = await self.workers.disk(self.quarantine.find, key)
        if note is not None:
            entry = await self.workers.disk(self.quarantine.restore, note)
            await self.ctx.release_entry(entry)
            pf = self.journal.track(key, entry.size, time.time())
            pf.local, pf.sealed_at = True, time.monotonic()
            self.uploader.kick(pf)
            log.info("retrying the upload of quarantined %r, on request", key)
            return "back in the upload queue"
        pending = self.journal.get(key)
        if pending is None or not pending.sealed:
            raise FileNotFoundError(f"{key}: nothing pending or quarantined")
        pending.nudged.set()
        self.uploader.kick(pending)
        return "retried now"
