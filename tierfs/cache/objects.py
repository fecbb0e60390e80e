"""Sparse object files and the Entry handle (DESIGN §4, §5).

An object's bytes live in objects/<fid hex> at the same offsets as in the store;
absent chunks are holes. An Entry is the shared, ref-counted handle of one open
object: a kept-open fd plus an in-memory chunk-state bitmap, so serving a read is
a bitmap check and one preadv, with no LMDB write and no global lock.

Locking, two locks per entry:
- `_mu` guards the in-memory state (bitmap, pins, size, state, mirrored record
  fields) and is only ever held for in-memory work: the trio loop takes it (to
  ask what is missing) and must never wait behind a disk.
- `_io` serializes what changes the entry with I/O: local writes, truncate,
  sealing (fsync, checksums), going dirty (verifying what stays), punching
  chunks out, the index updates of a store, detaching, the last release. The
  loop never takes it. Such a change marks its state under `_mu`, does its I/O
  with `_mu` released, and publishes the result under `_mu`. Checksums a seal
  left to take (`take_digests`) are read with neither lock held and committed
  under `_io` if that seal still stands.
Reads and stores pin their chunks under `_mu`, so eviction never punches a
hole under a pread/pwrite; chunks being punched are held back from new stores
(`_discarding`). Lock order: `_io`, an LMDB write transaction, `_mu`, then
Cache._lock (a leaf).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Protocol

import xxhash

from tierfs.cache.directio import ALIGN, pwrite_all, pwrite_direct, reopen_direct
from tierfs.cache.eviction import shed_order
from tierfs.cache.eviction import use as record_use
from tierfs.cache.index import (
    ABSENT,
    CLEAN,
    DIRTY,
    PROBATION,
    SEALED,
    STATE_NAMES,
    STORED,
    VERIFIED,
    WRITTEN,
    CachedObject,
    Index,
    Record,
    WriteTxn,
)
from tierfs.cache.space import punch_hole, start_writeback


class Home(Protocol):
    """What an Entry needs of the Cache holding it (cache/__init__.py)."""

    chunk_size: int
    capacity: int
    objects_dir: Path
    index: Index
    boot_id: bytes  # this machine's boot (an unhashed seal is trusted within it)

    def account(self, delta: int) -> None: ...

    def make_room(self, current: Entry | None) -> None: ...

    def count_corrupt(self, n: int) -> None: ...

    def stash(self, fid: bytes, states: bytearray) -> None: ...

    def take_pages(self, fid: bytes) -> dict[int, int]: ...

    def keep_pages(self, fid: bytes, pages: dict[int, int]) -> None: ...


class ChunkCorrupt(Exception):
    """Cached chunks whose bytes no longer match their checksum (torn write, bit rot).
    They are already dropped: fetch them again."""

    def __init__(self, key: str, chunks: list[int]) -> None:
        super().__init__(f"{key}: checksum mismatch in cached chunk(s) {chunks}; dropped")
        self.key = key
        self.chunks = chunks


_ABSENT_RUN = re.compile(bytes((ABSENT,)) + b"+")
_CHECKSUMMED = (STORED, VERIFIED)
WRITE_BEHIND = 16 << 20  # dirty bytes behind a writer before their writeback starts
# A seal that would read back more than this to take its checksums (bytes the
# kernel wrote itself, through passthrough) leaves them to `take_digests`: read
# back and hashed, 1 GiB cost close(2) 0.2-0.4 s of safetensors' 0.65 s save.
HASH_LATER = 8 << 20
DIGEST_BATCH = 32  # chunks hashed per `take_digests` step (one index commit)
PAGE = 4096  # granularity of `store_pages` (small random reads)


def _pread(fd: int, length: int, offset: int) -> bytes:
    """Up to `length` bytes; shorter only at EOF."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts = [data]
    got = len(data)
    while got < length and (more := os.pread(fd, length - got, offset + got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _preadv(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; fewer bytes only at EOF."""
    got = 0
    while got < len(buf) and (n := os.preadv(fd, [buf[got:]], offset + got)):
        got += n
    return got


def _runs(indexes: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Coalesce chunk indexes into half-open runs [a, b)."""
    run: list[int] | None = None  # [start, end)
    for i in sorted(indexes):
        if run is not None and i == run[1]:
            run[1] = i + 1
            continue
        if run is not None:
            yield run[0], run[1]
        run = [i, i + 1]
    if run is not None:
        yield run[0], run[1]


def tree_digest(sums: bytes) -> str:
    """The whole-object digest stored with an upload: xxh3-128 over its chunks'
    xxh3-64 checksums in order (`Entry.chunk_sums`)."""
    return xxhash.xxh3_128_hexdigest(sums)


def nchunks(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def file_digests(fd: int, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
    """The checksums of the chunks of [start, end) of the file behind `fd`, read back
    (`start` chunk-aligned). Neither the pread nor the hash holds the GIL for the
    bytes (xxhash drops it above 64 KiB). A file shorter than `end` is an OSError:
    what was said to be written there is not."""
    buf = memoryview(bytearray(min(chunk_size, end - start)))
    for a in range(start, end, chunk_size):
        n = min(chunk_size, end - a)
        if _preadv(fd, buf[:n], a) != n:
            raise OSError(errno.EIO, f"tier-1 file ends before {end}: the fill's bytes are not there")
        yield xxhash.xxh3_64_digest(buf[:n])


class Fill:
    """Whole chunks of a clean entry's tier-1 file claimed for fetched bytes that
    their fetcher writes itself (`Entry.filling`): a transfer engine's threads
    pwrite into `fd` at the object's offsets, then `commit`."""

    def __init__(self, entry: Entry, start: int, end: int) -> None:
        self.fd = entry._fd
        self.start = start
        self.end = end
        self._entry = entry

    def commit(self, digests: Sequence[bytes] | None = None) -> None:
        """The bytes of [start, end) are written: record them, with their xxh3-64
        checksums per chunk in order (None: read back and taken here)."""
        self._entry._commit_fill(self.start, self.end, digests)


class Entry:
    """The open handle of one cached object, shared by every open of it.

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
        unhashed: bool = False,
    ) -> None:
        self.key = rec.key
        self.etag = rec.etag
        self.size = size
        self.mtime = rec.mtime
        self.chunk_size = cache.chunk_size
        self._cache = cache
        self._kh = kh
        self._fid = rec.fid
        self._fd = fd
        self._dfd: int | None = None  # O_DIRECT twin of _fd, opened on first use
        self._mu = threading.Lock()  # in-memory state only (see the module docstring)
        self._io = threading.Lock()  # changes that do I/O; never taken on the trio loop
        self._states = states
        self._pins: dict[int, int] = {}
        self._kernel = 0  # passthrough opens on this file: no chunk may be punched out
        self._storing = 0  # store() calls in flight: going dirty waits for them
        self._dirtying = 0  # going dirty: no new store() may start meanwhile
        self._stores_done = threading.Condition(self._mu)
        self._discarding: set[int] = set()  # chunks being punched out: no store() into them
        self._discards_done = threading.Condition(self._mu)
        self._refs = 1
        self._state = rec.state
        self._cached = cached  # bytes held: the record's count plus `_pending`
        self._pending = 0  # dirty growth not yet written to the record
        self._detached = False  # removed or replaced while open: private to its holders
        self._last = (-1, -1)  # chunk range of the most recent store (never shed)
        self._touched = touch_ns is not None  # opened as a use (counts for eviction)
        self._reused = reused
        self._access_ns = rec.access_ns if touch_ns is None else touch_ns
        # Guarded by `_io`: running checksums of a dirty entry's chunks.
        self._sums: dict[int, bytes] = {}  # digests of chunks rewritten whole
        self._hashers: dict[int, tuple[xxhash.xxh3_64, int]] = {}  # chunk -> (hash, bytes)
        self._synced = False  # the sealed bytes are fsynced (by this process)
        # Sealed with some checksums still to take (their chunks WRITTEN, the index
        # holding an UNHASHED marker): `take_digests` takes them after the seal.
        self._unhashed = unhashed
        self._seals = 0  # sealed versions so far: digests of an older one are void
        self._hashing = threading.Lock()  # one `take_digests` step at a time
        self._behind = 0  # writeback started for [0, _behind) (see write)
        # Writers the kernel serves from this file itself (FUSE passthrough): their
        # writes never pass through `write`, so the length and checksums kept here
        # are learned from the file (`_adopt`). `_external_seen`: there were such
        # writers since the last adoption (guarded by `_io`).
        self._external = 0
        self._external_seen = False
        # Absent chunk -> bitmask of its PAGE-sized pages fetched by small random reads
        # (`store_pages`). Memory only: not checksummed, not persisted, not counted in
        # `cached`; gone at the last release or once the whole chunk is stored.
        self._pages: dict[int, int] = cache.take_pages(rec.fid)

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

    @contextmanager
    def holding(self, start: int, end: int) -> Iterator[None]:
        """Keep eviction off the chunks of [start, end) meanwhile (in-memory pins,
        no I/O): a read holds what it waits for, so the fetch of one of its
        chunks can never shed another it fetched a moment before."""
        cs = self.chunk_size
        lo, hi = max(start, 0) // cs, (max(min(end, self.size), start + 1) - 1) // cs
        with self._mu:
            self._pin(lo, hi)
        try:
            yield
        finally:
            with self._mu:
                self._unpin(lo, hi)

    def describe(self) -> CachedObject:
        with self._mu:
            return CachedObject(
                self.key,
                self.etag,
                self.size,
                self.mtime,
                self._cached,
                self._access_ns / 1e9,
                STATE_NAMES[self._state],
            )

    # -- read path ---------------------------------------------------------

    @property
    def path(self) -> Path:
        """The tier-1 file (quarantine.py links it); not kept: opens make thousands."""
        return self._cache.objects_dir / self._fid.hex()

    def whole(self) -> bool:
        """Every chunk present: `not missing(0, size)` without building ranges (asked
        on each open of a warm walk)."""
        with self._mu:
            return ABSENT not in self._states

    def unverified(self) -> bool:
        """Some chunk has a checksum this process has not checked yet (STORED): its
        first read verifies it. For a whole object: not `servable_now(0, size)`."""
        with self._mu:
            return STORED in self._states

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """Chunk-aligned byte ranges [a, b) absent within [start, end), end clipped
        to the size, adjacent chunks coalesced: what the reader must fetch."""
        cs = self.chunk_size
        with self._mu:
            size = self.size
            start, end = max(start, 0), min(end, size)
            if start >= end:
                return []
            runs = [
                m.span()
                for m in _ABSENT_RUN.finditer(self._states, start // cs, (end - 1) // cs + 1)
            ]
        return [(a * cs, min(b * cs, size)) for a, b in runs]

    def missing_pages(self, start: int, end: int) -> list[tuple[int, int]]:
        """PAGE-aligned byte ranges [a, b) within [start, end) (end clipped to the size)
        held neither by a present chunk nor as pages from `store_pages`: what a small
        random read must fetch."""
        cs = self.chunk_size
        per = cs // PAGE
        out: list[tuple[int, int]] = []
        with self._mu:
            size = self.size
            start, end = max(start, 0), min(end, size)
            run: int | None = None
            for p in range(start // PAGE, -(-end // PAGE) if start < end else 0):
                c = p // per
                have = self._states[c] != ABSENT or (self._pages.get(c, 0) >> (p % per)) & 1
                if not have and run is None:
                    run = p
                elif have and run is not None:
                    out.append((run * PAGE, p * PAGE))
                    run = None
            if run is not None:
                out.append((run * PAGE, min(-(-end // PAGE) * PAGE, size)))
        return out

    def servable_now(self, start: int, end: int) -> bool:
        """Whether [start, end) can be served by a plain pread with nothing to verify:
        every chunk verified or written here, or held as pages (`store_pages`). Only
        such a read may run on the trio loop (`read_pages`)."""
        cs = self.chunk_size
        per = cs // PAGE
        with self._mu:
            start, end = max(start, 0), min(end, self.size)
            for c in range(start // cs, (end - 1) // cs + 1 if start < end else 0):
                s = self._states[c]
                if s in (VERIFIED, WRITTEN):
                    continue
                if s != ABSENT:
                    return False
                mask = self._pages.get(c, 0)
                lo, hi = max(start, c * cs), min(end, (c + 1) * cs)
                for p in range(lo // PAGE, -(-hi // PAGE)):
                    if not (mask >> (p % per)) & 1:
                        return False
        return True

    def store_pages(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Cache the bytes of a small random read: `offset` PAGE-aligned, `data` whole
        pages (the last may end at EOF). They serve `read_pages` until the last release
        (see `_pages`); a whole-chunk `store` later supersedes them."""
        mv = memoryview(data).cast("B")
        end = offset + len(mv)
        if offset < 0 or offset % PAGE or not mv or end > self.size or (len(mv) % PAGE and end != self.size):
            raise ValueError(f"store_pages({offset}, {len(mv)} bytes) into {self.key!r}: not whole pages")
        cs = self.chunk_size
        per = cs // PAGE
        lo, hi = offset // cs, (end - 1) // cs
        self._begin_store(lo, hi, "store_pages")
        try:
            pwrite_all(self._fd, mv, offset)  # same ETag: same bytes as any chunk there
            with self._mu:
                for p in range(offset // PAGE, -(-end // PAGE)):
                    c = p // per
                    if self._states[c] == ABSENT:
                        self._pages[c] = self._pages.get(c, 0) | (1 << (p % per))
        finally:
            self._end_store(lo, hi)

    def read_pages(self, offset: int, length: int) -> bytes:
        """`read` that also serves pages held by `store_pages` (KeyError if any byte is
        missing). Runs of present chunks go through `read`, so they are verified."""
        cs = self.chunk_size
        per = cs // PAGE
        n = max(0, min(offset + length, self.size) - offset)
        if not n:
            return b""
        parts: list[bytes] = []
        pos, end = offset, offset + n
        while pos < end:
            c = pos // cs
            seg_end = min(end, (c + 1) * cs)
            with self._mu:
                self._check_usable()
                absent = self._states[c] == ABSENT
                if absent:
                    mask = self._pages.get(c, 0)
                    for p in range(pos // PAGE, -(-seg_end // PAGE)):
                        if not (mask >> (p % per)) & 1:
                            raise KeyError(f"{self.key!r}: page {p} missing")
                    self._pin(c, c)
            if not absent:
                while seg_end < end and self.present(seg_end, min(end, seg_end + cs)):
                    seg_end = min(end, seg_end + cs)
                parts.append(self.read(pos, seg_end - pos))
            else:
                try:
                    parts.append(_pread(self._fd, seg_end - pos, pos))
                finally:
                    with self._mu:
                        self._unpin(c, c)
            pos = seg_end
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def completeness(self) -> str:
        """How whole the tier-1 copy of a clean, attached object is: "verified"
        (every chunk present and checked by this process: the kernel may serve
        the file itself, see fuse/modes.py), "complete" (every chunk present,
        some not checked yet), or "partial" (also: written locally, detached)."""
        with self._mu:
            if self._state != CLEAN or self._detached or self._fd < 0:
                return "partial"
            if self._states.count(VERIFIED) == len(self._states):
                return "verified"
            return "partial" if ABSENT in self._states else "complete"

    def backing_fd(self) -> int:
        """The open fd of the cache file, to register as a passthrough backing
        file (the kernel keeps its own reference: the entry may close it later)."""
        with self._mu:
            self._check_usable()
            return self._fd

    def pin_all(self) -> None:
        """Keep every chunk, those the file grows by later included, from being
        punched out (eviction, `Cache.evict`) until `unpin_all`: the kernel reads
        and writes a passthrough file's backing file directly, and a hole there
        would read as zeros, unchecked."""
        with self._mu:
            self._check_usable()
            self._kernel += 1

    def unpin_all(self, chunks: int = 0) -> None:
        """Undo a `pin_all` (`chunks`: unused, kept for callers)."""
        with self._mu:
            self._kernel -= 1

    def chunk_count(self) -> int:
        with self._mu:
            return len(self._states)

    # -- writers served by the kernel (FUSE passthrough) --------------------------

    def begin_external(self) -> int:
        """A writer whose write(2)s the kernel applies to the cache file itself
        (passthrough) begins: the fd to register as its backing file. The entry
        must be written locally already (dirty or sealed: a write-back file).
        Until `end_external`, every change, seal and digest first learns the
        file's length from the file (and forgets running checksums). In-memory
        only: callable from the trio loop."""
        with self._mu:
            self._check_usable()
            if self._state == CLEAN or self._detached:
                raise ValueError(f"{self.key!r} is {self.state}: not a local write")
            self._external += 1
            self._external_seen = True
            return self._fd

    def end_external(self) -> None:
        """The writer's file is released (it writes no more): its last writes taken in."""
        with self._io:
            with self._mu:
                self._external -= 1
            self._adopt()

    def undirty(self, etag: str) -> bool:
        """Back to the clean object under `etag`, unchanged: a write session that made
        a clean, verified object dirty to let the kernel write it, and wrote nothing.
        True if every chunk still matches the checksum recorded for it (they are
        kept while dirty, until a seal); False (still dirty) otherwise."""
        with self._io:
            with self._mu:
                if self._state != DIRTY or self._detached or self.etag != etag:
                    return False
            self._adopt()
            with self._mu:
                n = len(self._states)
            rec = self._cache.index.record(self._kh)
            if (rec is None or rec.fid != self._fid or rec.size != self.size
                    or len(self._cache.index.digests(self._fid, range(n))) != n):
                return False
            if self._bad_chunks(list(range(n))):
                return False
            with self._cache.index.write() as wt:
                rec = self._record(wt)
                wt.put(self._kh, rec, replace(rec, state=CLEAN))
            self._cache.account(wt.used_delta)
            with self._mu:
                self._state = CLEAN
                self._states[:] = bytes((VERIFIED,)) * n
                self._pending = 0
            self._sums.clear()
            self._hashers.clear()
            self._cache.index.sync()
            return True

    def adopt_external(self) -> os.stat_result:
        """What the kernel wrote so far, taken in (length, checksums to recompute);
        the cache file's fstat."""
        with self._io:
            return self._adopt()

    def _adopt(self) -> os.stat_result:
        """(caller holds `_io`) The cache file's length is the truth, if the kernel
        wrote it: running checksums cannot vouch for its bytes any more."""
        st = os.fstat(self._fd)
        with self._mu:
            if not self._external_seen:
                return st
            if not self._external:
                self._external_seen = False  # this adoption takes in every external write
        self._sums.clear()
        self._hashers.clear()
        if st.st_size != self.size:
            grew = st.st_size > self.size
            with self._mu:
                self._resize(st.st_size)
            if grew:
                self._cache.make_room(None)
        self._behind = min(self._behind, st.st_size & ~(PAGE - 1))
        return st

    def present(self, start: int, end: int) -> bool:
        cs = self.chunk_size
        with self._mu:
            start, end = max(start, 0), min(end, self.size)
            return start >= end or self._states.find(ABSENT, start // cs, (end - 1) // cs + 1) < 0

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length), clipped at EOF. Every chunk must be present
        (KeyError otherwise); a chunk is verified the first time this process serves
        it, and a mismatch drops it and raises ChunkCorrupt."""
        with self._serving(offset, length) as (n, check):
            if not n:
                return b""
            data = _pread(self._fd, n, offset)
            check(memoryview(data))
            return data

    def will_need(self) -> None:
        """Have the device start reading the whole file (readahead), not waiting: a
        batch of opens ahead of a walk gets its files' reads in flight together."""
        os.posix_fadvise(self._fd, 0, self.size, os.POSIX_FADV_WILLNEED)

    def read_whole(self, *, keep_pages: bool = False) -> bytes:
        """`read` of the whole object; a clean entry's pages are dropped after (as
        `read_into` does): its reader keeps the bytes, tier 1 need not. Unless
        `keep_pages`: the kernel reads this file next (passthrough), and would
        read the device a second time."""
        with self._serving(0, self.size) as (n, check):
            if not n:
                return b""
            data = _pread(self._fd, n, 0)
            if self._state == CLEAN and not keep_pages:
                os.posix_fadvise(self._fd, 0, len(data), os.POSIX_FADV_DONTNEED)
            check(memoryview(data))
            return data

    def read_into(self, offset: int, length: int, buf: memoryview) -> memoryview:
        """`read` into `buf` (from `directio.aligned_buffer`, at least `length` +
        2 * ALIGN bytes); returns the view of `buf` holding the bytes.

        Buffered, not O_DIRECT: the device's readahead keeps reads in flight
        ahead of a sequential reader, which one O_DIRECT read at a time does
        not (warm 1 GiB dd through the mount: ~1,000-1,150 MB/s with O_DIRECT,
        ~1,700-1,900 buffered, bench/passthrough.py ~1,900-2,300, same runs).
        A clean entry's pages are dropped once read: the FUSE inode keeps its
        own copy, tier 1 need not hold a second one."""
        with self._serving(offset, length) as (n, check):
            if not n:
                return buf[:0]
            a = offset - offset % ALIGN
            b = -(-(offset + n) // ALIGN) * ALIGN
            got = _preadv(self._fd, buf[: b - a], a)
            if self._state == CLEAN:
                os.posix_fadvise(self._fd, a, got, os.POSIX_FADV_DONTNEED)
            view = buf[offset - a : max(offset - a, min(got, offset - a + n))]
            check(view)
            return view

    def readinto(self, offset: int, buf: memoryview) -> int:
        """`read` of len(buf) bytes into `buf` (any buffer; clipped at EOF): the bytes read."""
        with self._serving(offset, len(buf)) as (n, check):
            if not n:
                return 0
            got = _preadv(self._fd, buf[:n], offset)
            check(buf[:got])
            return got

    def _direct_fd(self) -> int:
        with self._mu:
            self._check_usable()
            if self._dfd is not None:
                return self._dfd
        dfd = reopen_direct(self._fd)  # an open(2): outside the lock
        with self._mu:
            if self._dfd is None and self._fd >= 0:
                self._dfd, dfd = dfd, -1
            current = self._dfd
        if dfd >= 0:
            os.close(dfd)
        return -1 if current is None else current

    @contextmanager
    def _serving(
        self, offset: int, length: int
    ) -> Iterator[tuple[int, Callable[[memoryview], None]]]:
        """Check presence and pin the chunks of a read; yields (clipped length, check)."""
        if offset < 0 or length < 0:
            raise ValueError(f"read({offset}, {length}): negative")
        cs = self.chunk_size
        with self._mu:
            self._check_usable()
            n = max(0, min(offset + length, self.size) - offset)
            if not n:
                lo = hi = 0
                states = b""
            else:
                lo, hi = offset // cs, (offset + n - 1) // cs
                states = bytes(self._states[lo : hi + 1])
                if ABSENT in states:
                    raise KeyError(f"{self.key!r}: chunks missing in [{offset}, {offset + n})")
                self._pin(lo, hi)
        try:
            yield n, partial(self._check, offset, n, lo, states)
        finally:
            if n:
                with self._mu:
                    self._unpin(lo, hi)

    def _check(self, offset: int, n: int, lo: int, states: bytes, got: memoryview) -> None:
        """Verify chunks served for the first time (from `got` where it covers them
        whole); a short read means the file lost data. Drop and raise on mismatch."""
        if len(got) == n and STORED not in states:
            return
        cs = self.chunk_size
        end = offset + len(got)
        short = set(range(end // cs, lo + len(states))) if len(got) < n else set()
        todo = [i for i, s in enumerate(states, lo) if s == STORED and i not in short]
        inside = [i for i in todo if i * cs >= offset and i * cs + self._chunk_len(i) <= end]
        want = self._digests(inside)
        bad = sorted(short)
        for i in inside:
            a = i * cs - offset
            if want.get(i) != xxhash.xxh3_64_digest(got[a : a + self._chunk_len(i)]):
                bad.append(i)
        bad += self._bad_chunks([i for i in todo if i not in inside])
        if bad:
            self._drop_corrupt(bad)
            raise ChunkCorrupt(self.key, sorted(bad))
        with self._mu:
            for i in todo:
                if self._states[i] == STORED:
                    self._states[i] = VERIFIED

    def _bad_chunks(self, indexes: list[int]) -> list[int]:
        """Read whole chunks back from the file and compare with their checksums."""
        if not indexes:
            return []
        want = self._digests(indexes)
        cs = self.chunk_size
        return [
            i
            for i in indexes
            if want.get(i) != xxhash.xxh3_64_digest(_pread(self._fd, self._chunk_len(i), i * cs))
        ]

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
                    picked = [i for i in set(bad) if self._states[i] in _CHECKSUMMED]
                self._discard(picked, pinned_too=True)
        self._cache.count_corrupt(len(set(bad)))

    def verify(self, batch: int = 64) -> list[int]:
        """Check every checksummed chunk against the file: a chunk that matches is
        verified from then on (it outlives its records: an unlinked open file keeps
        it), one that does not is dropped. Returns the bad chunks."""
        with self._mu:
            todo = [i for i, s in enumerate(self._states) if s in _CHECKSUMMED]
        bad: list[int] = []
        for k in range(0, len(todo), batch):
            with self._mu:
                group = [i for i in todo[k : k + batch] if self._states[i] in _CHECKSUMMED]
                for i in group:
                    self._pin(i, i)
            try:
                found = self._bad_chunks(group)
            except KeyError:
                found = None  # detached meanwhile: nothing left to check against
            finally:
                with self._mu:
                    for i in group:
                        self._unpin(i, i)
            if found is None:
                break
            with self._mu:
                for i in group:
                    if i not in found and self._states[i] == STORED:
                        self._states[i] = VERIFIED
            bad += found
        if bad:
            self._drop_corrupt(bad)
        return bad

    # -- fill path -----------------------------------------------------------

    def store(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Cache fetched bytes: `offset` chunk-aligned, `data` whole chunks (the last
        may end at EOF), written with O_DIRECT where aligned (cache/directio.py).
        Checksums go to the index in one transaction; then eviction runs if the
        cache is over its capacity or under its free-space floor."""
        mv = memoryview(data).cast("B")
        cs = self.chunk_size
        digests = [xxhash.xxh3_64_digest(mv[o : o + cs]) for o in range(0, len(mv), cs)]
        with self.filling(offset, offset + len(mv)) as fill:
            pwrite_direct(self._direct_fd(), self._fd, mv, offset)
            fill.commit(digests)
        self._cache.make_room(self)

    @contextmanager
    def filling(self, start: int, end: int) -> Iterator[Fill]:
        """Claim [start, end) of the tier-1 file for fetched bytes someone else writes
        (`Fill.fd`, at the object's offsets; from any thread) and `Fill.commit`s:
        `start` chunk-aligned, `end` a chunk boundary or the object's end. Only a
        clean entry takes them; meanwhile no eviction punches those chunks, no
        local write starts, and chunks being punched are waited for first. The
        bytes count only once committed (an uncommitted fill leaves them absent)."""
        cs = self.chunk_size
        if start < 0 or start % cs or end <= start or end > self.size or (end % cs and end != self.size):
            raise ValueError(
                f"fill of [{start}, {end}) of {self.key!r} (size {self.size}): "
                f"not whole chunks of {cs}"
            )
        lo, hi = start // cs, (end - 1) // cs
        self._begin_store(lo, hi, "fill")
        try:
            yield Fill(self, start, end)
        finally:
            self._end_store(lo, hi)
        self._cache.make_room(self)  # as after store(): the cache may be over its size now

    def _commit_fill(self, start: int, end: int, digests: Sequence[bytes] | None) -> None:
        """(`Fill.commit`) record the chunks of [start, end) as present and verified."""
        cs = self.chunk_size
        lo, hi = start // cs, (end - 1) // cs
        if digests is None:
            digests = list(file_digests(self._fd, start, end, cs))
        if len(digests) != hi - lo + 1:
            raise ValueError(f"{len(digests)} checksums for {hi - lo + 1} chunks of {self.key!r}")
        with self._io:
            added = 0
            if not self._detached:
                with self._cache.index.write() as wt:
                    rec = self._record(wt)
                    added = sum(map(self._chunk_len, wt.put_chunks(self._fid, lo, digests)))
                    wt.put(self._kh, rec, replace(rec, cached=rec.cached + added))
                self._cache.account(wt.used_delta)
            with self._mu:
                self._cached += added
                self._states[lo : hi + 1] = bytes((VERIFIED,)) * (hi - lo + 1)
                for i in range(lo, hi + 1):
                    self._pages.pop(i, None)
                self._last = (lo, hi)

    def _begin_store(self, lo: int, hi: int, what: str) -> None:
        """Claim chunks lo..hi for fetched bytes: only a clean entry takes them, and
        the chunks stay pinned (and dirtying waits) until the store is done. Chunks
        being punched out are waited for (a punch must not land after the bytes)."""
        with self._mu:
            while True:
                self._check_usable()
                if self._state != CLEAN or self._dirtying:
                    raise ValueError(f"{what}() into {self.state} {self.key!r}: it is written locally")
                if not any(i in self._discarding for i in range(lo, hi + 1)):
                    break
                self._discards_done.wait()
            self._pin(lo, hi)
            self._storing += 1

    def _end_store(self, lo: int, hi: int) -> None:
        with self._mu:
            self._unpin(lo, hi)
            self._storing -= 1
            if not self._storing:
                self._stores_done.notify_all()

    # -- write-back hooks ------------------------------------------------------

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> int:
        """Change the local copy in place at any offset and length. The entry becomes
        dirty (never evicted); it must be fully cached first (ValueError otherwise).
        Writing past EOF leaves zeros in between, as POSIX does."""
        mv = memoryview(data).cast("B")
        if offset < 0:
            raise ValueError(f"write at negative offset {offset}")
        behind: tuple[int, int] | None = None  # a range to start writing back
        with self._dirty_io(self.size):
            self._adopt()
            size = self.size
            grew = offset + len(mv) > size
            if mv:
                try:
                    pwrite_all(self._fd, mv, offset)
                except OSError:
                    # Part of it may have landed (ENOSPC): no running checksum may
                    # vouch for those chunks, and the file keeps its known length.
                    self._forget_hashes(
                        offset // self.chunk_size, (offset + len(mv) - 1) // self.chunk_size
                    )
                    if grew:
                        os.ftruncate(self._fd, size)
                    raise
                self._hash(offset, mv)
                if grew:
                    with self._mu:
                        self._resize(offset + len(mv))
                behind = self._behind, (offset + len(mv)) & ~(PAGE - 1)
                if behind[1] - behind[0] >= WRITE_BEHIND:
                    self._behind = behind[1]
                else:
                    behind = None
        if behind is not None:
            # Write-behind: the device writes what the writer left behind while it
            # goes on, so sealing (fsync at close) waits only for the tail. Only
            # an optimization: the fsync at sealing reports any device error.
            with contextlib.suppress(OSError):
                start_writeback(self._fd, behind[0], behind[1] - behind[0])
        if grew and mv:
            self._cache.make_room(None)
        return len(mv)

    def truncate(self, size: int) -> None:
        """Set the local copy's length (zeros when growing); the entry becomes dirty.
        Only the part that survives must be cached."""
        if size < 0:
            raise ValueError(f"truncate to negative size {size}")
        with self._dirty_io(min(size, self.size)):
            self._adopt()
            grew = size > self.size
            # (an empty file is left alone: an ftruncate to 0 makes ext4 write the
            # file out at its last close; see Cache._create)
            if size or os.fstat(self._fd).st_size:
                os.ftruncate(self._fd, size)
            with self._mu:
                self._resize(size)
            self._behind = min(self._behind, size & ~(PAGE - 1))
        if grew:
            self._cache.make_room(None)

    @contextmanager
    def _dirty_io(self, keep: int) -> Iterator[None]:
        """Hold `_io` with the entry dirty (made so first, keeping `keep` bytes)."""
        while True:
            self._make_dirty(keep)
            self._io.acquire()
            if self._state == DIRTY:
                break
            self._io.release()  # sealed by someone else meanwhile: dirty it again
            keep = self.size
        try:
            yield
        finally:
            self._io.release()

    def set_state(self, state: str, *, etag: str | None = None, mtime: float | None = None,
                  durable: bool = True) -> None:
        """Write-back lifecycle, persisted in the index:
        "dirty": being written (write/truncate do this themselves);
        "sealed": closed or fsynced: chunk checksums are recorded and the index is
        synced, so it survives a daemon crash; with `durable`, the file is fsynced
        too, so it survives a machine crash (without: as a closed, never fsynced
        file on any local disk; its checksums find what a crash took); upload pending;
        "clean": uploaded: an ordinary cached object again, under the store's `etag`.
        Dirty and sealed objects are never evicted. A detached entry (removed while
        open) takes no state: it has no record any more."""
        if state not in STATE_NAMES:
            raise ValueError(f"unknown cache state {state!r}")
        code = STATE_NAMES.index(state)
        if code == DIRTY:
            self._make_dirty(self.size)
            return
        with self._io:
            self._check_usable()
            if self._detached:
                raise ValueError(f"{self.key!r} was removed from the cache")
            if code == SEALED:
                self._seal(durable)
            elif self._state == DIRTY:
                raise ValueError(f"{self.key!r} is dirty: seal it before marking it clean")
            if code == CLEAN or etag is not None or mtime is not None:
                now = time.time_ns()
                with self._cache.index.write() as wt:
                    rec = self._record(wt)
                    new = replace(
                        rec,
                        etag=rec.etag if etag is None else etag,
                        mtime=rec.mtime if mtime is None else mtime,
                    )
                    if code == CLEAN and rec.state != CLEAN:
                        new = replace(new, state=CLEAN, seg=PROBATION, rank_ns=now, access_ns=now)
                    wt.put(self._kh, rec, new)
                self._cache.account(wt.used_delta)
                with self._mu:
                    self._state, self.etag, self.mtime = new.state, new.etag, new.mtime
            self._cache.index.sync()

    def _make_dirty(self, keep: int) -> None:
        """Enter the dirty state. The first `keep` bytes stay (the rest is about to be
        cut), so they must be present, and are verified if not yet: their old
        checksums stop protecting them from here on. Stores in flight finish first:
        fetched bytes landing later would overwrite local ones. A detached entry goes
        dirty in memory only."""
        with self._mu:
            if self._state == DIRTY:
                return
            self._check_usable()
            self._dirtying += 1
            while self._storing:
                self._stores_done.wait()
        try:
            with self._io:
                with self._mu:
                    if self._state == DIRTY:
                        return
                    n = nchunks(min(keep, self.size), self.chunk_size)
                    if self._states.find(ABSENT, 0, n) >= 0:
                        raise ValueError(f"{self.key!r} is not fully cached: fetch it before writing")
                    stored = [i for i in range(n) if self._states[i] == STORED]
                bad = self._bad_chunks(stored) if not self._detached else []
                if bad:
                    self._discard(bad, pinned_too=True)
                    self._cache.count_corrupt(len(bad))
                    raise ChunkCorrupt(self.key, bad)
                if not self._detached:
                    with self._cache.index.write() as wt:
                        rec = self._record(wt)
                        wt.put(self._kh, rec, replace(rec, state=DIRTY))
                    self._cache.account(wt.used_delta)
                with self._mu:
                    self._state = DIRTY
                    self._unhashed = False  # its next seal takes them all
                    self._states[:n] = bytes((WRITTEN,)) * n
                    self._pages.clear()
        finally:
            with self._mu:
                self._dirtying -= 1

    def _hash(self, offset: int, data: memoryview) -> None:
        """Keep running checksums of chunks written front to back, so sealing a file
        written sequentially reads nothing back."""
        cs = self.chunk_size
        while data:
            i, s = divmod(offset, cs)
            part = data[: cs - s]
            self._sums.pop(i, None)
            prior = self._hashers.pop(i, None)
            h = (
                xxhash.xxh3_64()
                if s == 0
                else prior[0]
                if prior is not None and prior[1] == s
                else None
            )
            if h is not None:
                h.update(part)
                if s + len(part) == cs:
                    self._sums[i] = h.digest()
                else:
                    self._hashers[i] = (h, s + len(part))
            offset += len(part)
            data = data[len(part) :]

    def _forget_hashes(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            self._sums.pop(i, None)
            self._hashers.pop(i, None)

    def _resize(self, size: int) -> None:
        """Dirty length change (caller holds `_io` and `_mu`): bitmap, running
        checksums and byte accounting."""
        n = nchunks(size, self.chunk_size)
        if size < self.size:
            del self._states[n:]
            cs = self.chunk_size
            for i in [i for i, (_, got) in self._hashers.items() if i * cs + got > size]:
                del self._hashers[i]
            for i in [i for i in self._sums if (i + 1) * cs > size]:
                del self._sums[i]
        else:
            self._states.extend(bytes((WRITTEN,)) * (n - len(self._states)))
        self.size = size
        delta, self._cached = size - self._cached, size
        if not self._detached:
            self._pending += delta
            self._cache.account(delta)

    def _seal(self, durable: bool) -> None:
        """(caller holds `_io`) fsync (if `durable`), checksums and the sealed record,
        with `_mu` free meanwhile: readers of this file keep being served."""
        with self._mu:
            if self._state == SEALED:
                if durable:
                    self._sync_data()
                return
            if self._state != DIRTY:
                raise ValueError(f"{self.key!r} is {self.state}: only a dirty entry can be sealed")
        self._adopt()
        with self._mu:
            count = len(self._states)
        self._synced = False
        if durable:
            self._sync_data()
        digests = {i: d for i in range(count) if (d := self._running_digest(i)) is not None}
        unread = sum(self._chunk_len(i) for i in range(count) if i not in digests)
        if unread <= HASH_LATER:
            digests.update((i, self._read_digest(i)) for i in range(count) if i not in digests)
        with self._cache.index.write() as wt:
            rec = self._record(wt)
            wt.drop_all_chunks(self._fid)
            for first, end in _runs(digests):
                wt.put_chunks(self._fid, first, (digests[i] for i in range(first, end)))
            if len(digests) < count:
                wt.mark_unhashed(self._fid, self._cache.boot_id, durable)
            wt.put(self._kh, rec, replace(rec, state=SEALED, size=self.size, cached=self._cached))
        with self._mu:
            self._cache.account(wt.used_delta - self._pending)
            self._pending = 0
            self._state = SEALED
            self._seals += 1
            self._unhashed = len(digests) < count
            self._states[:] = bytes(VERIFIED if i in digests else WRITTEN for i in range(count))
        self._sums.clear()
        self._hashers.clear()

    @property
    def unhashed(self) -> bool:
        """Sealed with checksums still to take (`take_digests`)."""
        return self._unhashed

    def take_digests(self, limit: int = DIGEST_BATCH) -> bool:
        """Take up to `limit` of the checksums a seal left to take, reading with no
        lock held (a rename or a new write of the file waits for one step at most);
        they and the marker's removal commit without a sync (lost to a machine
        crash, the marker is back: recovery decides, `Cache.finish_seal`). True
        once none is left to take, for this sealed version or because it is none
        (written again, removed)."""
        with self._hashing:
            with self._mu:
                if not self._unhashed or self._fd < 0:
                    return True
                seals, fd = self._seals, self._fd
                todo: list[tuple[int, int]] = []
                at = self._states.find(WRITTEN)
                while at >= 0 and len(todo) < limit:
                    todo.append((at, self._chunk_len(at)))
                    at = self._states.find(WRITTEN, at + 1)
            digests = [(i, xxhash.xxh3_64_digest(_pread(fd, n, i * self.chunk_size)))
                       for i, n in todo]
            with self._io:
                with self._mu:
                    if self._seals != seals or not self._unhashed:
                        return not self._unhashed  # sealed again: its own seal decides
                    done = self._states.count(WRITTEN) == len(todo)
                if not self._detached:
                    with self._cache.index.write() as wt:
                        self._record(wt)
                        for i, d in digests:
                            wt.put_chunks(self._fid, i, (d,))
                        if done:
                            wt.drop_unhashed(self._fid)
                with self._mu:
                    for i, _ in todo:
                        self._states[i] = VERIFIED
                    self._unhashed = not done
            return done

    def sync(self) -> None:
        """fsync(2) of a file whose bytes a close sealed without one; whatever its
        state by now (its upload may have made it clean meanwhile)."""
        with self._io:
            self._check_usable()
            self._sync_data()

    def _sync_data(self) -> None:
        """fsync the file, once per sealed version (a close sealed it without one);
        a seal whose checksums are still to take records that its bytes are on disk
        (a machine restart no longer voids them)."""
        if self._synced:
            return
        os.fsync(self._fd)
        self._synced = True
        if self._unhashed and not self._detached:
            with self._cache.index.write() as wt:
                self._record(wt)
                wt.mark_unhashed(self._fid, self._cache.boot_id, True)
            self._cache.index.sync()

    def take_all_digests(self) -> None:
        """Every checksum the seal left to take, in `take_digests` steps."""
        while not self.take_digests():
            pass

    def chunk_sums(self) -> bytes:
        """The checksums of a sealed object's chunks, in order (8 bytes each), of the
        checksums the seal left to take, taken first."""
        self.take_all_digests()
        with self._mu:
            if self._state != SEALED:
                raise ValueError(f"{self.key!r} is {self.state}: only a sealed entry has checksums")
            n = len(self._states)
        digests = self._cache.index.digests(self._fid, range(n))
        return b"".join(digests[i] for i in range(n))

    def _running_digest(self, i: int) -> bytes | None:
        """Chunk `i`'s checksum if the writes through `write` took it as they went."""
        length = self._chunk_len(i)
        if length == self.chunk_size and i in self._sums:
            return self._sums[i]
        running = self._hashers.get(i)
        if running is not None and running[1] == length:
            return running[0].digest()
        return None

    def _read_digest(self, i: int) -> bytes:
        return xxhash.xxh3_64_digest(_pread(self._fd, self._chunk_len(i), i * self.chunk_size))

    # -- used by Cache ---------------------------------------------------------

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
            with self._mu:
                if self._fd < 0 or self._detached or self._state != CLEAN:
                    return 0
                picked, total = [], 0
                for i in shed_order(self._states, *self._last) if not self._kernel else ():
                    if i not in self._pins:
                        picked.append(i)
                        total += self._chunk_len(i)
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
                picked = [
                    i for i, s in enumerate(self._states)
                    if s in _CHECKSUMMED and i not in self._pins and not self._kernel
                ]
            return self._discard(picked)

    def _discard(self, indexes: list[int], *, pinned_too: bool = False) -> int:
        """Punch chunks out of the file, then forget them (caller holds `_io`). They are
        absent from the moment they are picked (no new reader pins them) and held back
        from new stores until punched; a pinned one is skipped unless `pinned_too`
        (corrupt data: its readers find out by their own check). A crash between the
        punch and the index update leaves records of zeroed chunks: verification
        catches them."""
        with self._mu:
            picked = [
                i for i in set(indexes)
                if self._states[i] in _CHECKSUMMED
                and (pinned_too or (i not in self._pins and not self._kernel))
            ]
            if not picked:
                return 0
            for i in picked:
                self._states[i] = ABSENT
            self._discarding.update(picked)
        freed = sum(map(self._chunk_len, picked))
        try:
            cs = self.chunk_size
            for a, b in _runs(picked):
                punch_hole(self._fd, a * cs, min(b * cs, self.size) - a * cs)
            if not self._detached:
                with self._cache.index.write() as wt:
                    rec = self._record(wt)
                    gone = sum(map(self._chunk_len, wt.drop_chunks(self._fid, picked)))
                    wt.put(self._kh, rec, replace(rec, cached=rec.cached - gone))
                self._cache.account(wt.used_delta)
        finally:
            with self._mu:
                self._cached -= freed
                self._discarding.difference_update(picked)
                self._discards_done.notify_all()
        return freed

    def _detach(self) -> Record | None:
        """Cut this entry loose from the index (removed, or replaced by a newer
        version): holders keep reading what is verified, and writing. Returns the
        dropped record."""
        with self._io:
            with self._mu:
                self._detached = True
                self._states[:] = self._states.replace(bytes((STORED,)), bytes((ABSENT,)))
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
                    fd, dfd = self._fd, self._dfd
                    self._fd, self._dfd = -1, None
                os.close(fd)
                if dfd is not None and dfd >= 0:
                    os.close(dfd)
            if not self._detached and self._state != DIRTY and VERIFIED in self._states:
                self._cache.stash(self._fid, self._states)
            if not self._detached and self._state == CLEAN and self._pages:
                self._cache.keep_pages(self._fid, self._pages)

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
            record_use(
                wt, self._kh, rec, access_ns=now, reused=self._reused, capacity=self._cache.capacity
            )
        else:
            wt.put(self._kh, rec, replace(rec, size=self.size, cached=self._cached, access_ns=now))

    def _persisted(self) -> None:
        """The record written by `_persist_in` is committed (and its used_delta
        accounted): the dirty growth it carried is no longer pending."""
        with self._mu:
            self._cache.account(-self._pending)
            self._pending = 0
        self._touched = False

    # -- helpers ------------------------------------------------------------------

    def _record(self, wt: WriteTxn) -> Record:
        rec = wt.record(self._kh)
        if rec is None or rec.fid != self._fid:
            raise RuntimeError(f"cache record of open {self.key!r} vanished")
        return rec

    def _chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.size - i * self.chunk_size)

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise ValueError(f"{self.key!r}: cache entry used after its last release")

    def _pin(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            self._pins[i] = self._pins.get(i, 0) + 1

    def _unpin(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            left = self._pins[i] - 1
            if left:
                self._pins[i] = left
            else:
                del self._pins[i]
