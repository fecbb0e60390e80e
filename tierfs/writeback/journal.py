"""The files written through this mount and not yet in the store (DESIGN §5).

A file's bytes live in its tier-1 cache file, and its record in the cache
index (dirty, then sealed) is what survives a crash. This is the in-memory
side: one `PendingFile` (pending.py: its state and transitions) per key, from
the first writable open until its bytes landed (or were dropped, or
quarantined), shared by every session writing it, the uploader and the flush
barrier. A rename moves the same record to another key, so a write that races
the rename lands in it.

The namespace reads it as its overlay: a file with local bytes is its own
truth (size, mtime), and shows in listings before it reaches the store.
"""

from __future__ import annotations

import time

import trio

from tierfs.writeback.pending import LANDED, LockWaits, PendingFile


class Journal:
    def __init__(self) -> None:
        self.files: dict[str, PendingFile] = {}
        self._changed = trio.Event()
        self.lock_waits = LockWaits()

    # -- the table ------------------------------------------------------------------

    def get(self, key: str) -> PendingFile | None:
        return self.files.get(key)

    def track(self, key: str, size: int, mtime: float) -> PendingFile:
        """The record of `key`, made if there is none."""
        pf = self.files.get(key)
        if pf is None:
            pf = self.files[key] = PendingFile(key, size, mtime, self.notify, self.lock_waits)
        return pf

    def rekey(self, pf: PendingFile, new: str) -> None:
        """rename: the record (and whoever holds it) follows the file to `new`."""
        if self.files.get(pf.key) is pf:
            del self.files[pf.key]
        pf.renamed(new)
        self.files[new] = pf
        self.notify()

    def landed(self, pf: PendingFile, version: int) -> bool:
        """The store holds `version` of the file; it leaves unless a writer holds it.
        False if it was written since (it stays, as it is)."""
        if not pf.mark_landed(version):
            return False
        if not pf.sessions:
            self.leave(pf, LANDED)
        return True

    def leave(self, pf: PendingFile, outcome: str) -> None:
        """The file is no longer pending (pending.py: the outcomes)."""
        if self.files.get(pf.key) is pf:
            del self.files[pf.key]
        pf.leave(outcome)
        self.notify()

    def under(self, prefix: str) -> list[PendingFile]:
        return [pf for key, pf in self.files.items() if key.startswith(prefix)]

    # -- changes, for the flush barrier ------------------------------------------------

    def notify(self) -> None:
        """Something about a file changed (state, sessions, bytes acknowledged)."""
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def wait_change(self) -> None:
        await self._changed.wait()

    # -- the namespace's overlay --------------------------------------------------------

    def local_file(self, key: str) -> PendingFile | None:
        """The record of `key` if it holds bytes the store does not have."""
        pf = self.files.get(key)
        if pf is None or not pf.local:
            return None
        for s in pf.sessions:  # writes the daemon never saw show in stat
            s.observe()
        return pf

    def local_children(self, prefix: str) -> tuple[dict[str, PendingFile], set[str]]:
        """Local files directly under `prefix`, and sub-directories implied by deeper ones."""
        files: dict[str, PendingFile] = {}
        dirs: set[str] = set()
        for key, pf in self.files.items():
            if not pf.local or not key.startswith(prefix):
                continue
            head, sep, _ = key[len(prefix):].partition("/")
            if sep:
                dirs.add(head)
            elif head:
                files[head] = pf
        return files, dirs

    # -- figures --------------------------------------------------------------------------

    def summary(self, prefix: str = "") -> dict[str, object]:
        now = time.monotonic()
        pending = [pf for pf in self.under(prefix) if pf.sealed]
        oldest = sorted(pending, key=lambda pf: pf.sealed_at or 0.0)
        return {
            "count": len(pending),
            "bytes": sum(pf.size for pf in pending),
            "uploaded_bytes": sum(pf.uploaded for pf in pending),
            "oldest_age_s": max((now - (pf.sealed_at or now) for pf in pending), default=0.0),
            "open_for_write": sum(1 for pf in self.files.values() if pf.sessions),
            "last_errors": [pf.error for pf in pending if pf.error][:5],
            "oldest": [(pf.key, pf.size, pf.upload is not None) for pf in oldest[:5]],
            # waits for a file's lock, all files: any, and while that file uploaded
            "lock_waits": self.lock_waits.total,
            "lock_waits_uploading": self.lock_waits.uploading,
        }
