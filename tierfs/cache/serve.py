"""An Entry's fill/serve face: what the read path (read/) asks of tier 1.

Fill: fetched bytes go in as whole chunks (`store`, written with O_DIRECT where
aligned, or `filling` + `Fill.commit` for bytes a transfer engine writes into
the file itself), or as the 4 KiB pages of a small random read (`store_pages`).
Serve: `read` and its variants pin the chunks they read, and verify a chunk
the first time this process serves it (a mismatch drops it: ChunkCorrupt).
Questions about what is there are the chunk map's (chunkmap.py), asked under
the entry's in-memory lock. Eviction runs beside fills, never inside one
(eviction.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import xxhash

from tierfs.cache.chunkmap import CHECKSUMMED, PAGE, ChunkCorrupt
from tierfs.cache.core import EntryCore
from tierfs.cache.directio import ALIGN, pwrite_all, pwrite_direct, reopen_direct
from tierfs.cache.fileio import chunk_digests, file_digests, pread_full, preadv_full, resident
from tierfs.cache.index import ABSENT, CLEAN, STORED, VERIFIED


class Fill:
    """Whole chunks of a clean entry's tier-1 file claimed for fetched bytes that
    their fetcher writes itself (`Serving.filling`): a transfer engine's threads
    pwrite into `fd` at the object's offsets, then `commit`."""

    def __init__(self, serving: Serving, fd: int, start: int, end: int) -> None:
        self.fd = fd
        self.start = start
        self.end = end
        self._serving = serving

    def commit(self, digests: Sequence[bytes] | None = None) -> None:
        """The bytes of [start, end) are written: record them, with their xxh3-64
        checksums per chunk in order (None: read back and taken here)."""
        self._serving._commit(self.start, self.end, digests)


