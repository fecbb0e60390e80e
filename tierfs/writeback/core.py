"""The write path's front (DESIGN §5): sessions, namespace changes that reach the
store, recovery, the barrier, and what `tierfs pending` asks for."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial

from tierfs.posix import Attrs, Known, listing_misleads, to_metadata
from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.writeback.barrier import Barrier, FlushOutcome, Progress
from tierfs.writeback.journal import Condition, PendingFile
from tierfs.writeback.quarantine import UNCHECKED, Note, Quarantine
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
        self, key: str, etag: str, size: int, mtime: float, *, flags: int, inode: int,
        attrs: Attrs | None = None,
    ) -> WriteSession:
        """A writable open of an existing file (O_TRUNC truncates it); `attrs`, its
        POSIX attributes if known, go with its next upload."""
        settings = self.ctx.policy.settings(key)
        entry, etag = await self.ctx.open_seen(key, etag, size, mtime)
        pf = self.journal.track(key, entry.size, entry.mtime)
        if pf.attrs is None:
            pf.attrs = attrs
        session = WriteSession(
            self.ctx, pf, entry, inode=inode, keep_cache=settings.keep_cache,
            direct=settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY,
            base_etag=etag or None, dirty=False)
        pf.sessions.add(session)
        self.journal.notify()
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
        settings = self.ctx.policy.settings(key)
        now = attrs.mtime_ns / 1e9
        new = self.journal.get(key) is None
        pf = self.journal.track(key, 0, now)
        pf.fresh = fresh and (new or pf.fresh)
        pf.attrs = attrs
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
            pf.size = 0
            pf.written(attrs.mtime_ns)
        session = WriteSession(
            self.ctx, pf, entry, inode=inode, keep_cache=True,
            direct=settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY,
            base_etag=None, dirty=True)
        pf.sessions.add(session)
        self.journal.notify()
        return session

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
            await self.workers.disk(self._reetag_cached, key, info)
        return info

    async def put_special(self, key: str, body: bytes, attrs: Attrs) -> ObjectInfo:
        """A symlink (body: its target), FIFO or socket: an object typed by its
        metadata, stored at once (a pending version of the name is void)."""
        pf = self.journal.get(key)
        if pf is not None:
            await self._supersede(pf)
        await self.workers.disk(self.cache.remove, key)
        meta = to_metadata(attrs)
        return await self.workers.meta(partial(
            self.store.put_bytes, key, body, metadata=meta, typed=listing_misleads(meta)))

    # -- namespace changes that reach the store ----------------------------------------------

    async def delete(self, key: str) -> None:
        """unlink: a pending file is dropped (writers still holding it keep it, and it
        is never uploaded); readers holding the object keep all of it; the object goes."""
        pf = self.journal.get(key)
        if pf is not None:
            async with pf.lock:
                await self.uploader.stop(pf)
                self.ctx.streams.abandon(pf)
                pf.unlinked = bool(pf.sessions)
                self.journal.leave(pf, "unlinked")
        held = await self.workers.disk(self.cache.held, key)
        if held is not None:
            try:  # POSIX: open descriptors keep reading the file after the name went
                if held.state == "clean" and not held.whole():
                    await self.ctx.fetch(held, 0, held.size)
                await self.workers.disk(held.verify)
            finally:
                await self.ctx.release_entry(held)
        await self.workers.disk(self.cache.remove, key)
        await self.workers.meta(self.store.delete, key)

    async def make_dir(self, prefix: str, attrs: Attrs) -> None:
        """mkdir: an empty directory persists as a zero-byte `prefix/` marker. While
        the store is away (degraded, or the PUT says so) the marker is journaled
        like a sealed write-back file and lands with the uploads: a training job
        can still make `step-N/` and write its checkpoint into it."""
        if not self.ctx.health.degraded:
            try:
                await self.workers.meta(partial(
                    self.store.put_bytes, prefix, b"", metadata=to_metadata(attrs)))
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

    # Every rename calls `moved` (the namespace's move) once the bytes are under
    # the new name and before anything can land under it: an upload that landed
    # under a name the namespace did not show yet left the moved node without its
    # ETag and size (stat said 0 bytes: safetensors' load_file of a file just
    # renamed with its directory failed "header too small" about 1 run in 3).

    async def rename_file(self, old: str, new: str, moved: Callable[[], None]) -> list[ObjectInfo]:
        """A file with local bytes is re-keyed here (a journal update); a stored one is
        copied server-side and deleted. Returns the store attributes of what was copied."""
        got = await self._move_local(old, new)
        if got is not None:
            pf, fresh = got
            try:
                moved()
            finally:
                self._hand_over_moved(pf)
            if not fresh:  # an older version of `old` may be in the store: it must go
                await self.workers.meta(self.store.delete, old)
            return []
        info = await self._move_stored(old, new)
        moved()
        return [info]

    async def publish_rename(self, old: str, new: str, moved: Callable[[], None], *,
                             if_match: str | None) -> list[ObjectInfo]:
        """os.replace(tmp, manifest) is the commit point of a checkpoint: published
        like a manifest close. A file pending here is re-keyed and its barrier
        journaled (the PUT follows); a stored one, or `publish = "wait"`, waits
        for the barrier and the conditional PUT of its bytes under `new`."""
        pf = self.journal.get(old)
        if self.ctx.policy.settings(new).publish == "background" and pf is not None and pf.local:
            dst = self.journal.get(new)
            inherited = dst.condition if dst is not None and dst.local else None
            # A release of its last writer while this rename awaits below must not
            # hand it over (a manifest name without a journaled barrier yet: it
            # would be dropped as a publish that failed in close): this does.
            pf.renaming = True
            try:
                got = await self._move_local(old, new)
                local = got is not None
                if got is not None:
                    moved()
                    await self.workers.disk(self.cache.sync)  # the commit point survives a power loss
                    if not got[1]:  # an older stored version of it
                        await self.workers.meta(self.store.delete, old)
                    if inherited is not None:  # replaces one never published: the same store version
                        pf.condition = inherited
                    else:
                        self.ctx.publisher.retarget(pf, if_match)
                    if pf.sealed:  # else its close journals the barrier
                        await self.ctx.publisher.journal_barrier(pf, if_match=if_match)
            finally:
                pf.renaming = False
            if local:
                if pf.sealed and not pf.sessions and not pf.gone.is_set():
                    self.ctx.hand_over(pf)
                return []
            # it landed meanwhile: a stored object, published below
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
        moved()
        return [info]

    async def rename_tree(self, old: str, new: str, moved: Callable[[], None]) -> list[ObjectInfo]:
        """Directory rename (`old`, `new` are 'a/b/' prefixes): every object below is
        moved one by one (S3 has no atomic rename); markers keep empty dirs. Files
        with local bytes are re-keyed first; their uploads start once the
        namespace moved, after the copies."""
        pending = self.journal.under(old)
        for pf in pending:  # nothing lands under the old names between the listing and the move
            await self.uploader.stop(pf)
        keys, dirs = await self._walk(old)
        local = [pf.key for pf in pending if self.journal.get(pf.key) is pf]
        for key in {*keys, *dirs, *local}:  # every new key must fit before anything moves
            self.store.check_key(new + key[len(old):])
        rekeyed: list[PendingFile] = []
        try:
            stale = set()
            for key in local:
                got = await self._move_local(key, new + key[len(old):])
                if got is not None:
                    got[0].renaming = True  # a release meanwhile leaves its hand-over to this
                    rekeyed.append(got[0])
                    stale.add(key)
            copied = []
            for key in keys:
                if key in stale:  # pending under the new name already; this is a stale version
                    await self.workers.meta(self.store.delete, key)
                    continue
                copied.append(await self._move_stored(key, new + key[len(old):]))
            for d in [old, *dirs]:
                await self.workers.meta(self.store.put_bytes, new + d[len(old):], b"")
            for d in [*reversed(dirs), old]:
                await self.workers.meta(self.store.delete, d)
            moved()
        finally:
            for pf in rekeyed:
                pf.renaming = False
                self._hand_over_moved(pf)
        return copied

    async def _move_local(self, old: str, new: str) -> tuple[PendingFile, bool] | None:
        """Re-key a file with local bytes, with its writers and its queued writes
        (it takes the class of its new name); the caller hands it over
        (`_hand_over_moved`). Also whether the store never had an object under
        `old` (PendingFile.fresh: no DELETE of it needed). None if `old` has none
        here (a stored object: only a store-side copy puts its bytes under `new`)."""
        pf = self.journal.get(old)
        if pf is None or not pf.local:
            return None
        async with pf.lock:
            await self.uploader.stop(pf)
            if self.journal.get(old) is not pf or not pf.local:
                # Its upload landed (or it went) while this waited: it is a stored
                # object now. Re-keying it would put back a record nothing uploads,
                # and the caller's delete of `old` would take the only copy.
                return None
            held = await self.workers.disk(self.cache.held, old)
            if held is not None:
                await self.ctx.queued.drain_entry(held)  # files move with the bytes written
                await self.ctx.release_entry(held)
            dst = self.journal.get(new)
            if dst is not None and dst is not pf:
                await self._supersede(dst)
            await self.workers.disk(self.cache.rename, old, new)
            fresh = pf.fresh
            self.journal.rekey(pf, new)
        return pf, fresh

    def _hand_over_moved(self, pf: PendingFile) -> None:
        if pf.sealed and not pf.sessions and not self.ctx.hand_over(pf):
            self.uploader.kick(pf)  # acknowledged under its old name's class: it lands

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

    def _reetag_cached(self, key: str, info: ObjectInfo) -> None:
        """The object's bytes did not change, only its ETag (new metadata)."""
        entry = self.cache.open_existing(key)
        if entry is None:
            return
        try:
            if entry.state == "clean":
                entry.set_state("clean", etag=info.etag, mtime=info.mtime)
        finally:
            self.cache.release(entry)

    def _rekey_cached(self, old: str, new: str, info: ObjectInfo) -> None:
        """Cached bytes of a server-side copy stay valid: move them under the copy's ETag.
        What the cache held for `new` is void either way: a sealed record left there
        by a cancelled upload would otherwise be uploaded again over the copy."""
        if not self.cache.rename(old, new):
            self.cache.remove(new)
            return
        self._reetag_cached(new, info)

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
        """After a restart: every sealed write-back file uploads again, every manifest
        whose barrier was journaled publishes once that barrier landed; what a
        close never finished (dirty, or sealed but waiting for the store) is
        quarantined."""
        await self.ctx.streams.recover()
        objs = await self.workers.disk(lambda: list(self.cache.iter_objects()))
        publisher = self.ctx.publisher
        records = await self.workers.disk(publisher.records.load)
        manifests = []
        for obj in objs:
            mode = self.ctx.policy.settings(obj.key).write_mode
            rec = records.get(obj.key)
            if obj.state == "sealed" and not await self.workers.disk(
                    self.cache.finish_seal, obj.key):
                log.error("%r was closed without fsync and the machine restarted before its "
                          "checksums were taken: quarantined, not uploaded", obj.key)
                await self.workers.disk(
                    self.quarantine.keep, obj.key, UNCHECKED,
                    "closed without fsync; the machine restarted before its checksums were "
                    "taken, so a torn copy cannot be told from a whole one: not uploaded")
            elif obj.state == "sealed" and (mode == "writeback" or obj.key.endswith("/")):
                pf = self.journal.track(obj.key, obj.size, obj.mtime)
                pf.local, pf.sealed_at = True, time.monotonic()
                known = Known.unpack((await self.workers.disk(
                    self.cache.attrs_of, [obj.key])).get(obj.key, b""))
                pf.attrs = known.attrs if known is not None and not known.etag else None
                log.info("resuming upload of %r (%d bytes) sealed before a restart", obj.key, obj.size)
                self.uploader.kick(pf)
            elif obj.state == "sealed" and mode == "publish" and rec is not None:
                manifests.append((obj, records.pop(obj.key)))
            elif obj.state == "sealed":
                # Its close was waiting for the store (write-through, or a publish
                # told to wait): publishing it now would skip the barrier and the
                # condition its writer was promised.
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "unfinished",
                    f"its {mode} close had not returned when the daemon stopped: not uploaded")
            elif obj.state == "dirty":
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "never_closed",
                    "written but never closed before the daemon stopped")
        for obj, rec in manifests:  # every upload of its barrier is tracked by now
            pf = self.journal.track(obj.key, obj.size, obj.mtime)
            pf.local, pf.sealed_at = True, time.monotonic()
            pf.condition = Condition(rec.get("if_match"), bool(rec.get("if_none_match")))
            pf.barrier = [(b, b.version) for k in rec.get("barrier", [])
                          if (b := self.journal.get(k)) is not None]
            pf.record = rec.get("id")
            log.info("resuming the publish of %r after %d upload(s) of its barrier",
                     obj.key, len(pf.barrier))
            publisher.submit(pf)
        for key in records:  # its manifest landed, or went, before the restart
            await self.workers.disk(publisher.records.drop, key)

    async def flush(
        self, prefix: str = "", *, stall: float | None = None, progress: Progress | None = None
    ) -> FlushOutcome:
        return await self.barrier.flush(prefix, stall=stall, progress=progress)

    def summary(self, prefix: str = "") -> dict[str, object]:
        # (checksums of every sealed file, not only those under `prefix`)
        return self.journal.summary(prefix) | {"checksums_pending": self.uploader.digesting}

    async def notes(self) -> list[Note]:
        """Files kept aside: quarantined, and manifests whose background publish lost its race."""
        conflicts = self.ctx.publisher.conflicts
        return await self.workers.disk(lambda: self.quarantine.notes() + conflicts.notes())

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
        conflicts = self.ctx.publisher.conflicts
        note = await self.workers.disk(conflicts.find, key)
        if note is not None:
            await self.workers.disk(conflicts.discard, note)
            return "conflict discarded (its bytes were never published)"
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
