"""Sparse object files and the Entry handle (DESIGN §4, §5).

An object's bytes live in objects/<fid hex> at the same offsets as in the store;
absent chunks are holes. An Entry is the shared, ref-counted handle of one open
object: a kept-open fd plus an in-memory chunk map (chunkmap.py), so serving a
read is a map check and one preadv, with no LMDB write and no global lock.

An Entry has two faces, one per user: `serve` (serve.py: fill and serve, what
the read path uses) and `local` (local.py: writes and sealing, what the
write-back path uses). This module holds what both share: identity, state,
the fd, the locks, pins, verification of chunks read back, and what the
Cache does with an open entry (uses, eviction's shedding, detaching, the
last release).

Locking, two locks per entry:
- `_mu` guards the in-memory state (chunk map, size, state, mirrored record
  fields) and is only ever held for in-memory work: the trio loop takes it (to
  ask what is missing) and must never wait behind a disk.
- `_io` serializes what changes the entry with I/O: local writes, truncate,
  sealing (fsync, checksums), going dirty (verifying what stays), punching
  chunks out, the index updates of a store, detaching, the last release. The
  loop never takes it. Such a change marks its state under `_mu`, does its I/O
  with `_mu` released, and publishes the result under `_mu`. Checksums a seal
  left to take (`LocalCopy.take_digests`) are hashed from a mapping of the
  file under `_io`, a step of a few chunks at a time (a shrink under a mapping
  is SIGBUS).
Reads and stores pin their chunks under `_mu`, so eviction never punches a
hole under a pread/pwrite; chunks being punched are held back from new stores
(`ChunkMap.discarding`). Lock order: `_io`, an LMDB write transaction, `_mu`,
then Cache._lock (a leaf).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from tierfs.cache.chunkmap import CHECKSUMMED
from tierfs.cache.core import EntryCore, Home
from tierfs.cache.eviction import shed_order
from tierfs.cache.eviction import use as record_use
from tierfs.cache.index import ABSENT, CLEAN, DIRTY, STORED, VERIFIED, Record, WriteTxn
from tierfs.cache.local import LocalCopy
from tierfs.cache.serve import Serving

__all__ = ["Entry", "Home"]


class Entry(EntryCore):
    """The open handle of one cached object, shared by every open of it: the
    shared state (core.py) and two faces, `serve` (read/) and `local` (writeback/)."""

    def __init__(
        self,
        cache: Home,
        kh: bytes,
        rec: Record,
        fd: int,
        states: bytearray,
        *,
        size: int,
        cached: int,
        touch_ns: int | None,
        reused: bool,
        unhashed: bool = False,
    ) -> None:
        super().__init__(cache, kh, rec, fd, states, size=size, cached=cached,
                         touch_ns=touch_ns, reused=reused)
        self.serve = Serving(self)
        self.local = LocalCopy(self, self.serve, unhashed=unhashed)

    # -- used by Cache and eviction ------------------------------------------------

    def _serves(self, etag: str, size: int) -> bool:
        """Whether an open of (etag, size) gets this entry: local data always wins."""
        return self._state != CLEAN or (self.etag == etag and self.size == size)

    def _touch(self, now_ns: int) -> None:
        self._touched = self._reused = True
        self._access_ns = now_ns

    def _shed(self, amount: int) -> int:
        """Give back about `amount` bytes of this open object's chunks (eviction's
        last resort), in `shed_order`, skipping pinned chunks. An entry busy with
        I/O is skipped, never waited for. Returns bytes freed."""
        if not self._io.acquire(blocking=False):
            return 0
        try:
            m = self.map
            with self._mu:
                if self._fd < 0 or self._detached or self._state != CLEAN:
                    return 0
                picked, total = [], 0
                for i in shed_order(m.states, *m.last) if not m.kernel else ():
                    if i not in m.pins:
                        picked.append(i)
                        total += m.chunk_len(i)
                        if total >= amount:
                            break
            return self._discard(picked)
        finally:
            self._io.release()

    def _drop_unpinned(self) -> int:
        """Drop every cached chunk not being read or stored right now (`Cache.evict`)."""
        with self._io:
            with self._mu:
                if self._state != CLEAN or self._fd < 0:
                    return -1
                picked = [i for i, s in enumerate(self.map.states)
                          if s in CHECKSUMMED and not self.map.pinned(i)]
            return self._discard(picked)

    def _detach(self) -> Record | None:
        """Cut this entry loose from the index (removed, or replaced by a newer
        version): holders keep reading what is verified, and writing. Returns the
        dropped record."""
        with self._io:
            with self._mu:
                self._detached = True
                states = self.map.states
                states[:] = states.replace(bytes((STORED,)), bytes((ABSENT,)))
            with self._cache.index.write() as wt:
                rec = wt.record(self._kh)
                if rec is not None and rec.fid == self._fid:
                    wt.drop(self._kh, rec)
                else:
                    rec = None
            with self._mu:
                self._cache.account(wt.used_delta - self._pending)
                self._pending = 0
            return rec

    def _close(self, persist: bool) -> None:
        """Last release: write back the use (eviction order) and dirty growth, close
        the fd, and leave the verified bitmap with the cache for the next open."""
        with self._io:
            if self._fd < 0:
                return
            try:
                if persist and self._unpersisted():
                    self._persist()
            finally:
                with self._mu:
                    fd, self._fd = self._fd, -1
                os.close(fd)
                self.serve._close_direct()
            m = self.map
            if not self._detached and self._state != DIRTY and VERIFIED in m.states:
                self._cache.stash.keep_states(self._fid, m.states)
            if not self._detached and self._state == CLEAN and m.pages:
                self._cache.stash.keep_pages(self._fid, m.pages)

    def _persist(self) -> None:
        with self._cache.index.write() as wt:
            self._persist_in(wt)
        self._cache.account(wt.used_delta)
        self._persisted()

    def _unpersisted(self) -> bool:
        """A use or dirty growth of this open entry that its record lacks."""
        return self._fd >= 0 and not self._detached and (self._touched or bool(self._pending))

    def _persist_in(self, wt: WriteTxn) -> None:
        now = time.time_ns()  # a use lasts until its last release
        rec = self._record(wt)
        if self._state == CLEAN:
            record_use(wt, self._kh, rec, access_ns=now, reused=self._reused,
                       capacity=self._cache.capacity)
        else:
            wt.put(self._kh, rec, replace(rec, size=self.size, cached=self._cached, access_ns=now))

    def _persisted(self) -> None:
        """The record written by `_persist_in` is committed (and its used_delta
        accounted): the dirty growth it carried is no longer pending."""
        with self._mu:
            self._cache.account(-self._pending)
            self._pending = 0
        self._touched = False