class Serving:
    def __init__(self, entry: EntryCore) -> None:
        self._e = entry
        self._dfd: int | None = None  # O_DIRECT twin of the entry's fd, opened on first use

    # -- what is there -------------------------------------------------------------

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """Chunk-aligned byte ranges absent within [start, end): what to fetch."""
        with self._e._mu:
            return self._e.map.missing(start, end)

    def missing_pages(self, start: int, end: int) -> list[tuple[int, int]]:
        """PAGE-aligned ranges neither present nor held as pages (a small read's fetch)."""
        with self._e._mu:
            return self._e.map.missing_pages(start, end)

    def present(self, start: int, end: int) -> bool:
        with self._e._mu:
            return self._e.map.present(start, end)

    def complete(self) -> bool:
        """Every chunk present (asked on each open of a warm walk)."""
        with self._e._mu:
            return self._e.map.complete()

    def unverified(self) -> bool:
        """Some chunk has a checksum this process has not checked yet: its first
        read verifies it."""
        with self._e._mu:
            return self._e.map.unverified()

    def servable_now(self, start: int, end: int) -> bool:
        """Whether [start, end) reads with a plain pread and nothing to verify: only
        such a read may run on the trio loop (`read_pages`)."""
        with self._e._mu:
            return self._e.map.servable_now(start, end)

    def completeness(self) -> str:
        """How much of a clean, attached object tier 1 holds: "verified" (every
        chunk present and checked by this process: the kernel may serve the file
        itself, see fuse/modes.py), "complete" (every chunk present, some not
        checked yet), or "partial" (also: written locally, detached)."""
        e = self._e
        with e._mu:
            if e._state != CLEAN or e._detached or e._fd < 0:
                return "partial"
            if e.map.verified():
                return "verified"
            return "complete" if e.map.complete() else "partial"

    # -- fill ------------------------------------------------------------------------

    def store(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Cache fetched bytes: `offset` chunk-aligned, `data` whole chunks (the last
        may end at EOF), written with O_DIRECT where aligned (cache/directio.py);
        their checksums go to the index in one transaction."""
        mv = memoryview(data).cast("B")
        digests = chunk_digests(mv, self._e.chunk_size)
        with self.filling(offset, offset + len(mv)) as fill:
            pwrite_direct(self._direct_fd(), self._e._fd, mv, offset)
            fill.commit(digests)

    @contextmanager
    def filling(self, start: int, end: int) -> Iterator[Fill]:
        """Claim [start, end) of the tier-1 file for fetched bytes someone else writes
        (`Fill.fd`, at the object's offsets; from any thread) and `Fill.commit`s:
        `start` chunk-aligned, `end` a chunk boundary or the object's end. Only a
        clean entry takes them; meanwhile no eviction punches those chunks, no
        local write starts, and chunks being punched are waited for first. The
        bytes count only once committed (an uncommitted fill leaves them absent)."""
        e, cs = self._e, self._e.chunk_size
        if start < 0 or start % cs or end <= start or end > e.size or (end % cs and end != e.size):
            raise ValueError(f"fill of [{start}, {end}) of {e.key!r} (size {e.size}): "
                             f"not whole chunks of {cs}")
        lo, hi = start // cs, (end - 1) // cs
        e._begin_store(lo, hi, "fill")
        try:
            yield Fill(self, e._fd, start, end)
        finally:
            e._end_store(lo, hi)

    def _commit(self, start: int, end: int, digests: Sequence[bytes] | None) -> None:
        """(`Fill.commit`) record the chunks of [start, end) as present and verified."""
        e, cs = self._e, self._e.chunk_size
        lo, hi = start // cs, (end - 1) // cs
        if digests is None:
            digests = list(file_digests(e._fd, start, end, cs))
        if len(digests) != hi - lo + 1:
            raise ValueError(f"{len(digests)} checksums for {hi - lo + 1} chunks of {e.key!r}")
        with e._io:
            added = 0
            if not e._detached:
                with e._cache.index.write() as wt:
                    rec = e._record(wt)
                    added = sum(map(e.map.chunk_len, wt.put_chunks(e._fid, lo, digests)))
                    wt.put(e._kh, rec, replace(rec, cached=rec.cached + added))
                e._cache.account(wt.used_delta, filled=e)
            with e._mu:
                e._cached += added
                e.map.stored(lo, hi)

    def store_pages(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Cache the bytes of a small random read: `offset` PAGE-aligned, `data` whole
        pages (the last may end at EOF). They serve `read_pages` until the last release;
        a whole-chunk `store` later supersedes them."""
        e = self._e
        mv = memoryview(data).cast("B")
        end = offset + len(mv)
        if offset < 0 or offset % PAGE or not mv or end > e.size or (len(mv) % PAGE and end != e.size):
            raise ValueError(f"store_pages({offset}, {len(mv)} bytes) into {e.key!r}: not whole pages")
        lo, hi = offset // e.chunk_size, (end - 1) // e.chunk_size
        e._begin_store(lo, hi, "store_pages")
        try:
            pwrite_all(e._fd, mv, offset)  # same ETag: same bytes as any chunk there
            with e._mu:
                e.map.add_pages(offset, end)
        finally:
            e._end_store(lo, hi)

    # -- serve -------------------------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length), clipped at EOF. Every chunk must be present
        (KeyError otherwise); a chunk is verified the first time this process serves
        it, and a mismatch drops it and raises ChunkCorrupt."""
        with self._serving(offset, length) as (n, check):
            if not n:
                return b""
            data = pread_full(self._e._fd, n, offset)
            check(memoryview(data))
            return data

    def read_pages(self, offset: int, length: int) -> bytes:
        """`read` that also serves pages held by `store_pages` (KeyError if any byte is
        missing). Runs of present chunks go through `read`, so they are verified."""
        e, cs = self._e, self._e.chunk_size
        n = max(0, min(offset + length, e.size) - offset)
        if not n:
            return b""
        parts: list[bytes] = []
        pos, end = offset, offset + n
        while pos < end:
            c = pos // cs
            seg_end = min(end, (c + 1) * cs)
            with e._mu:
                e._check_usable()
                absent = e.map.states[c] == ABSENT
                if absent:
                    if not e.map.pages_held(c, pos, seg_end):
                        raise KeyError(f"{e.key!r}: pages of [{pos}, {seg_end}) missing")
                    e.map.pin(c, c)
            if not absent:
                while seg_end < end and self.present(seg_end, min(end, seg_end + cs)):
                    seg_end = min(end, seg_end + cs)
                parts.append(self.read(pos, seg_end - pos))
            else:
                try:
                    parts.append(pread_full(e._fd, seg_end - pos, pos))
                finally:
                    with e._mu:
                        e.map.unpin(c, c)
            pos = seg_end
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_whole(self, *, keep_pages: bool = False) -> bytes:
        """`read` of the whole object; a clean entry's pages are dropped after (as
        `read_aligned` does): its reader keeps the bytes, tier 1 need not. Unless
        `keep_pages`: the kernel reads this file next (passthrough), and would
        read the device a second time."""
        e = self._e
        with self._serving(0, e.size) as (n, check):
            if not n:
                return b""
            data = pread_full(e._fd, n, 0)
            if e._state == CLEAN and not keep_pages:
                os.posix_fadvise(e._fd, 0, len(data), os.POSIX_FADV_DONTNEED)
            check(memoryview(data))
            return data

    def read_aligned(self, offset: int, length: int, buf: memoryview) -> memoryview:
        """`read` into `buf` (from `directio.aligned_buffer`, at least `length` +
        2 * ALIGN bytes), from the ALIGN boundary below `offset`; the view of `buf`
        holding the bytes.

        Buffered, not O_DIRECT: the device's readahead keeps reads in flight
        ahead of a sequential reader, which one O_DIRECT read at a time does
        not (warm 1 GiB dd through the mount: ~1,000-1,150 MB/s with O_DIRECT,
        ~1,700-1,900 buffered, bench/passthrough.py ~1,900-2,300, same runs).
        A clean entry's pages are dropped once read: the FUSE inode keeps its
        own copy, tier 1 need not hold a second one."""
        e = self._e
        with self._serving(offset, length) as (n, check):
            if not n:
                return buf[:0]
            a = offset - offset % ALIGN
            b = -(-(offset + n) // ALIGN) * ALIGN
            got = preadv_full(e._fd, buf[: b - a], a)
            if e._state == CLEAN:
                os.posix_fadvise(e._fd, a, got, os.POSIX_FADV_DONTNEED)
            view = buf[offset - a : max(offset - a, min(got, offset - a + n))]
            check(view)
            return view

    def read_into(self, offset: int, buf: memoryview) -> int:
        """`read` of len(buf) bytes into `buf` (any buffer; clipped at EOF): the bytes read."""
        with self._serving(offset, len(buf)) as (n, check):
            if not n:
                return 0
            got = preadv_full(self._e._fd, buf[:n], offset)
            check(buf[:got])
            return got

    def lend(self, offset: int, length: int) -> tuple[int, Callable[[], None]] | None:
        """[offset, offset+length) of a clean entry for someone else to read from the
        tier-1 file itself (libfuse splicing a read reply from its page cache, on
        the trio thread): a duplicate of the file's fd and the call that ends the
        loan. None where a chunk is missing or not yet checked by this process
        (its first read verifies it: `read_aligned`), or a page is not in the
        page cache (reading it would wait for the device on the trio thread;
        `read_aligned` reads it in a worker). Until that call the chunks stay
        pinned (no eviction punches them) and the duplicate keeps the file open
        whatever the entry does meanwhile. Ending the loan drops the range from
        the page cache, as `read_aligned` does: the FUSE inode holds its own copy."""
        e, cs = self._e, self._e.chunk_size
        end = offset + length
        if offset < 0 or length <= 0 or end > e.size:
            return None
        lo, hi = offset // cs, (end - 1) // cs
        with e._mu:
            if e._state != CLEAN or e._fd < 0 or any(s != VERIFIED for s in e.map.states[lo : hi + 1]):
                return None
            # Under the lock (neither call is disk I/O): once unlocked, the entry may
            # close its fd and the number be reused; the duplicate outlives that.
            # (Pages that leave the cache between this check and the splice are read
            # from the device on the trio thread: rare, as they were just there.)
            if not resident(e._fd, offset, length):
                return None
            dup = os.dup(e._fd)
            e.map.pin(lo, hi)

        def done() -> None:
            try:
                os.posix_fadvise(dup, offset, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(dup)
                with e._mu:
                    e.map.unpin(lo, hi)

        return dup, done

    def will_need(self) -> None:
        """Have the device start reading the whole file (readahead), not waiting: a
        batch of opens ahead of a walk gets its files' reads in flight together."""
        os.posix_fadvise(self._e._fd, 0, self._e.size, os.POSIX_FADV_WILLNEED)

    def verify(self, batch: int = 64) -> list[int]:
        """Check every checksummed chunk against the file: a chunk that matches is
        verified from then on (it outlives its records: an unlinked open file keeps
        it), one that does not is dropped. Returns the bad chunks."""
        e, m = self._e, self._e.map
        with e._mu:
            todo = [i for i, s in enumerate(m.states) if s in CHECKSUMMED]
        bad: list[int] = []
        for k in range(0, len(todo), batch):
            with e._mu:
                group = [i for i in todo[k : k + batch] if m.states[i] in CHECKSUMMED]
                for i in group:
                    m.pin(i, i)
            try:
                found = e._bad_chunks(group)
            except KeyError:
                found = None  # detached meanwhile: nothing left to check against
            finally:
                with e._mu:
                    for i in group:
                        m.unpin(i, i)
            if found is None:
                break
            with e._mu:
                for i in group:
                    if i not in found and m.states[i] == STORED:
                        m.states[i] = VERIFIED
            bad += found
        if bad:
            e._drop_corrupt(bad)
        return bad

    # -- the kernel reads the file itself (FUSE passthrough) -----------------------------

    def backing_fd(self) -> int:
        """The open fd of the cache file, to register as a passthrough backing
        file (the kernel keeps its own reference: the entry may close it later)."""
        with self._e._mu:
            self._e._check_usable()
            return self._e._fd

    def pin_all(self) -> None:
        """Keep every chunk, those the file grows by later included, from being
        punched out (eviction, `Cache.evict`) until `unpin_all`: the kernel reads
        and writes a passthrough file's backing file directly, and a hole there
        would read as zeros, unchecked."""
        with self._e._mu:
            self._e._check_usable()
            self._e.map.kernel += 1

    def unpin_all(self) -> None:
        """Undo a `pin_all`."""
        with self._e._mu:
            self._e.map.kernel -= 1

    # -- helpers ------------------------------------------------------------------------

    def _direct_fd(self) -> int:
        e = self._e
        with e._mu:
            e._check_usable()
            if self._dfd is not None:
                return self._dfd
        dfd = reopen_direct(e._fd)  # an open(2): outside the lock
        with e._mu:
            if self._dfd is None and e._fd >= 0:
                self._dfd, dfd = dfd, -1
            current = self._dfd
        if dfd >= 0:
            os.close(dfd)
        return -1 if current is None else current

    def _close_direct(self) -> None:
        """(The entry's last release) close the O_DIRECT twin, if opened."""
        with self._e._mu:
            dfd, self._dfd = self._dfd, None
        if dfd is not None and dfd >= 0:
            os.close(dfd)

    @contextmanager
    def _serving(self, offset: int, length: int) -> Iterator[tuple[int, Callable[[memoryview], None]]]:
        """Check presence and pin the chunks of a read; yields (clipped length, check)."""
        if offset < 0 or length < 0:
            raise ValueError(f"read({offset}, {length}): negative")
        e, cs = self._e, self._e.chunk_size
        with e._mu:
            e._check_usable()
            n = max(0, min(offset + length, e.size) - offset)
            if not n:
                lo = hi = 0
                states = b""
            else:
                lo, hi = offset // cs, (offset + n - 1) // cs
                states = bytes(e.map.states[lo : hi + 1])
                if ABSENT in states:
                    raise KeyError(f"{e.key!r}: chunks missing in [{offset}, {offset + n})")
                e.map.pin(lo, hi)
        try:
            yield n, partial(self._check, offset, n, lo, states)
        finally:
            if n:
                with e._mu:
                    e.map.unpin(lo, hi)

    def _check(self, offset: int, n: int, lo: int, states: bytes, got: memoryview) -> None:
        """Verify chunks served for the first time (from `got` where it covers them
        whole); a short read means the file lost data. Drop and raise on mismatch."""
        if len(got) == n and STORED not in states:
            return
        e, m, cs = self._e, self._e.map, self._e.chunk_size
        end = offset + len(got)
        short = set(range(end // cs, lo + len(states))) if len(got) < n else set()
        todo = [i for i, s in enumerate(states, lo) if s == STORED and i not in short]
        inside = [i for i in todo if i * cs >= offset and i * cs + m.chunk_len(i) <= end]
        want = e._digests(inside)
        bad = sorted(short)
        for i in inside:
            a = i * cs - offset
            if want.get(i) != xxhash.xxh3_64_digest(got[a : a + m.chunk_len(i)]):
                bad.append(i)
        bad += e._bad_chunks([i for i in todo if i not in inside])
        if bad:
            e._drop_corrupt(bad)
            raise ChunkCorrupt(e.key, sorted(bad))
        with e._mu:
            for i in todo:
                if m.states[i] == STORED:
                    m.states[i] = VERIFIED
