"""What an open Entry's two faces share (objects.py has the Entry): identity,
state, the fd, the locks, the chunk map, claims of chunks for fetched bytes,
checking chunks read back against their checksums, and punching chunks out.
See objects.py for the locking rules.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import xxhash

from tierfs.cache.chunkmap import CHECKSUMMED, ChunkMap
from tierfs.cache.fileio import pread_full, runs
from tierfs.cache.index import ABSENT, CLEAN, STATE_NAMES, CachedObject, Index, Record, WriteTxn
from tierfs.cache.space import punch_hole
from tierfs.cache.stash import Stash


class Home(Protocol):
    """What an Entry needs of the Cache holding it (cache/__init__.py)."""

    chunk_size: int
    capacity: int
    objects_dir: Path
    index: Index
    boot_id: bytes  # this machine's boot (an unhashed seal is trusted within it)
    stash: Stash  # what closed objects leave for their next open

    def account(self, delta: int, filled: EntryCore | None = None) -> None: ...

    def count_corrupt(self, n: int) -> None: ...


class EntryCore:
    """The state of one open cached object that its faces share.

    Public, read-only for callers: key, etag, size, mtime, path, chunk_size, state.
    """

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
    ) -> None:
        self.key = rec.key
        self.etag = rec.etag
        self.mtime = rec.mtime
        self.chunk_size = cache.chunk_size
        self._cache = cache
        self._kh = kh
        self._fid = rec.fid
        self._fd = fd
        self._mu = threading.Lock()  # in-memory state only (see the module docstring)
        self._io = threading.Lock()  # changes that do I/O; never taken on the trio loop
        self.map = ChunkMap(cache.chunk_size, size, states, cache.stash.take_pages(rec.fid))
        self._storing = 0  # stores in flight: going dirty waits for them
        self._dirtying = 0  # going dirty: no new store may start meanwhile
        self._stores_done = threading.Condition(self._mu)
        self._discards_done = threading.Condition(self._mu)
        self._refs = 1
        self._state = rec.state
        self._cached = cached  # bytes held: the record's count plus `_pending`
        self._pending = 0  # dirty growth not yet written to the record
        self._detached = False  # removed or replaced while open: private to its holders
        self._touched = touch_ns is not None  # opened as a use (counts for eviction)
        self._reused = reused
        self._access_ns = rec.access_ns if touch_ns is None else touch_ns

    @property
    def size(self) -> int:
        return self.map.size

    @property
    def state(self) -> str:
        return STATE_NAMES[self._state]

    @property
    def detached(self) -> bool:
        """Removed from the cache while open (unlinked, or replaced by a newer
        version): still usable by its holders, never uploaded or kept."""
        return self._detached

    @property
    def closed(self) -> bool:
        """Released by its last holder: nobody reads it any more."""
        return self._fd < 0

    @property
    def path(self) -> Path:
        """The tier-1 file (quarantine.py links it); not kept: opens make thousands."""
        return self._cache.objects_dir / self._fid.hex()

    @contextmanager
    def holding(self, start: int, end: int) -> Iterator[None]:
        """Keep eviction off the chunks of [start, end) meanwhile (in-memory pins,
        no I/O): a read holds what it waits for, so the fetch of one of its
        chunks can never shed another it fetched a moment before."""
        with self._mu:
            lo, hi = self.map.chunks_of(start, end)
            self.map.pin(lo, hi)
        try:
            yield
        finally:
            with self._mu:
                self.map.unpin(lo, hi)

    def describe(self) -> CachedObject:
        with self._mu:
            return CachedObject(self.key, self.etag, self.size, self.mtime, self._cached,
                                self._access_ns / 1e9, STATE_NAMES[self._state])

    # -- shared by the faces -----------------------------------------------------

    def _begin_store(self, lo: int, hi: int, what: str) -> None:
        """Claim chunks lo..hi for fetched bytes: only a clean entry takes them, and
        the chunks stay pinned (and dirtying waits) until the store is done. Chunks
        being punched out are waited for (a punch must not land after the bytes)."""
        with self._mu:
            while True:
                self._check_usable()
                if self._state != CLEAN or self._dirtying:
                    raise ValueError(f"{what}() into {self.state} {self.key!r}: it is written locally")
                if not any(i in self.map.discarding for i in range(lo, hi + 1)):
                    break
                self._discards_done.wait()
            self.map.pin(lo, hi)
            self._storing += 1

    def _end_store(self, lo: int, hi: int) -> None:
        with self._mu:
            self.map.unpin(lo, hi)
            self._storing -= 1
            if not self._storing:
                self._stores_done.notify_all()

    def _bad_chunks(self, indexes: list[int]) -> list[int]:
        """Read whole chunks back from the file and compare with their checksums."""
        if not indexes:
            return []
        want = self._digests(indexes)
        cs, m = self.chunk_size, self.map
        return [i for i in indexes
                if want.get(i) != xxhash.xxh3_64_digest(pread_full(self._fd, m.chunk_len(i), i * cs))]

    def _digests(self, indexes: list[int]) -> dict[int, bytes]:
        """Recorded checksums. A detached entry's records are gone (its flag is set
        before they go): its unverified chunks count as missing, not as corrupt."""
        want = self._cache.index.digests(self._fid, indexes)
        if len(want) < len(indexes) and self._detached:
            raise KeyError(f"{self.key!r}: chunks dropped from the cache while being read")
        return want

    def _drop_corrupt(self, bad: list[int]) -> None:
        with self._io:
            if self._fd >= 0:
                with self._mu:
                    picked = [i for i in set(bad) if self.map.states[i] in CHECKSUMMED]
                self._discard(picked, pinned_too=True)
        self._cache.count_corrupt(len(set(bad)))

    def _discard(self, indexes: list[int], *, pinned_too: bool = False) -> int:
        """Punch chunks out of the file, then forget them (caller holds `_io`). They are
        absent from the moment they are picked (no new reader pins them) and held back
        from new stores until punched; a pinned one is skipped unless `pinned_too`
        (corrupt data: its readers find out by their own check). A crash between the
        punch and the index update leaves records of zeroed chunks: verification
        catches them."""
        m = self.map
        with self._mu:
            picked = [i for i in set(indexes)
                      if m.states[i] in CHECKSUMMED and (pinned_too or not m.pinned(i))]
            if not picked:
                return 0
            for i in picked:
                m.states[i] = ABSENT
            m.discarding.update(picked)
        freed = sum(map(m.chunk_len, picked))
        try:
            cs = self.chunk_size
            for a, b in runs(picked):
                punch_hole(self._fd, a * cs, min(b * cs, self.size) - a * cs)
            if not self._detached:
                with self._cache.index.write() as wt:
                    rec = self._record(wt)
                    gone = sum(map(m.chunk_len, wt.drop_chunks(self._fid, picked)))
                    wt.put(self._kh, rec, replace(rec, cached=rec.cached - gone))
                self._cache.account(wt.used_delta)
        finally:
            with self._mu:
                self._cached -= freed
                m.discarding.difference_update(picked)
                self._discards_done.notify_all()
        return freed

    def _record(self, wt: WriteTxn) -> Record:
        rec = wt.record(self._kh)
        if rec is None or rec.fid != self._fid:
            raise RuntimeError(f"cache record of open {self.key!r} vanished")
        return rec

    def _persist_state(self, state: int) -> None:
        """Write this entry's record with `state` (the index's transaction; the
        bytes it frees or takes counted)."""
        with self._cache.index.write() as wt:
            rec = self._record(wt)
            wt.put(self._kh, rec, replace(rec, state=state))
        self._cache.account(wt.used_delta)

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise ValueError(f"{self.key!r}: cache entry used after its last release")
