"""Manifests: the barrier, then a conditional PUT (DESIGN §2).

A manifest (`.metadata`, `latest`, `*.index.json`, ...) is published only
after every upload pending in its directory subtree has landed (its
barrier), with If-Match on the version its writer read (or If-None-Match: *
for a new one).

By default the publish runs behind: close (or the rename onto a manifest
name) returns once the manifest's bytes are sealed here and its barrier and
condition are journaled (a fsynced record under <cache>/publish/); the PUT
follows once the barrier landed, and after a crash the next mount resumes
it. A lost race is then reported afterwards (conflicts/, log, metric,
status, flush). With `publish = "wait"` close waits for the PUT and a lost
race is ESTALE to the writer; the rejected bytes are kept either way.
"""

from __future__ import annotations

import errno
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial

import trio

from tierfs.cache import Entry
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers
from tierfs.writeback.barrier import Barrier, FlushOutcome
from tierfs.writeback.journal import Journal
from tierfs.writeback.pending import CONFLICT, Condition, PendingFile, Waits
from tierfs.writeback.quarantine import Conflicts
from tierfs.writeback.records import BarrierRecords
from tierfs.writeback.transfer import Transfer
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        uploader: Uploader,
        transfer: Transfer,
        barrier: Barrier,
        journal: Journal,
        conflicts: Conflicts,
        records: BarrierRecords,
        workers: Workers,
        nursery: trio.Nursery,
        *,
        conditional: bool,
        observe: Callable[[str, int], None],
    ) -> None:
        self.uploader = uploader
        self.transfer = transfer
        self.barrier = barrier
        self.journal = journal
        self.conflicts = conflicts
        self.records = records
        self.workers = workers
        self.nursery = nursery
        self.conditional = conditional  # False: the store ignores conditions (plain PUTs)
        self.observe = observe
        self._waiting: dict[int, trio.CancelScope] = {}  # id(pf) -> its publish task

    # -- in the background (the default) ------------------------------------------------

    def retarget(self, pf: PendingFile, if_match: str | None) -> None:
        """`pf` is renamed onto a manifest whose store version is `if_match`."""
        pf.set_condition(Condition(*self._condition(if_match)))

    async def journal_barrier(self, pf: PendingFile, *, if_match: str | None) -> None:
        """(holding pf.lock) A manifest sealed (or renamed onto): its barrier (the
        uploads pending in its subtree now) and condition, fsynced here (a small
        record: the manifest's state). The PUT follows `submit`."""
        waits = self.barrier.snapshot(_parent_prefix(pf.key), FlushOutcome(),
                                      exclude=frozenset({pf.key}), manifest=True)
        # a later seal before the PUT keeps the first condition
        cond = pf.condition or Condition(*self._condition(if_match))
        rid = uuid.uuid4().hex
        await self.workers.disk(self.records.save, pf.key, rid, [w.key for w, _ in waits], cond)
        pf.barrier_journaled(waits, rid, cond)

    def submit(self, pf: PendingFile) -> None:
        """The last writer of a journaled manifest is gone: publish it once its
        barrier landed."""
        old = self._waiting.pop(id(pf), None)
        if old is not None:
            old.cancel()
        scope = self._waiting[id(pf)] = trio.CancelScope()
        self.nursery.start_soon(self._publish_when_ready, pf, pf.version, pf.barrier or [],
                                pf.record, scope)

    async def _publish_when_ready(
        self, pf: PendingFile, version: int, waits: Waits, rid: str | None,
        scope: trio.CancelScope,
    ) -> None:
        try:
            with scope:
                if await self._published(pf, version, waits, rid):
                    await self.workers.disk(self.records.drop, pf.key, rid)
        finally:
            if self._waiting.get(id(pf)) is scope:
                del self._waiting[id(pf)]

    async def _published(
        self, pf: PendingFile, version: int, waits: Waits, rid: str | None,
    ) -> bool:
        """Barrier, then hand `pf` to the uploader; whether its record is done with."""
        out = FlushOutcome()
        await self.barrier.wait(waits, out)
        if pf.version != version or pf.gone.is_set() or pf.sessions:
            return pf.gone.is_set()  # else written or opened again: its next close submits it
        pf.barrier_passed()
        if out.failed:
            names = ", ".join(f["key"] for f in out.failed)
            await self.uploader.refuse(pf, f"not published: the store refused {names}")
            return True
        self.uploader.kick(pf)
        while not (pf.landed_version >= version or pf.gone.is_set()):
            if pf.version != version:
                return False  # a newer seal journaled its own record
            await self.journal.wait_change()
        return True

    # -- waiting for it (publish = "wait") -------------------------------------------------

    async def publish(self, pf: PendingFile, entry: Entry, version: int, *,
                      if_match: str | None) -> ObjectInfo:
        """close/fsync of a sealed manifest (`version` of it): barrier, then the
        conditional PUT, with no lock held (a release or a stat of it does not
        wait for them); committed if it is still that version."""
        key = pf.key
        await self._barrier(key, exclude=key)
        try:
            match, none_match = self._condition(if_match)
            info = await self.transfer.land(entry, pf=pf, version=version, if_match=match,
                                            if_none_match=none_match)
        except StoreError as exc:
            await self.workers.disk(partial(self.conflicts.keep, entry, str(exc), told=True))
            async with pf.lock:
                self.journal.leave(pf, CONFLICT)
            if exc.kind == "precondition":
                log.warning("manifest %r lost a concurrent update: kept under %s, not published",
                            key, self.conflicts.root)
                raise OSError(errno.ESTALE, f"{key}: changed in the store since it was opened") from None
            raise OSError(exc.errno or errno.EIO, str(exc)) from None
        await self.uploader.commit(pf, entry, version, info)
        return info

    async def publish_rename(self, src: Entry, dst: str, *, if_match: str | None,
                             condition: Condition | None = None) -> ObjectInfo:
        """rename(tmp, manifest): the same barrier and condition for `src`'s bytes
        under `dst` (`src` must be whole in tier 1): the version `if_match` the
        renamer saw, or `condition`, that of a version of `dst` pending here that
        the rename replaces. A lost race: ESTALE, the source stays."""
        await self._barrier(dst, exclude=src.key)
        match, none_match = condition or self._condition(if_match)
        try:
            return await self.transfer.land(src, key=dst, mtime=time.time(),
                                            if_match=match, if_none_match=none_match)
        except StoreError as exc:
            if exc.kind == "precondition":
                log.warning("rename onto manifest %r lost a concurrent update; %r kept", dst, src.key)
                raise OSError(errno.ESTALE, f"{dst}: changed in the store") from None
            raise

    async def _barrier(self, key: str, *, exclude: str) -> None:
        outcome = await self.barrier.flush(_parent_prefix(key), exclude=frozenset({exclude}),
                                           manifest=True)
        if outcome.failed:
            names = ", ".join(f["key"] for f in outcome.failed)
            raise OSError(errno.EIO, f"{key}: not published: the store refused {names}")

    def _condition(self, if_match: str | None) -> tuple[str | None, bool]:
        """(If-Match, If-None-Match: *) for a writer that read `if_match` (None: new)."""
        if not self.conditional:
            return None, False
        return (if_match, False) if if_match else (None, True)


def _parent_prefix(key: str) -> str:
    """The directory subtree a manifest speaks for: 'a/b/.metadata' -> 'a/b/'."""
    head, sep, _ = key.rpartition("/")
    return head + sep
