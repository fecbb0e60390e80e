"""A whole object's new tier-1 file, filled with no entry open (`Cache.whole_fill`).

A small object fetched ahead of its reader (a walk through a directory of
them) goes into a file of its own, written by its fetcher (`WholeFill.fd`,
from any thread: a transfer engine's included), then committed: its record
and chunk checksums with one index transaction, its chunks marked verified
for its next open. Not a use for eviction. The file is nobody's until the
commit (a fresh name), so the key is not held while the bytes arrive; the
commit refuses it (`kept` False, the file dropped) where tier 1 has this
version already, holds a local one, or the key is open (its holder fetches
what it lacks). One transaction instead of the three of open, store and
release: index commits were a sixth of the daemon's CPU in a walk through
10,000 small objects (issue 21).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from tierfs.cache.chunkmap import nchunks
from tierfs.cache.fileio import file_digests
from tierfs.cache.index import CLEAN, PROBATION, VERIFIED, Record, key_hash
from tierfs.cache.loading import Loading, new_fid


class WholeHome(Loading, Protocol):
    """The Cache, as a whole fill sees it (cache/__init__.py)."""

    def _try_claim(self, kh: bytes) -> bool: ...

    def _unclaim(self, kh: bytes) -> None: ...


class WholeFill:
    """A whole object's new tier-1 file, being written by its fetcher."""

    def __init__(self, cache: WholeHome, fd: int, fid: bytes,
                 identity: tuple[str, str, float, int]) -> None:
        self.fd = fd
        self.start = 0
        self.end = identity[3]
        self.fid = fid
        self.kept = False
        self._identity = identity  # key, etag, mtime, size
        self._cache = cache

    def commit(self, digests: Sequence[bytes] | None = None) -> None:
        """The whole object is written: keep it, with its xxh3-64 checksums per chunk
        in order (None: read back and taken here), unless refused: `kept` says."""
        c = self._cache
        key, etag, mtime, size = self._identity
        if digests is None:
            digests = list(file_digests(self.fd, 0, size, c.chunk_size))
        if len(digests) != nchunks(size, c.chunk_size):
            raise ValueError(f"{len(digests)} checksums for {nchunks(size, c.chunk_size)} chunks of {key!r}")
        kh = key_hash(key)
        if not c._try_claim(kh):
            return
        try:
            rec = c.index.record(kh)
            if rec is not None:
                if rec.state != CLEAN or (rec.etag, rec.size, rec.cached) == (etag, size, size):
                    return
                c._drop(kh)  # an older version, or a part of this one
            now = time.time_ns()
            rec = Record(self.fid, key, etag, size, mtime, size, now, now, CLEAN, PROBATION)
            with c.index.write() as wt:
                wt.put(kh, None, rec)
                wt.put_chunks(self.fid, 0, digests)
            c.account(wt.used_delta)
            c.stash.keep_states(self.fid, bytearray((VERIFIED,)) * len(digests))
            self.kept = True
        finally:
            c._unclaim(kh)


@contextmanager
def whole_fill(cache: WholeHome, key: str, etag: str, mtime: float, size: int) -> Iterator[WholeFill]:
    """The new file of a whole clean object (see the module docstring)."""
    assert cache._identity is not None
    fid = new_fid(cache._identity, key, etag)
    name = cache._objects + fid.hex()
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    fill = WholeFill(cache, fd, fid, (key, etag, mtime, size))
    try:
        yield fill
    finally:
        os.close(fd)
        if not fill.kept:
            os.unlink(name)
