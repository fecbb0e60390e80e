"""A file written through this mount, from its first writable open until its
bytes landed (or were dropped, or kept aside): one explicit state and the
transitions between them, in this module only (DESIGN §5).

    STORED ──write──> WRITTEN ──close/fsync──> SEALED ──upload landed──> STORED
       ^                 ^  │                    │  │
       └───restored──────┼──┘ (a clean object   │  └──write-through close failed──> UNSAVED
                         │     made a local      │                                    │
                         └─────write again───────┴────────────────────────────────────┘
    any state ──unlink, rename over, drop, refuse, conflict, landed and closed──> GONE

Each state is the in-memory side of the file's tier-1 record (`record`):
WRITTEN is a dirty record, SEALED and UNSAVED a sealed one, STORED a clean
one (or none yet). The write path changes the record and the state together,
under the file's lock; a transition here never does I/O.

`version` numbers the file's versions (each write after a seal, or after it
landed, begins one): an upload or a publish that ran outside the lock checks
it after, and lands nothing it did not read; a flush waits for the version
closed when it began.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import trio

from tierfs.posix import Attrs


class FileState(enum.Enum):
    STORED = "stored"  # nothing here the store lacks (open for writing, unwritten; or landed)
    WRITTEN = "written"  # bytes changed since its last seal
    SEALED = "sealed"  # closed or fsynced: journaled here, its upload due
    UNSAVED = "unsaved"  # sealed by a close that failed to upload or publish: never lands as is
    GONE = "gone"  # left the journal (`PendingFile.outcome` says why)

    @property
    def record(self) -> str | None:
        """The tier-1 record state that goes with it (Entry.state); None: any."""
        return _RECORD[self]


_RECORD = {FileState.STORED: "clean", FileState.WRITTEN: "dirty", FileState.SEALED: "sealed",
           FileState.UNSAVED: "sealed", FileState.GONE: None}

# Why a file left the journal (PendingFile.outcome).
LANDED = "landed"  # in the store (or never changed here)
REFUSED = "refused"  # quarantined: the store refused it, or its local copy is damaged
DROPPED = "dropped"  # its close failed: never acknowledged
UNLINKED = "unlinked"
REPLACED = "replaced"  # renamed over
DISCARDED = "discarded"  # by request (tierfs pending discard)
CONFLICT = "conflict"  # a manifest that lost its race
DETACHED = frozenset({UNLINKED, REPLACED})  # lives on in its open descriptors only


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


@dataclass
class LockWaits:
    """How often a file's lock was waited for (all files of a mount): `total`, and
    `uploading`: while an upload of that file was in flight, which only its own
    state changes may wait for (tests and bench/lockwaits.py read these)."""

    total: int = 0
    uploading: int = 0


class FileLock:
    """A file's lock (a trio lock) that counts the waits for it."""

    def __init__(self, pf: PendingFile, waits: LockWaits) -> None:
        self._pf = pf
        self._lock = trio.Lock()
        self._mount = waits  # all files'
        self.waits = LockWaits()  # this file's

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        if self._lock.locked():
            for w in (self._mount, self.waits):
                w.total += 1
                if self._pf.upload is not None:
                    w.uploading += 1
        await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class BadTransition(RuntimeError):
    """A transition the state machine does not have: a bug of the write path."""


Waits = list[tuple["PendingFile", int]]  # files waited for, at the version seen


