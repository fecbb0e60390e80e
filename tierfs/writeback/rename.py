"""Renames (DESIGN §5): of a file with local bytes (a journal update: its record
follows it to the new key), of a stored object (a server-side copy and a
delete), onto a manifest name (the commit point of a checkpoint: published
like a manifest close), and of a directory (each object below, one by one).

Every rename calls `moved` (the namespace's move) once the bytes are under
the new name and before anything can land under it: an upload that landed
under a name the namespace did not show yet left the moved node without its
ETag and size (stat said 0 bytes: safetensors' load_file of a file just
renamed with its directory failed "header too small" about 1 run in 3).
"""

from __future__ import annotations

from collections.abc import Callable

from tierfs.queued_writes import QueuedWrites
from tierfs.store.base import ObjectInfo, Store
from tierfs.workers import Workers
from tierfs.writeback.core import WriteBack
from tierfs.writeback.journal import Journal
from tierfs.writeback.lifecycle import Lifecycle
from tierfs.writeback.pending import Condition, PendingFile
from tierfs.writeback.tier1 import Tier1


class Renames:
    def __init__(self, wb: WriteBack, journal: Journal, life: Lifecycle, tier1: Tier1,
                 store: Store, workers: Workers, queued: QueuedWrites) -> None:
        self.wb = wb  # unlink of a name published over
        self.journal = journal
        self.life = life
        self.tier1 = tier1
        self.store = store
        self.workers = workers
        self.queued = queued

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
        life = self.life
        if life.settings(new).publish == "background" and pf is not None and pf.local:
            dst = self.journal.get(new)
            inherited = dst.condition if dst is not None and dst.local else None
            # A release of its last writer while this rename awaits below must not
            # hand it over (a manifest name without a journaled barrier yet: it
            # would be dropped as a publish that failed in close): this does.
            pf.begin_move()
            try:
                got = await self._move_local(old, new)
                local = got is not None
                if got is not None:
                    moved()
                    await self.workers.disk(self.tier1.cache.sync)  # the commit point survives a power loss
                    if not got[1]:  # an older stored version of it
                        await self.workers.meta(self.store.delete, old)
                    async with pf.lock:
                        if inherited is not None:  # replaces one never published: the same store version
                            pf.set_condition(inherited)
                        else:
                            life.publisher.retarget(pf, if_match)
                        if pf.sealed:  # else its close journals the barrier
                            await life.journal_barrier(pf, if_match=if_match)
            finally:
                pf.end_move()
            if local:
                if pf.sealed and not pf.sessions and not pf.gone.is_set():
                    life.hand_over(pf)
                return []
            # it landed meanwhile: a stored object, published below
        condition = await self._replace_pending(new)
        src = await self.workers.disk(self.tier1.cache.open_existing, old)
        info = None
        try:
            if src is None:
                obj = await self.tier1.refresh(old)
                src = await self.tier1.open(old, obj.etag, obj.size, obj.mtime)
            await self.queued.drain_entry(src)  # it moves with every byte written
            if src.state == "clean":
                await self.tier1.fetch(src, 0, src.size)
            info = await life.publisher.publish_rename(src, new, if_match=if_match,
                                                       condition=condition)
        finally:
            if src is not None:
                await self.tier1.release(src)
        dst = self.journal.get(new)
        if dst is not None:
            await life.replaced(dst)
        await self.workers.disk(self.tier1.cache.remove, new)
        await self.wb.delete(old)
        moved()
        return [info]

    async def _replace_pending(self, key: str) -> Condition | None:
        """A manifest pending here under `key` is replaced by the rename about to
        publish over it: its own publish stops first (else the two race for one
        name, and the rename's condition fails on this mount's own version). The
        condition the rename's PUT takes instead: the one the pending version
        had, or If-Match its own ETag if it landed before it stopped."""
        dst = self.journal.get(key)
        if dst is None or not dst.local:
            return None
        await self.life.replaced(dst)
        return dst.condition  # (a background publish that landed left the next one's)

    async def rename_tree(self, old: str, new: str, moved: Callable[[], None]) -> list[ObjectInfo]:
        """Directory rename (`old`, `new` are 'a/b/' prefixes): every object below is
        moved one by one (S3 has no atomic rename); markers keep empty dirs. Files
        with local bytes are re-keyed first; their uploads start once the
        namespace moved, after the copies."""
        pending = self.journal.under(old)
        for pf in pending:  # nothing lands under the old names between the listing and the move
            await self.life.let_go(pf)
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
                    got[0].begin_move()  # a release meanwhile leaves its hand-over to this
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
                pf.end_move()
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
        dst = self.journal.get(new)
        if dst is not None and dst is not pf:
            await self.life.replaced(dst)
        async with self.life.settled(pf):
            if self.journal.get(old) is not pf or not pf.local:
                # Its upload landed (or it went) while this waited: it is a stored
                # object now. Re-keying it would put back a record nothing uploads,
                # and the caller's delete of `old` would take the only copy.
                return None
            held = await self.workers.disk(self.tier1.cache.held, old)
            if held is not None:
                await self.queued.drain_entry(held)  # files move with the bytes written
                await self.tier1.release(held)
            await self.workers.disk(self.tier1.cache.rename, old, new)
            fresh = pf.fresh
            self.journal.rekey(pf, new)
        return pf, fresh

    def _hand_over_moved(self, pf: PendingFile) -> None:
        if pf.sealed and not pf.sessions and not self.life.hand_over(pf):
            self.life.uploader.kick(pf)  # acknowledged under its old name's class: it lands

    async def _move_stored(self, old: str, new: str) -> ObjectInfo:
        dst = self.journal.get(new)
        if dst is not None:
            await self.life.replaced(dst)
        info = await self.workers.meta(self.store.copy, old, new)
        await self.workers.meta(self.store.delete, old)
        await self.workers.disk(self.tier1.rekey, old, new, info)
        pf = self.journal.get(old)
        if pf is not None:  # open for writing, not written yet: its writers follow
            self.journal.rekey(pf, new)
        return info

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
