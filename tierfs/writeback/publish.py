"""Manifests: the barrier, then a conditional PUT (DESIGN §2).

A manifest (`.metadata`, `latest`, `*.index.json`, ...) is published only
after every upload pending in its directory subtree has landed (its
barrier), with If-Match on the version its writer read (or If-None-Match: *
for a new one). A lost race is ESTALE to the writer, and the rejected bytes
are kept under conflicts/ with a note.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

from tierfs.cache import Cache, Entry
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.workers import Workers
from tierfs.writeback.barrier import Barrier
from tierfs.writeback.journal import Journal, PendingFile
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        uploader: Uploader,
        barrier: Barrier,
        journal: Journal,
        cache: Cache,
        workers: Workers,
        *,
        conflicts_dir: Path,
        conditional: bool,
    ) -> None:
        self.uploader = uploader
        self.barrier = barrier
        self.journal = journal
        self.cache = cache
        self.workers = workers
        self.conflicts_dir = conflicts_dir
        self.conditional = conditional  # False: the store ignores conditions (plain PUTs)

    async def publish(self, pf: PendingFile, entry: Entry, *, if_match: str | None) -> ObjectInfo:
        """close/fsync of a sealed manifest: barrier, then the conditional PUT."""
        key = pf.key
        await self._barrier(key, exclude=key)
        try:
            match, none_match = self._condition(if_match)
            info = await self.uploader.land(pf, entry, if_match=match, if_none_match=none_match)
        except StoreError as exc:
            await self.workers.disk(self._keep_conflict, entry, str(exc))
            self.journal.leave(pf, "conflict")
            if exc.kind == "precondition":
                log.warning("manifest %r lost a concurrent update: kept under %s, not published",
                            key, self.conflicts_dir)
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
        outcome = await self.barrier.flush(_parent_prefix(key), exclude=frozenset({exclude}))
        if outcome.failed:
            names = ", ".join(f["key"] for f in outcome.failed)
            raise OSError(errno.EIO, f"{key}: not published: the store refused {names}")

    def _condition(self, if_match: str | None) -> tuple[str | None, bool]:
        """(If-Match, If-None-Match: *) for a writer that read `if_match` (None: new)."""
        if not self.conditional:
            return None, False
        return (if_match, False) if if_match else (None, True)

    def _keep_conflict(self, entry: Entry, reason: str) -> None:
        """Keep bytes the store refused, named by hash, with a note; drop them from the cache."""
        self.conflicts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{entry.path.name}"
        os.link(entry.path, self.conflicts_dir / name)
        note = {"key": entry.key, "size": entry.size, "file": name, "reason": reason}
        (self.conflicts_dir / f"{name}.json").write_text(json.dumps(note))
        self.cache.remove(entry.key)


def _parent_prefix(key: str) -> str:
    """The directory subtree a manifest speaks for: 'a/b/.metadata' -> 'a/b/'."""
    head, sep, _ = key.rpartition("/")
    return head + sep
