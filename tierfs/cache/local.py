"""An Entry's write/seal face: what the write-back path (writeback/) does to tier 1.

A local write makes the entry dirty (never evicted) and changes the file in
place; sealing (close, fsync) records the chunks' checksums and the sealed
state in the index, so the file survives a daemon crash (and, fsynced, a
machine crash) and its upload can resume; once uploaded it is an ordinary
clean cached object under the store's ETag (`clean`). The lifecycle is
persisted in the index: dirty -> sealed -> clean.

Checksums are taken as the bytes go by where they can be (`RunningSums`: a file
written front to back is sealed without reading anything back). Bytes the
kernel writes itself (FUSE passthrough writers: `begin_external`) never pass
through here: the file's length is learned from the file and their checksums
are read back, by the seal or, above HASH_LATER, after it (`take_digests`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import xxhash

from tierfs.cache.chunkmap import PAGE, ChunkCorrupt
from tierfs.cache.core import EntryCore
from tierfs.cache.directio import pwrite_all
from tierfs.cache.fileio import file_digests, pread_full, runs
from tierfs.cache.index import ABSENT, CLEAN, DIRTY, PROBATION, SEALED, STORED, VERIFIED, WRITTEN
from tierfs.cache.serve import Serving
from tierfs.cache.space import start_writeback

WRITE_BEHIND = 16 << 20  # dirty bytes behind a writer before their writeback starts
# A seal that would read back more than this to take its checksums (bytes the
# kernel wrote itself, through passthrough) leaves them to `take_digests`: read
# back and hashed, 1 GiB cost close(2) 0.2-0.4 s of safetensors' 0.65 s save.
HASH_LATER = 8 << 20
DIGEST_BATCH = 32  # chunks hashed per `take_digests` step (one index commit)


class RunningSums:
    """Checksums of a dirty file's chunks, taken as writes go by: chunks rewritten
    whole, and chunks being written front to back (their hash so far)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._sums: dict[int, bytes] = {}
        self._hashers: dict[int, tuple[xxhash.xxh3_64, int]] = {}  # chunk -> (hash, bytes)

    def clear(self) -> None:
        self._sums.clear()
        self._hashers.clear()

    def wrote(self, offset: int, data: memoryview) -> None:
        cs = self.chunk_size
        while data:
            i, s = divmod(offset, cs)
            part = data[: cs - s]
            self._sums.pop(i, None)
            prior = self._hashers.pop(i, None)
            h = xxhash.xxh3_64() if s == 0 else prior[0] if prior is not None and prior[1] == s else None
            if h is not None:
                h.update(part)
                if s + len(part) == cs:
                    self._sums[i] = h.digest()
                else:
                    self._hashers[i] = (h, s + len(part))
            offset += len(part)
            data = data[len(part) :]

    def forget(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            self._sums.pop(i, None)
            self._hashers.pop(i, None)

    def cut(self, size: int) -> None:
        """The file was cut to `size`: sums reaching past it are void."""
        cs = self.chunk_size
        for i in [i for i, (_, got) in self._hashers.items() if i * cs + got > size]:
            del self._hashers[i]
        for i in [i for i in self._sums if (i + 1) * cs > size]:
            del self._sums[i]

    def digest(self, i: int, length: int) -> bytes | None:
        """Chunk `i`'s checksum (`length` bytes long) if the writes took it whole."""
        if length == self.chunk_size and i in self._sums:
            return self._sums[i]
        running = self._hashers.get(i)
        return running[0].digest() if running is not None and running[1] == length else None


class LocalCopy:
    def __init__(self, entry: EntryCore, reads: Serving, *, unhashed: bool) -> None:
        self._e = entry
        self._reads = reads  # its fill/serve face: reads of the local bytes are verified too
        self._sums = RunningSums(entry.chunk_size)  # guarded by the entry's `_io`
        self._synced = False  # the sealed bytes are fsynced (by this process)
        # Sealed with some checksums still to take (their chunks WRITTEN, the index
        # holding an UNHASHED marker): `take_digests` takes them after the seal.
        self._unhashed = unhashed
        self._behind = 0  # writeback started for [0, _behind) (see write)
        # Writers the kernel serves from this file itself (FUSE passthrough): the
        # length and checksums kept here are learned from the file (`_adopt`).
        # `_external_seen`: there were such writers since the last adoption.
        self._external = 0
        self._external_seen = False

    # -- writes ----------------------------------------------------------------------

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> int:
        """Change the local copy in place at any offset and length. The entry becomes
        dirty (never evicted); it must be fully cached first (ValueError otherwise).
        Writing past EOF leaves zeros in between, as POSIX does."""
        e = self._e
        mv = memoryview(data).cast("B")
        if offset < 0:
            raise ValueError(f"write at negative offset {offset}")
        behind: tuple[int, int] | None = None  # a range to start writing back
        with self._dirty_io(e.size):
            self._adopt()
            size = e.size
            grew = offset + len(mv) > size
            if mv:
                try:
                    pwrite_all(e._fd, mv, offset)
                except OSError:
                    # Part of it may have landed (ENOSPC): no running checksum may
                    # vouch for those chunks, and the file keeps its known length.
                    self._sums.forget(offset // e.chunk_size, (offset + len(mv) - 1) // e.chunk_size)
                    if grew:
                        os.ftruncate(e._fd, size)
                    raise
                self._sums.wrote(offset, mv)
                if grew:
                    with e._mu:
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
                start_writeback(e._fd, behind[0], behind[1] - behind[0])
        return len(mv)

    def truncate(self, size: int) -> None:
        """Set the local copy's length (zeros when growing); the entry becomes dirty.
        Only the part that survives must be cached."""
        e = self._e
        if size < 0:
            raise ValueError(f"truncate to negative size {size}")
        with self._dirty_io(min(size, e.size)):
            self._adopt()
            # (an empty file is left alone: an ftruncate to 0 makes ext4 write the
            # file out at its last close; see Cache._create)
            if size or os.fstat(e._fd).st_size:
                os.ftruncate(e._fd, size)
            with e._mu:
                self._resize(size)
            self._behind = min(self._behind, size & ~(PAGE - 1))

    def read_into(self, offset: int, buf: memoryview) -> int:
        """The local bytes at `offset` into `buf` (clipped at EOF; verified as any
        read): the bytes read. For uploads and parts sent while writing."""
        return self._reads.read_into(offset, buf)

    # -- the lifecycle: dirty -> sealed -> clean --------------------------------------

    def make_dirty(self) -> None:
        """Being written (write/truncate do this themselves)."""
        self._make_dirty(self._e.size)

    def seal(self, *, durable: bool = True, mtime: float | None = None) -> None:
        """Closed or fsynced: chunk checksums are recorded and the index is synced, so
        it survives a daemon crash; with `durable`, the file is fsynced too, so it
        survives a machine crash (without: as a closed, never fsynced file on any
        local disk; its checksums find what a crash took). Upload pending; never
        evicted. A detached entry (removed while open) has no record to seal."""
        with self._settled():
            self._seal(durable)
            if mtime is not None:
                self._label(None, mtime, clean=False)

    def clean(self, *, etag: str | None = None, mtime: float | None = None) -> None:
        """Uploaded: an ordinary cached object again, under the store's `etag`."""
        with self._settled():
            if self._e._state == DIRTY:
                raise ValueError(f"{self._e.key!r} is dirty: seal it before marking it clean")
            self._label(etag, mtime, clean=True)

    @contextmanager
    def _settled(self) -> Iterator[None]:
        e = self._e
        with e._io:
            e._check_usable()
            if e._detached:
                raise ValueError(f"{e.key!r} was removed from the cache")
            yield
            e._cache.index.sync()

    def _label(self, etag: str | None, mtime: float | None, *, clean: bool) -> None:
        e = self._e
        now = time.time_ns()
        with e._cache.index.write() as wt:
            rec = e._record(wt)
            new = replace(rec, etag=rec.etag if etag is None else etag,
                          mtime=rec.mtime if mtime is None else mtime)
            if clean and rec.state != CLEAN:
                new = replace(new, state=CLEAN, seg=PROBATION, rank_ns=now, access_ns=now)
            wt.put(e._kh, rec, new)
        e._cache.account(wt.used_delta)
        with e._mu:
            e._state, e.etag, e.mtime = new.state, new.etag, new.mtime

    def undirty(self, etag: str) -> bool:
        """Back to the clean object under `etag`, unchanged: a write session that made
        a clean, verified object dirty to let the kernel write it, and wrote nothing.
        True if every chunk still matches the checksum recorded for it (they are
        kept while dirty, until a seal); False (still dirty) otherwise."""
        e = self._e
        with e._io:
            with e._mu:
                if e._state != DIRTY or e._detached or e.etag != etag:
                    return False
            self._adopt()
            with e._mu:
                n = len(e.map)
            rec = e._cache.index.record(e._kh)
            if (rec is None or rec.fid != e._fid or rec.size != e.size
                    or len(e._cache.index.digests(e._fid, range(n))) != n):
                return False
            if e._bad_chunks(list(range(n))):
                return False
            e._persist_state(CLEAN)
            with e._mu:
                e._state = CLEAN
                e.map.states[:] = bytes((VERIFIED,)) * n
                e._pending = 0
            self._sums.clear()
            e._cache.index.sync()
            return True

    def _make_dirty(self, keep: int) -> None:
        """Enter the dirty state. The first `keep` bytes stay (the rest is about to be
        cut), so they must be present, and are verified if not yet: their old
        checksums stop protecting them from here on. Stores in flight finish first:
        fetched bytes landing later would overwrite local ones. A detached entry goes
        dirty in memory only."""
        e, m = self._e, self._e.map
        with e._mu:
            if e._state == DIRTY:
                return
            e._check_usable()
            e._dirtying += 1
            while e._storing:
                e._stores_done.wait()
        try:
            with e._io:
                with e._mu:
                    if e._state == DIRTY:
                        return
                    n = -(-min(keep, e.size) // e.chunk_size)
                    if m.states.find(ABSENT, 0, n) >= 0:
                        raise ValueError(f"{e.key!r} is not fully cached: fetch it before writing")
                    stored = [i for i in range(n) if m.states[i] == STORED]
                bad = e._bad_chunks(stored) if not e._detached else []
                if bad:
                    e._discard(bad, pinned_too=True)
                    e._cache.count_corrupt(len(bad))
                    raise ChunkCorrupt(e.key, bad)
                if not e._detached:
                    e._persist_state(DIRTY)
                with e._mu:
                    e._state = DIRTY
                    self._unhashed = False  # its next seal takes them all
                    m.states[:n] = bytes((WRITTEN,)) * n
                    m.pages.clear()
        finally:
            with e._mu:
                e._dirtying -= 1

    @contextmanager
    def _dirty_io(self, keep: int) -> Iterator[None]:
        """Hold `_io` with the entry dirty (made so first, keeping `keep` bytes)."""
        e = self._e
        while True:
            self._make_dirty(keep)
            e._io.acquire()
            if e._state == DIRTY:
                break
            e._io.release()  # sealed by someone else meanwhile: dirty it again
            keep = e.size
        try:
            yield
        finally:
            e._io.release()

    def _resize(self, size: int) -> None:
        """Dirty length change (caller holds `_io` and `_mu`): chunk map, running
        checksums and byte accounting."""
        e = self._e
        if size < e.size:
            self._sums.cut(size)
        e.map.resize(size)
        delta, e._cached = size - e._cached, size
        if not e._detached:
            e._pending += delta
            e._cache.account(delta)

    def _seal(self, durable: bool) -> None:
        """(caller holds `_io`) fsync (if `durable`), checksums and the sealed record,
        with `_mu` free meanwhile: readers of this file keep being served."""
        e = self._e
        with e._mu:
            if e._state == SEALED:
                if durable:
                    self._sync_data()
                return
            if e._state != DIRTY:
                raise ValueError(f"{e.key!r} is {e.state}: only a dirty entry can be sealed")
        self._adopt()
        with e._mu:
            count = len(e.map)
        self._synced = False
        if durable:
            self._sync_data()
        m = e.map
        digests = {i: d for i in range(count) if (d := self._sums.digest(i, m.chunk_len(i))) is not None}
        unread = sum(m.chunk_len(i) for i in range(count) if i not in digests)
        if unread <= HASH_LATER:
            digests.update((i, self._read_digest(i)) for i in range(count) if i not in digests)
        with e._cache.index.write() as wt:
            rec = e._record(wt)
            wt.drop_all_chunks(e._fid)
            for first, end in runs(digests):
                wt.put_chunks(e._fid, first, (digests[i] for i in range(first, end)))
            if len(digests) < count:
                wt.mark_unhashed(e._fid, e._cache.boot_id, durable)
            wt.put(e._kh, rec, replace(rec, state=SEALED, size=e.size, cached=e._cached))
        with e._mu:
            e._cache.account(wt.used_delta - e._pending)
            e._pending = 0
            e._state = SEALED
            self._unhashed = len(digests) < count
            m.states[:] = bytes(VERIFIED if i in digests else WRITTEN for i in range(count))
        self._sums.clear()

    # -- checksums a seal left to take, and durability ----------------------------------

    @property
    def unhashed(self) -> bool:
        """Sealed with checksums still to take (`take_digests`)."""
        return self._unhashed

    def take_digests(self, limit: int = DIGEST_BATCH) -> bool:
        """Take up to `limit` of the checksums a seal left to take, hashed from a
        read-only mapping of the file (the page cache's own pages: a read into a
        buffer cost its thread 0.55-0.69 CPU-s per GiB sealed, copying). The step
        holds `_io`: every shrink of the file (`truncate`, a failed write's
        rollback) holds it too, and a mapping read past its file's end is SIGBUS;
        a write waits for one step (at most `limit` chunks) at most. They and the
        marker's removal commit without a sync (lost to a machine crash, the
        marker is back: recovery decides, `Cache.finish_seal`). True once none is
        left to take, for this sealed version or because it is none (written
        again, removed)."""
        e, m, cs = self._e, self._e.map, self._e.chunk_size
        with e._io:
            with e._mu:
                if not self._unhashed or e._fd < 0:
                    return True
                todo: list[int] = []
                at = first = m.states.find(WRITTEN)
                while 0 <= at < first + limit:  # one mapping's span at most
                    todo.append(at)
                    at = m.states.find(WRITTEN, at + 1)
                done = at < 0
                size = e.size
            digests = [(i, d) for a, b in runs(todo) for i, d in
                       zip(range(a, b), file_digests(e._fd, a * cs, min(b * cs, size), cs), strict=True)]
            if not e._detached:
                with e._cache.index.write() as wt:
                    e._record(wt)
                    for i, d in digests:
                        wt.put_chunks(e._fid, i, (d,))
                    if done:
                        wt.drop_unhashed(e._fid)
            with e._mu:
                for i in todo:
                    m.states[i] = VERIFIED
                self._unhashed = not done
            return done

    def take_all_digests(self) -> None:
        """Every checksum the seal left to take, in `take_digests` steps."""
        while not self.take_digests():
            pass

    def chunk_sums(self) -> bytes:
        """The checksums of a sealed object's chunks, in order (8 bytes each), of the
        checksums the seal left to take, taken first."""
        e = self._e
        self.take_all_digests()
        with e._mu:
            if e._state != SEALED:
                raise ValueError(f"{e.key!r} is {e.state}: only a sealed entry has checksums")
            n = len(e.map)
        digests = e._cache.index.digests(e._fid, range(n))
        return b"".join(digests[i] for i in range(n))

    def sync(self) -> None:
        """fsync(2) of a file whose bytes a close sealed without one; whatever its
        state by now (its upload may have made it clean meanwhile)."""
        with self._e._io:
            self._e._check_usable()
            self._sync_data()

    def _sync_data(self) -> None:
        """fsync the file, once per sealed version (a close sealed it without one);
        a seal whose checksums are still to take records that its bytes are on disk
        (a machine restart no longer voids them)."""
        e = self._e
        if self._synced:
            return
        os.fsync(e._fd)
        self._synced = True
        if self._unhashed and not e._detached:
            with e._cache.index.write() as wt:
                e._record(wt)
                wt.mark_unhashed(e._fid, e._cache.boot_id, True)
            e._cache.index.sync()

    def _read_digest(self, i: int) -> bytes:
        e = self._e
        return xxhash.xxh3_64_digest(pread_full(e._fd, e.map.chunk_len(i), i * e.chunk_size))

    # -- writers served by the kernel (FUSE passthrough) --------------------------------

    def begin_external(self) -> int:
        """A writer whose write(2)s the kernel applies to the cache file itself
        (passthrough) begins: the fd to register as its backing file. The entry
        must be written locally already (dirty or sealed: a write-back file).
        Until `end_external`, every change, seal and digest first learns the
        file's length from the file (and forgets running checksums). In-memory
        only: callable from the trio loop."""
        e = self._e
        with e._mu:
            e._check_usable()
            if e._state == CLEAN or e._detached:
                raise ValueError(f"{e.key!r} is {e.state}: not a local write")
            self._external += 1
            self._external_seen = True
            return e._fd

    def end_external(self) -> None:
        """The writer's file is released (it writes no more): its last writes taken in."""
        with self._e._io:
            with self._e._mu:
                self._external -= 1
            self._adopt()

    def adopt_external(self) -> os.stat_result:
        """What the kernel wrote so far, taken in (length, checksums to recompute);
        the cache file's fstat."""
        with self._e._io:
            return self._adopt()

    def _adopt(self) -> os.stat_result:
        """(caller holds `_io`) The cache file's length is the truth, if the kernel
        wrote it: running checksums cannot vouch for its bytes any more."""
        e = self._e
        st = os.fstat(e._fd)
        with e._mu:
            if not self._external_seen:
                return st
            if not self._external:
                self._external_seen = False  # this adoption takes in every external write
        self._sums.clear()
        if st.st_size != e.size:
            with e._mu:
                self._resize(st.st_size)
        self._behind = min(self._behind, st.st_size & ~(PAGE - 1))
        return st
