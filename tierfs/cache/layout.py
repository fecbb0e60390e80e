"""The cache dir on disk: created 0700, locked by the one process using it, able
to hold sparse files, and its index opened at a format this tierfs writes.

  lock          flock()ed by the one process using the dir
  index.lmdb/   records, chunk checksums, eviction order (index.py)
  objects/<fid> one sparse file per object, same offsets as in the store (objects.py)
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from pathlib import Path

import lmdb

from tierfs.cache.index import FORMAT_VERSION, Index
from tierfs.cache.space import punch_hole

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class CacheBusy(Exception):
    """Another process holds the cache dir."""


class CacheUnwritable(Exception):
    """The cache dir cannot be created or written; the message is one line."""


class CacheConflict(Exception):
    """The cache dir belongs to another source and still holds its pending uploads."""


def this_boot() -> bytes:
    """This boot of the machine. Unknown: a fresh value, so every restart of the
    daemon counts as one of the machine (the safe side)."""
    try:
        return uuid.UUID(BOOT_ID.read_text().strip()).bytes
    except (OSError, ValueError):
        return os.urandom(16)


def take_dir(root: Path, objects_dir: Path) -> int:
    """Create the dir 0700, take its lock, probe that it can hold sparse files; the
    lock's fd."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        objects_dir.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise CacheUnwritable(f"cache dir {root} is not writable: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheBusy(f"cache dir {root} is in use by another tierfs process") from None
    except OSError as e:
        os.close(fd)
        raise CacheUnwritable(f"cache dir {root} cannot be locked: {e.strerror}") from None
    probe = objects_dir / ".probe"
    try:
        pfd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(pfd, b"\0" * 8192, 0)
            punch_hole(pfd, 0, 4096)
        finally:
            os.close(pfd)
            probe.unlink()
    except OSError as e:
        os.close(fd)
        if e.errno == errno.EOPNOTSUPP:
            raise CacheUnwritable(
                f"cache dir {root}: its filesystem cannot punch holes (sparse files needed)"
            ) from None
        raise CacheUnwritable(f"cache dir {root} is not writable: {e.strerror}") from None
    return fd


def open_index(root: Path, chunk_size: int) -> tuple[Index, int, str | None]:
    """The dir's index, the chunk size it was made with (a new one takes
    `chunk_size`) and the source it belongs to (None: none yet)."""
    try:
        index = Index(root / "index.lmdb")
    except (OSError, lmdb.Error) as e:
        raise CacheUnwritable(f"cache dir {root}: cannot open index.lmdb: {e}") from None
    try:
        with index.write() as wt:
            if wt.meta(b"version") is None:
                wt.set_meta(b"version", FORMAT_VERSION.to_bytes(4, "big"))
                wt.set_meta(b"chunk_size", chunk_size.to_bytes(8, "big"))
            version = int.from_bytes(wt.meta(b"version") or b"", "big")
            made_with = int.from_bytes(wt.meta(b"chunk_size") or b"", "big")
            identity = wt.meta(b"identity")
        if version != FORMAT_VERSION:
            raise CacheUnwritable(
                f"cache dir {root}: index format {version} is not supported "
                f"(this tierfs writes {FORMAT_VERSION}); move the directory away"
            )
    except BaseException as e:
        index.close()
        if isinstance(e, OSError):
            raise CacheUnwritable(f"cache dir {root} is not writable: {e.strerror}") from None
        raise
    return index, made_with, None if identity is None else identity.decode()
