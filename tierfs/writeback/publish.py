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
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from tierfs.cache import Entry
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers
from tierfs.writeback import records
from tierfs.writeback.barrier import Barrier, FlushOutcome
from tierfs.writeback.journal import Condition, Journal, PendingFile
from tierfs.writeback.quarantine import Conflicts
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class Records:
    """The journaled barriers of manifests not published yet: one fsynced JSON
    file per manifest key. Blocking (run in a disk worker)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def save(self, key: str, rid: str, barrier: list[str], cond: Condition) -> None:
        records.save(self._path(key), {"key": key, "id": rid, "barrier": barrier,
                                       "if_match": cond.if_match,
                                       "if_none_match": cond.if_none_match})

    def load(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for rec in records.load(self.root, "publish"):
            if isinstance(rec.get("key"), str):
                out[rec["key"]] = rec
        return out

    def drop(self, key: str, rid: str | None = None) -> None:
        """Forget the record of `key` (only if it is `rid`'s, when given)."""
        path = self._path(key)
        try:
            if rid is not None and json.loads(path.read_text()).get("id") != rid:
                return
            path.unlink()
        except (OSError, ValueError):
            pass


class Publisher:
    def __init__(
        self,
        uploader: Uploader,
        barrier: Barrier,
        journal: Journal,
        conflicts: Conflicts,
        records: Records,
        workers: Workers,
        nursery: trio.Nursery,
        *,
        conditional: bool,
        on_dropped: Callable[[str], None],
        observe: Callable[[str, int], None],
    ) -> None:
        self.uploader = uploader
        self.barrier = barrier
        self.journal = journal
        self.conflicts = conflicts
        self.records = records
        self.workers = workers
        self.nursery = nursery
        self.conditional = conditional  # False: the store ignores conditions (plain PUTs)
        self.on_dropped = on_dropped
        self.observe = observe
        self._waiting: dict[int, trio.CancelScope] = {}  # id(pf) -> its publish task

    # -- in the background (the default) ------------------------------------------------

    def retarget(self, pf: PendingFile, if_match: str | None) -> None:
        """`pf` is renamed onto a manifest whose store version is `if_match`."""
        pf.condition = Condition(*self._condition(if_match))

    async def journal_barrier(self, pf: PendingFile, *, if_match: str | None) -> None:
        """A manifest sealed (or renamed onto): its barrier (the uploads pending in
        its subtree now) and condition, fsynced here. The PUT follows `submit`."""
        waits = self.barrier.snapshot(_parent_prefix(pf.key), FlushOutcome(),
                                      exclude=frozenset({pf.key}), manifest=True)
        if pf.condition is None:  # a later seal before the PUT keeps the first condition
            pf.condition = Condition(*self._condition(if_match))
        rid = uuid.uuid4().hex
        await self.workers.disk(self.records.save, pf.key, rid, [w.key for w, _ in waits],
                                pf.condition)
        pf.barrier, pf.record = waits, rid

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
        self, pf: PendingFile, version: int, waits: list[tuple[PendingFile, int]],
        rid: str | None, scope: trio.CancelScope,
    ) -> None:
        try:
            with scope:
                if await self._published(pf, version, waits, rid):
                    await self.workers.disk(self.records.drop, pf.key, rid)
        finally:
            if self._waiting.get(id(pf)) is scope:
                del self._waiting[id(pf)]

    async def _published(
        self, pf: PendingFile, version: int, waits: list[tuple[PendingFile, int]],
        rid: str | None,
    ) -> bool:
        """Barrier, then hand `pf` to the uploader; whether its record is done with."""
        out = FlushOutcome()
        await self.barrier.wait(waits, out)
        if pf.version != version or pf.gone.is_set() or pf.sessions:
            return pf.gone.is_set()  # else written or opened again: its next close submits it
        if out.failed:
            names = ", ".join(f["key"] for f in out.failed)
            pf.barrier = None
            await self.uploader.refuse(pf, f"not published: the store refused {names}")
            return True
        pf.barrier = None
        self.uploader.kick(pf)
        while not (pf.landed_version >= version or pf.gone.is_set()):
            if pf.version != version:
                return False  # a newer seal journaled its own record
            await self.journal.wait_change()
        return True

    async def conflict(self, pf: PendingFile, entry: Entry, exc: StoreError) -> None:
        """A background PUT lost its race: keep the bytes, say so everywhere."""
        note = await self.workers.disk(partial(self.conflicts.keep, entry, str(exc), told=False))
        log.error("manifest %r changed in the store before its background publish: "
                  "not published, kept at %s", pf.key, self.conflicts.root / note.file)
        self.observe("publish_conflict", 1)
        pf.error = f"lost a concurrent update: kept at {self.conflicts.root / note.file}"
        self.on_dropped(pf.key)
        await self.workers.disk(self.records.drop, pf.key, pf.record)
        self.journal.leave(pf, "conflict")

    # -- waiting for it (publish = "wait") -------------------------------------------------

    async def publish(self, pf: PendingFile, entry: Entry, *, if_match: str | None) -> ObjectInfo:
        """close/fsync of a sealed manifest: barrier, then the conditional PUT."""
        key = pf.key
        await self._barrier(key, exclude=key)
        try:
            match, none_match = self._condition(if_match)
            info = await self.uploader.land(pf, entry, if_match=match, if_none_match=none_match)
        except StoreError as exc:
            await self.workers.disk(partial(self.conflicts.keep, entry, str(exc), told=True))
            self.journal.leave(pf, "conflict")
            if exc.kind == "precondition":
                log.warning("manifest %r lost a concurrent update: kept under %s, not published",
                            key, self.conflicts.root)
                raise OSError(errno.ESTALE, f"{key}: changed in the store since it was opened") from None
            raise OSError(exc.errno or errno.EIO, str(exc)) from None
        self.journal.landed(pf)
        return info

    async def publish_rename(self, src: Entry, dst: str, *, if_match: str | None) -> ObjectInfo:
        """rename(tmp, manifest): the same barrier and condition for `src`'s bytes
        under `dst` (`src` must be whole in tier 1). A lost race: ESTALE, the
        source stays."""
        await self._barrier(dst, exclude=src.key)
        match, none_match = self._condition(if_match)
        try:
            return await self.uploader.land(None, src, key=dst, mtime=time.time(), mark_clean=False,
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
