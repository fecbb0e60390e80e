"""Files kept aside, never uploaded as they are (DESIGN §5): <cache>/quarantine/.

Each kept file is `<stamp>-<cache file name>` with a `.json` note beside it:
key, size, file, when, kind and reason. Kinds:
- "never_closed": written but never closed before the daemon stopped; its
  writer was never told it was saved;
- "unfinished": sealed, but a close that was still waiting for the store
  (write-through, manifest publish) never returned before the daemon stopped;
- "refused": closed and acknowledged, then refused by the store for good
  (AccessDenied, KeyTooLong, ...): the one kind flush and umount report as a
  failure, until it is retried or discarded (`tierfs pending`).
The notes live on disk, so they are reported across restarts. All calls
block (run them in a disk worker).

Manifests whose conditional PUT lost a race are kept apart, under
<cache>/conflicts/ (`Conflicts`): the bytes and a note. A writer that waited
for its publish got ESTALE; one published in the background was not told,
so its note has kind "conflict", which flush and umount report as a failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tierfs.cache import Cache, Entry

log = logging.getLogger(__name__)

REFUSED = "refused"
CONFLICT = "conflict"  # a background publish lost its race (publish.py keeps the bytes)
DAMAGED = "damaged"  # its tier-1 bytes no longer match the checksums taken at its seal
# Closed without fsync, then the machine restarted before its checksums were taken
# (Cache.finish_seal): nothing can tell a torn copy from a whole one.
UNCHECKED = "unchecked"
FAILED_KINDS = frozenset({REFUSED, CONFLICT, DAMAGED, UNCHECKED})  # what flush and umount report as failures
COPY_PIECE = 1 << 20  # bytes per write when a kept file goes back into the cache


@dataclass(frozen=True)
class Note:
    key: str
    size: int
    file: str  # name under the quarantine dir
    when: str  # local time it was kept, YYYYmmddTHHMMSS
    kind: str
    reason: str


class Quarantine:
    def __init__(self, root: Path, cache: Cache) -> None:
        self.root = root
        self.cache = cache

    def keep(self, key: str, kind: str, reason: str) -> Note | None:
        """Move the cache file of `key` here with a note, and forget it in the cache.
        None if the cache holds nothing for `key`."""
        entry = self.cache.open_existing(key)
        if entry is None:
            return None
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            note = Note(key, entry.size, f"{stamp}-{entry.path.name}", stamp, kind, reason)
            os.link(entry.path, self.root / note.file)
            # private like the cache files (the daemon's umask may be 022)
            fd = os.open(self.root / f"{note.file}.json",
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "w") as f:
                f.write(json.dumps(asdict(note)))
        finally:
            self.cache.release(entry)
        self.cache.remove(key)
        log.warning("quarantined %r (%d bytes): %s; kept at %s", key, note.size, reason,
                    self.root / note.file)
        return note

    def notes(self) -> list[Note]:
        """Every kept file, oldest first."""
        return _read_notes(self.root)

    def find(self, key: str) -> Note | None:
        """The newest note of `key`."""
        found = [n for n in self.notes() if n.key == key]
        return found[-1] if found else None

    def discard(self, note: Note) -> None:
        _discard(self.root, note)

    def restore(self, note: Note) -> Entry:
        """Copy a kept file back into the cache as a sealed object (for a retry) and
        drop it from here; the returned entry is open (release it). ValueError if
        the cache holds another version of the key by now."""
        if self.cache.lookup(note.key) is not None:
            raise ValueError(f"{note.key}: a newer file of that name exists; discard this one")
        entry = self.cache.open(note.key, "", 0, time.time())
        try:
            entry.local.truncate(0)
            with open(self.root / note.file, "rb") as src:
                off = 0
                while piece := src.read(COPY_PIECE):
                    entry.local.write(off, piece)
                    off += len(piece)
            entry.local.seal()
        except BaseException:
            self.cache.release(entry)
            self.cache.remove(note.key)
            raise
        self.discard(note)
        return entry


class Conflicts:
    """Manifests the store refused because another writer changed them first."""

    def __init__(self, root: Path, cache: Cache) -> None:
        self.root = root
        self.cache = cache

    def keep(self, entry: Entry, reason: str, *, told: bool) -> Note:
        """Keep `entry`'s bytes with a note and drop them from the cache. `told`:
        its writer got the error (ESTALE); otherwise flush reports it."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        note = Note(entry.key, entry.size, f"{stamp}-{entry.path.name}", stamp,
                    "estale" if told else CONFLICT, reason)
        os.link(entry.path, self.root / note.file)
        (self.root / f"{note.file}.json").write_text(json.dumps(asdict(note)))
        self.cache.remove(entry.key)
        return note

    def notes(self) -> list[Note]:
        """The conflicts nobody was told of, oldest first."""
        return [n for n in _read_notes(self.root) if n.kind == CONFLICT]

    def find(self, key: str) -> Note | None:
        found = [n for n in self.notes() if n.key == key]
        return found[-1] if found else None

    def discard(self, note: Note) -> None:
        _discard(self.root, note)


def _read_notes(root: Path) -> list[Note]:
    out = []
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            raw = json.loads((root / name).read_text())
            out.append(Note(raw["key"], int(raw["size"]), raw["file"], raw.get("when", ""),
                            raw.get("kind", "never_closed"), raw["reason"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable note %s: %s", root / name, exc)
    return out


def _discard(root: Path, note: Note) -> None:
    for name in (note.file, f"{note.file}.json"):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
    log.info("discarded kept %r (%s)", note.key, root / note.file)
