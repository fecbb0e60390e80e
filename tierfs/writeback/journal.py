"""The files written through this mount and not yet in the store (DESIGN §5).

A file's bytes live in its tier-1 cache file, and its record in the cache
index (dirty, then sealed) is what survives a crash. This is the in-memory
side: one `PendingFile` per key, from the first writable open until its
bytes landed (or were dropped, or quarantined), shared by every session
writing it, the uploader and the flush barrier. A rename moves the same
record to another key, so a write that races the rename lands in it.

The namespace reads it as its overlay: a file with local bytes is its own
truth (size, mtime), and shows in listings before it reaches the store.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple, Protocol

import trio

from tierfs.posix import Attrs


class Writer(Protocol):
    """What the journal knows of a session writing a file (session.py)."""

    closed: bool  # close(2) reached the daemon (FLUSH): its RELEASE follows

    def observe(self) -> None:
        """A writer the kernel serves itself (passthrough): take the file's size
        and mtime from the file (no-op for others)."""


class Condition(NamedTuple):
    """A conditional PUT: If-Match an ETag, or If-None-Match: * (a new object)."""

    if_match: str | None
    if_none_match: bool


class PendingFile:
    """One file open for writing or holding bytes the store does not have yet."""

    def __init__(self, key: str, size: int, mtime: float) -> None:
        self.key = key
        self.size = size
        # The time of the last change of its bytes, in nanoseconds (stat and the
        # stored `mtime` show it exactly: a float of seconds cannot hold them).
        self.mtime_ns = round(mtime * 1e9)
        # POSIX attributes to store with the object (None: unknown, only the mtime
        # is stored); a write moves their mtime and ctime (`written`).
        self.attrs: Attrs | None = None
        self.attrs_set = 0  # chmod/chown/utimens calls (an upload begun before one lacks it)
        self.local = False  # holds bytes the store does not have (written, not landed)
        # Created here under a name the store had no object for, and no upload of it
        # ever began: a rename of it need not DELETE its old name in the store (a
        # round trip in os.replace's time: 0.04-0.28 s while a checkpoint uploads).
        self.fresh = False
        self.sealed_at: float | None = None  # monotonic; set while journaled, upload due
        self.version = 0  # bumped whenever a sealed file is written again
        self.landed_version = -1  # the version last seen in the store
        self.sessions: set[Writer] = set()  # writable handles open on it
        self.lock = trio.Lock()  # one write-side change of this file at a time
        self.upload: trio.CancelScope | None = None  # the background upload running
        self.upload_ended = trio.Event()
        self.uploaded = 0  # bytes the store acknowledged in the current attempt
        self.error: str | None = None  # the last upload failure, for status
        self.nudged = trio.Event()  # `tierfs pending retry`: end a backoff now
        self.through_failed = False  # a write-through close failed: it may never land
        self.unlinked = False  # removed while open: lives on in its sessions only
        self.outcome: str | None = None  # why it left the journal (see Journal.leave)
        self.gone = trio.Event()
        # A manifest published in the background (publish.py): the uploads it
        # waits for, and the condition of its PUT once they landed.
        self.barrier: list[tuple[PendingFile, int]] | None = None
        self.condition: Condition | None = None
        self.record: str | None = None  # the id of its journaled barrier (publish.Records)
        # Being renamed onto a manifest name (core.publish_rename): that rename hands
        # it over once its barrier is journaled, not a release meanwhile.
        self.renaming = False

    @property
    def mtime(self) -> float:
        return self.mtime_ns / 1e9

    def written(self, now_ns: int | None = None) -> None:
        """Its bytes (or size) changed now: mtime and ctime move (POSIX write, truncate)."""
        self.mtime_ns = time.time_ns() if now_ns is None else now_ns
        if self.attrs is not None:
            self.attrs = replace(self.attrs, mtime_ns=self.mtime_ns, ctime_ns=self.mtime_ns)

    def set_attrs(self, attrs: Attrs) -> None:
        """chmod, chown, utimens of it: its attributes, their mtime its mtime."""
        self.attrs = attrs
        self.mtime_ns = attrs.mtime_ns
        self.attrs_set += 1

    @property
    def sealed(self) -> bool:
        return self.sealed_at is not None

    def describe(self) -> dict[str, object]:
        state = ("uploading" if self.upload is not None else "sealed") if self.sealed else (
            "open" if self.sessions else "written")
        return {"key": self.key, "size": self.size, "state": state, "uploaded": self.uploaded,
                "error": self.error, "open": len(self.sessions)}


class Journal:
    def __init__(self) -> None:
        self.files: dict[str, PendingFile] = {}
        self._changed = trio.Event()

    # -- the table ------------------------------------------------------------------

    def get(self, key: str) -> PendingFile | None:
        return self.files.get(key)

    def track(self, key: str, size: int, mtime: float) -> PendingFile:
        """The record of `key`, made if there is none."""
        pf = self.files.get(key)
        if pf is None:
            pf = self.files[key] = PendingFile(key, size, mtime)
        return pf

    def rekey(self, pf: PendingFile, new: str) -> None:
        """rename: the record (and whoever holds it) follows the file to `new`."""
        if self.files.get(pf.key) is pf:
            del self.files[pf.key]
        pf.key = new
        pf.fresh = False  # the store may hold an object under its new name
        self.files[new] = pf
        self.notify()

    def landed(self, pf: PendingFile) -> None:
        """The store holds the file's bytes now; it leaves unless a writer holds it."""
        pf.sealed_at = None
        pf.local = False
        pf.error = None
        pf.landed_version = pf.version
        if pf.sessions:
            self.notify()
        else:
            self.leave(pf, "landed")

    def leave(self, pf: PendingFile, outcome: str) -> None:
        """The file is no longer pending: "landed" (in the store, or never changed),
        "refused" (quarantined: the store refused it), "dropped" (its close
        failed: never acknowledged), "unlinked", "replaced" (renamed over),
        "discarded" (by request), "conflict" (a manifest that lost its race)."""
        if self.files.get(pf.key) is pf:
            del self.files[pf.key]
        pf.outcome = outcome
        pf.local = False
        pf.gone.set()
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
        }