class PendingFile:
    """One file open for writing or holding bytes the store does not have yet.
    Its attributes are read by anyone; they change through its methods only."""

    def __init__(self, key: str, size: int, mtime: float, changed: Callable[[], None],
                 waits: LockWaits) -> None:
        self._changed = changed  # the journal's notification (barriers wait on it)
        self.key = key
        self.state = FileState.STORED
        self.outcome: str | None = None  # why it left the journal (GONE)
        self.gone = trio.Event()
        self.size = size
        # The time of the last change of its bytes, in nanoseconds (stat and the
        # stored `mtime` show it exactly: a float of seconds cannot hold them).
        self.mtime_ns = round(mtime * 1e9)
        # POSIX attributes to store with the object (None: unknown, only the mtime
        # is stored); a write moves their mtime and ctime (`touched`).
        self.attrs: Attrs | None = None
        self.attrs_set = 0  # chmod/chown/utimens calls (an upload begun before one lacks it)
        # Created here under a name the store had no object for, and no upload of it
        # ever began: a rename of it need not DELETE its old name in the store (a
        # round trip in os.replace's time: 0.04-0.28 s while a checkpoint uploads).
        self.fresh = False
        self.sealed_at: float | None = None  # monotonic; set while sealed
        self.version = 0  # bumped whenever it is written again after a seal or a landing
        self.landed_version = -1  # the version last seen in the store
        self.sessions: set[Writer] = set()  # writable handles open on it
        self._writing = 0  # writes applying their bytes, with the lock let go
        self._written = trio.Event()
        # One change of this file's state at a time (never held across network I/O).
        self.lock = FileLock(self, waits)
        # The background upload running (uploader.py): its cancel scope, its end.
        self.upload: trio.CancelScope | None = None
        self.upload_cancellable = True  # False: a close's own upload (writers wait for it)
        self.upload_ended = trio.Event()
        self.uploaded = 0  # bytes the store acknowledged in the current attempt
        self.error: str | None = None  # the last upload failure, for status
        self.nudged = trio.Event()  # `tierfs pending retry`: end a backoff now
        # A manifest published in the background (publish.py): the uploads it
        # waits for, the condition of its PUT, the id of its journaled barrier.
        self.barrier: Waits | None = None
        self.condition: Condition | None = None
        self.record: str | None = None
        # Being renamed onto a manifest name or with its directory (rename.py): that
        # rename hands it over once done, not a release meanwhile.
        self.moving = False

    # -- what it is ---------------------------------------------------------------------

    @property
    def mtime(self) -> float:
        return self.mtime_ns / 1e9

    @property
    def local(self) -> bool:
        """Holds bytes the store does not have."""
        return self.state in (FileState.WRITTEN, FileState.SEALED, FileState.UNSAVED)

    @property
    def sealed(self) -> bool:
        return self.state in (FileState.SEALED, FileState.UNSAVED)

    @property
    def unlinked(self) -> bool:
        """Removed (or renamed over) while open: lives on in its sessions only."""
        return self.outcome in DETACHED

    def describe(self) -> dict[str, object]:
        state = ("uploading" if self.upload is not None else "sealed") if self.sealed else (
            "open" if self.sessions else "written")
        return {"key": self.key, "size": self.size, "state": state, "uploaded": self.uploaded,
                "error": self.error, "open": len(self.sessions)}

    # -- transitions ----------------------------------------------------------------------

    def _to(self, state: FileState, *allowed: FileState) -> None:
        if self.state not in allowed:
            raise BadTransition(f"{self.key!r}: {self.state.value} -> {state.value}")
        self.state = state
        self._changed()

    def mark_written(self) -> None:
        """Its bytes change (the record turns dirty): a new version begins. Every
        version gets its own number, also one written after the last landed while
        a writer held the file: a flush waiting for it must not take the landing
        of the one before for its own."""
        if self.state is FileState.GONE:
            return  # an unlinked file's descriptors write on; nothing of it is kept
        if self.state is not FileState.WRITTEN:
            self.version += 1
        self.sealed_at = None
        self._to(FileState.WRITTEN, FileState.STORED, FileState.WRITTEN, FileState.SEALED,
                 FileState.UNSAVED)

    def mark_sealed(self, size: int) -> None:
        """Closed or fsynced (the record is sealed): journaled, its upload due."""
        self.size = size
        self.sealed_at = time.monotonic()
        self._to(FileState.SEALED, FileState.WRITTEN, FileState.SEALED, FileState.UNSAVED)

    def mark_resumed(self, size: int) -> None:
        """A sealed record found after a restart, or put back from quarantine."""
        self.size = size
        self.sealed_at = time.monotonic()
        self._to(FileState.SEALED, FileState.STORED)

    def mark_unsaved(self) -> None:
        """Its write-through close (or waited-for publish) failed: it must never land
        as it is, and goes at its last release unless written and closed again."""
        self._to(FileState.UNSAVED, FileState.SEALED, FileState.UNSAVED)

    def mark_landed(self, version: int) -> bool:
        """The store holds `version` of it. False (no change) if it was written since."""
        if self.state is not FileState.SEALED or self.version != version:
            return False
        self.sealed_at = None
        self.error = None
        self.landed_version = version
        self._to(FileState.STORED, FileState.SEALED)
        return True

    def mark_restored(self) -> None:
        """A clean object made a local write at open, never changed: clean again."""
        self.landed_version = self.version
        self._to(FileState.STORED, FileState.WRITTEN)

    def leave(self, outcome: str) -> None:
        """It is no longer pending (the journal drops it)."""
        if self.state is FileState.GONE:
            return
        self.outcome = outcome
        self.sealed_at = None
        self.gone.set()
        self._to(FileState.GONE, *FileState)

    # -- its bytes and attributes -----------------------------------------------------------

    def touched(self, size: int, mtime_ns: int | None = None) -> None:
        """Its bytes or size changed (now, or at `mtime_ns`): mtime and ctime move."""
        self.size = size
        self.mtime_ns = time.time_ns() if mtime_ns is None else mtime_ns
        if self.attrs is not None:
            self.attrs = replace(self.attrs, mtime_ns=self.mtime_ns, ctime_ns=self.mtime_ns)

    def set_attrs(self, attrs: Attrs) -> None:
        """chmod, chown, utimens of it: its attributes, their mtime its mtime."""
        self.attrs = attrs
        self.mtime_ns = attrs.mtime_ns
        self.attrs_set += 1

    def take_attrs(self, attrs: Attrs | None, *, unless_known: bool = False) -> None:
        """The attributes it was created or opened with (`unless_known`: kept if set)."""
        if not (unless_known and self.attrs is not None):
            self.attrs = attrs

    def set_fresh(self, fresh: bool) -> None:
        self.fresh = fresh

    def renamed(self, key: str) -> None:
        """(the journal's) It goes by `key` now; the store may hold an object there."""
        self.key = key
        self.fresh = False

    # -- its writers ------------------------------------------------------------------------

    def opened(self, session: Writer) -> None:
        self.sessions.add(session)
        self._changed()

    def released(self, session: Writer) -> None:
        self.sessions.discard(session)
        self._changed()

    def write_began(self) -> None:
        """(holding the lock) A write applies its bytes from now on, without it."""
        self._writing += 1

    def write_ended(self) -> None:
        self._writing -= 1
        if not self._writing:
            self._written.set()
            self._written = trio.Event()

    async def writes_done(self) -> None:
        """(holding the lock) Until every write that began has applied its bytes: a
        seal or a truncate sees them all, and no new one begins meanwhile."""
        while self._writing:
            await self._written.wait()

    def begin_move(self) -> None:
        self.moving = True

    def end_move(self) -> None:
        self.moving = False

    # -- its upload (uploader.py) ------------------------------------------------------------

    def upload_began(self, scope: trio.CancelScope, *, cancellable: bool = True) -> None:
        self.upload, self.upload_ended = scope, trio.Event()
        self.upload_cancellable = cancellable
        self.uploaded = 0

    def upload_finished(self) -> None:
        self.upload = None
        self.upload_ended.set()
        self._changed()

    def acknowledged(self, n: int) -> None:
        """The store took `n` more bytes of the upload running."""
        self.uploaded += n
        self._changed()

    def acknowledged_elsewhere(self, n: int) -> None:
        """`acknowledged` from a transfer engine's thread: the count only (the
        journal hears of it when the upload returns)."""
        self.uploaded += n

    def upload_uncancellable(self) -> None:
        """The upload running cannot stop midway any more: writers wait for it."""
        self.upload_cancellable = False

    def upload_failed(self, error: str) -> None:
        self.error = error

    def sending(self) -> None:
        """An upload of it begins: its key may hold an object from here on."""
        self.fresh = False
        self.uploaded = 0

    def nudge(self) -> None:
        self.nudged.set()

    def new_nudge(self) -> trio.Event:
        self.nudged = trio.Event()
        return self.nudged

    # -- a manifest's publish (publish.py) -----------------------------------------------------

    def set_condition(self, condition: Condition | None) -> None:
        self.condition = condition

    def barrier_journaled(self, waits: Waits, record: str | None, condition: Condition) -> None:
        """Its barrier and condition are fsynced here; a later seal keeps the first
        condition (the version its writer read)."""
        self.barrier, self.record = waits, record
        if self.condition is None:
            self.condition = condition

    def barrier_passed(self) -> None:
        self.barrier = None

    def not_a_manifest(self) -> None:
        """Renamed away from a manifest name: it uploads as any file."""
        self.barrier = self.condition = None
