"""Tier 1: the node-local block cache (DESIGN §4).

A blocking, thread-safe library: the daemon calls it from worker threads and
every call is short. The cache dir's layout: layout.py. An open object is an
Entry (objects.py) with two faces, fill/serve (serve.py) for the read path and
write/seal (local.py) for the write-back path; what tier 1 holds of it is its
chunk map (chunkmap.py). Eviction (eviction.py) runs beside the fills.

Locks, in the only order they nest: Entry._io, an LMDB write transaction,
Entry._mu, Cache._lock (a leaf: in-memory work only). The Evictor's lock is
taken with no other lock held. A key being loaded, evicted, removed or renamed
is "claimed" (in `_busy`), which keeps opens and last releases of it waiting
meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from tierfs.cache import integrity
from tierfs.cache.chunkmap import ChunkCorrupt
from tierfs.cache.core import EntryCore
from tierfs.cache.directio import pwrite_all
from tierfs.cache.eviction import Evictor
from tierfs.cache.fileio import chunk_digests, tree_digest
from tierfs.cache.index import CLEAN, CachedObject, Record, key_hash
from tierfs.cache.layout import (
    CacheBusy,
    CacheConflict,
    CacheUnwritable,
    open_index,
    take_dir,
    this_boot,
)
from tierfs.cache.listings import KeptListings
from tierfs.cache.loading import load
from tierfs.cache.objects import Entry
from tierfs.cache.serve import Fill
from tierfs.cache.stash import Stash
from tierfs.cache.whole import WholeFill, whole_fill
from tierfs.config import CHUNK_SIZE, MIN_FREE_DEFAULT

log = logging.getLogger(__name__)

__all__ = [
    "Cache",
    "CacheBusy",
    "CacheConflict",
    "CacheStats",
    "CacheUnwritable",
    "CachedObject",
    "ChunkCorrupt",
    "Entry",
    "Fill",
    "WholeFill",
    "this_boot",
    "tree_digest",
]



@dataclass(frozen=True)
class CacheStats:
    used_bytes: int
    capacity: int
    objects: int
    open_objects: int
    evictions_total: int
    evicted_bytes_total: int
    corrupt_chunks_total: int


class Cache:
    """The cache dir of one mount. Call `bind` before `open`.

    `chunk_size` applies when the dir is created; an existing cache keeps its own
    (see `self.chunk_size`), so a config change never invalidates pending data.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        capacity: int,
        chunk_size: int = CHUNK_SIZE,
        min_free: int = MIN_FREE_DEFAULT,
        boot_id: bytes | None = None,
    ) -> None:
        if capacity <= 0 or chunk_size <= 0 or min_free < 0:
            raise ValueError("capacity and chunk_size must be positive, min_free not negative")
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self._objects = str(self.objects_dir) + os.sep  # + fid hex: a path without pathlib per open
        self.capacity = capacity
        self.min_free = min_free
        self.boot_id = boot_id or this_boot()
        self._lock_fd = take_dir(self.root, self.objects_dir)
        try:
            self.index, self.chunk_size, self._identity = open_index(self.root, chunk_size)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.used = self.index.counter(b"used")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._open: dict[bytes, Entry] = {}
        self._busy: set[bytes] = set()
        self._filled: EntryCore | None = None  # the entry filled last (eviction sheds it first)
        self.stash = Stash()
        self.listings = KeptListings(self.index)  # directory listings kept across remounts
        self.evictor = Evictor(self)
        self._corrupt = 0
        self._closed = False

    def set_limits(self, capacity: int, min_free: int) -> None:
        """The mount's sizes (cache/sizing.py), decided once the cache says what it
        already holds; eviction follows them from the next store on."""
        if capacity <= 0 or min_free < 0:
            raise ValueError("capacity must be positive, min_free not negative")
        self.capacity, self.min_free = capacity, min_free

    def close(self) -> None:
        """Persist what open entries learnt (uses, dirty sizes) and unlock the dir.
        Entries are unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self.evictor.stop()
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
        try:
            for e in entries:
                e._close(persist=True)
        finally:
            self.index.close()
            os.close(self._lock_fd)

    # -- identity ----------------------------------------------------------------

    def bind(self, identity: str) -> bool:
        """Tie the cache to one source (`Store.identity`). True if it already held
        this source's data; False if it starts empty for it. Data of another source
        is wiped, unless some of it still awaits upload (CacheConflict)."""
        with self._lock:
            if self._open:
                raise RuntimeError("Cache.bind() while entries are open")
        if self._identity == identity:
            return True
        if self._identity is not None or self.index.count():
            pending = sum(1 for _, rec in self.index.records() if rec.state != CLEAN)
            if pending:
                raise CacheConflict(
                    f"cache dir {self.root} holds {pending} pending upload(s) of another source "
                    f"({self._identity}); flush them with that source mounted, or move the dir away"
                )
        with self.index.write() as wt:
            wt.wipe()
            wt.set_meta(b"identity", identity.encode())
        self.account(wt.used_delta)
        self.stash.clear()
        with os.scandir(self.objects_dir) as it:
            for de in it:
                self._unlink(de.name)
        self._identity = identity
        return False

    # -- lookups -------------------------------------------------------------------

    def lookup(self, key: str) -> CachedObject | None:
        kh = key_hash(key)
        with self._lock:
            e = self._open.get(kh)
        if e is not None:
            return e.describe()
        rec = self.index.record(kh)
        return None if rec is None else rec.public()

    def attrs_of(self, keys: list[str]) -> dict[str, bytes]:
        """The POSIX attribute records (posix.Known, packed) kept for these keys."""
        got = self.index.attrs_of(key_hash(k) for k in keys)
        return {k: got[kh] for k in keys if (kh := key_hash(k)) in got} if got else {}

    def set_attrs(self, records: dict[str, bytes | None]) -> None:
        """Keep (or, for None, forget) POSIX attribute records. They outlive
        eviction: a few dozen bytes each, read again after a remount."""
        self.index.set_attrs((key_hash(k), v) for k, v in records.items())

    def iter_objects(self, prefix: str = "") -> Iterator[CachedObject]:
        """Every cached object whose key starts with `prefix` (a full index scan)."""
        for kh, rec in self.index.records():
            if rec.key.startswith(prefix):
                with self._lock:
                    e = self._open.get(kh)
                yield rec.public() if e is None else e.describe()

    def stats(self) -> CacheStats:
        objects = self.index.count()
        with self._lock:
            return CacheStats(
                used_bytes=self.used,
                capacity=self.capacity,
                objects=objects,
                open_objects=len(self._open),
                evictions_total=self.evictor.evictions,
                evicted_bytes_total=self.evictor.evicted_bytes,
                corrupt_chunks_total=self._corrupt,
            )

    # -- open / release ------------------------------------------------------------

    def open(self, key: str, etag: str, size: int, mtime: float, *, use: bool = True) -> Entry:
        """Get or create the entry of (key, etag). Cached chunks of another etag are
        dropped first (ETag validation); an open entry of an older version is
        detached and keeps serving its holders. A dirty or sealed object is the newer
        version and is returned as is (use its `size`). Each open needs a `release`.
        `use=False`: not a use for eviction (fetching ahead of a reader: the
        reader's own open is the use, and a second would promote a one-pass read)."""
        if self._identity is None:
            raise RuntimeError("Cache.bind(identity) must come before open()")
        if size < 0:
            raise ValueError(f"negative size {size} for {key!r}")
        e = self._acquire(key, (etag, size, mtime), touch=use)
        assert e is not None
        return e

    def open_seen(self, key: str, etag: str, size: int, mtime: float) -> Entry | None:
        """`open` of the version a caller saw in the namespace, where ETag "" is a
        file this mount wrote (the namespace learns no ETag for it until its
        upload lands): whatever tier 1 holds for the key, in any state. Its upload
        may land between the caller's look and this open, turning the record
        clean under the store's ETag, and `open(key, "", 0)` would drop that as
        another version and serve an empty file (a read right after an
        os.replace read 0 bytes now and then). None if tier 1 holds nothing for
        it (landed and evicted since): the caller asks the store."""
        if etag:
            return self.open(key, etag, size, mtime)
        return self.open_existing(key, use=True)

    def open_existing(self, key: str, *, use: bool = False) -> Entry | None:
        """The entry of an object the index already holds, in whatever state; None if
        unknown. Not a use for eviction unless `use` (the uploader and recovery
        open this way; a reader's open is one)."""
        return self._acquire(key, None, touch=use)

    def held(self, key: str) -> Entry | None:
        """The entry of `key` if it is open right now (a reference is taken: release
        it), else None. Not a use for eviction."""
        kh = key_hash(key)
        with self._lock:
            while kh in self._busy:
                self._cond.wait()
            e = self._open.get(kh)
            if e is not None:
                e._refs += 1
            return e

    def retain(self, entry: Entry) -> bool:
        """One more reference on an entry its caller holds open, without waiting
        (in-memory only: callable from the trio loop); release it. False if the
        entry is no longer the key's open one (replaced, removed)."""
        with self._lock:
            if entry._refs <= 0 or self._open.get(entry._kh) is not entry:
                return False
            entry._refs += 1
            return True

    def reclaim(self) -> None:
        """Evict clean data until within capacity and above the free-space floor,
        waiting for it (before retrying a local write that hit ENOSPC)."""
        self.evictor.make_room()

    def put_whole(self, key: str, etag: str, mtime: float, data: memoryview) -> bool:
        """Keep a whole clean object fetched ahead of its reader (a small object of a
        directory walk): `whole_fill` with the bytes at hand."""
        with self.whole_fill(key, etag, mtime, len(data)) as fill:
            pwrite_all(fill.fd, data, 0)
            fill.commit(chunk_digests(data, self.chunk_size))
        return fill.kept

    def whole_fill(self, key: str, etag: str, mtime: float, size: int) -> AbstractContextManager[WholeFill]:
        """A new tier-1 file for a whole clean object (whole.py)."""
        if self._identity is None:
            raise RuntimeError("Cache.bind(identity) must come before whole_fill()")
        return whole_fill(self, key, etag, mtime, size)

    def release(self, entry: Entry) -> None:
        self.release_many([entry])

    def release_many(self, entries: list[Entry]) -> None:
        """`release` each entry; the uses (and dirty growth) of those whose last
        reference this was written in one index transaction. A walk through
        10,000 small files closes one a file: a worker hop and a commit each were
        a fifth of the daemon's CPU (issue 21). The transaction takes no entry's
        I/O lock (a fetch still storing into an entry holds it while it waits for
        the index): the records are re-read in it, the fds closed after it."""
        closing: list[Entry] = []  # last references, claimed
        gone: list[Entry] = []  # last references of entries no longer the key's
        try:
            for entry in entries:
                with self._lock:
                    if entry._refs <= 0:
                        raise ValueError(f"{entry.key!r}: released more often than opened")
                    entry._refs -= 1
                    while entry._refs == 0:
                        kh = entry._kh
                        if self._open.get(kh) is not entry:
                            gone.append(entry)
                            break
                        if kh not in self._busy:
                            del self._open[kh]
                            self._busy.add(kh)
                            closing.append(entry)
                            break
                        self._cond.wait()
            persisting = [e for e in closing if e._unpersisted()]
            if persisting:
                with self.index.write() as wt:
                    for entry in persisting:
                        entry._persist_in(wt)
                self.account(wt.used_delta)
                for entry in persisting:
                    entry._persisted()
        finally:
            for entry in closing:
                try:
                    entry._close(persist=False)
                finally:
                    self._unclaim(entry._kh)
            for entry in gone:
                entry._close(persist=False)

    def _acquire(self, key: str, want: tuple[str, int, float] | None, touch: bool) -> Entry | None:
        kh = key_hash(key)
        now = time.time_ns()
        with self._lock:
            while kh in self._busy:
                self._cond.wait()
            old = self._open.get(kh)
            if old is not None and (want is None or old._serves(want[0], want[1])):
                old._refs += 1
                if touch:
                    old._touch(now)
                return old
            self._busy.add(kh)
        loaded = None
        try:
            if old is not None:
                self._detach(old)
            loaded = load(self, kh, key, want, now if touch else None)
            return loaded
        finally:
            with self._lock:
                if loaded is not None:
                    self._open[kh] = loaded
                self._busy.discard(kh)
                self._cond.notify_all()

    # -- dropping objects ------------------------------------------------------------

    def evict(self, key: str) -> bool:
        """Drop an object's cached data (see Evictor.evict)."""
        return self.evictor.evict(key)

    def remove(self, key: str) -> bool:
        """Forget an object whatever its state (unlink, discarding a quarantined
        file). Open entries of it are detached: their holders keep what they have."""
        kh = key_hash(key)
        with self._claimed(kh) as e:
            if e is not None:
                self._detach(e)
                return True
            return self._drop(kh) is not None

    def sync(self) -> None:
        """Make the index's committed changes durable (a rename that is a commit point)."""
        self.index.sync()

    def rename(self, old_key: str, new_key: str) -> bool:
        """Move an object's record to another key (a pending file's rename is just
        this); whatever `new_key` held is removed. False if `old_key` is unknown."""
        okh, nkh = key_hash(old_key), key_hash(new_key)
        if okh == nkh:
            return self.lookup(old_key) is not None
        first, second = sorted((okh, nkh))
        with self._claimed(first) as e1, self._claimed(second) as e2:
            src, dst = (e1, e2) if first == okh else (e2, e1)
            if src is None and self.index.record(okh) is None:
                return False
            if dst is not None:
                self._detach(dst)
            else:
                self._drop(nkh)
            with src._io if src is not None else nullcontext():
                with self.index.write() as wt:
                    rec = wt.record(okh)
                    assert rec is not None
                    wt.put(okh, rec, None)
                    wt.put(nkh, None, replace(rec, key=new_key))
                if src is not None:
                    src.key, src._kh = new_key, nkh
            if src is not None:
                with self._lock:
                    del self._open[okh]
                    self._open[nkh] = src
            return True

    def _drop(self, kh: bytes) -> Record | None:
        """Forget a claimed, unopened object: records first, then its file."""
        with self.index.write() as wt:
            rec = wt.record(kh)
            if rec is not None:
                wt.drop(kh, rec)
        self.account(wt.used_delta)
        if rec is not None:
            self._unlink(rec.fid.hex())
        return rec

    def _detach(self, e: Entry) -> None:
        """Cut an open entry of a claimed key loose (see Entry._detach)."""
        e._detach()
        with self._lock:
            if self._open.get(e._kh) is e:
                del self._open[e._kh]
        self._unlink(e._fid.hex())

    def _unlink(self, name: str) -> None:
        if integrity.FID_NAME.fullmatch(name):
            self.stash.forget(bytes.fromhex(name))
        (self.objects_dir / name).unlink(missing_ok=True)

    # -- integrity (integrity.py) -----------------------------------------------------

    def verify_all(self) -> list[tuple[str, list[int]]]:
        """Check every object's checksummed chunks; [(key, bad chunks)] (dropped)."""
        return integrity.verify_all(self)

    def finish_seal(self, key: str) -> bool:
        """After a restart: take the checksums a seal left to take, if its bytes can
        be vouched for (False if they cannot)."""
        return integrity.finish_seal(self, key)

    def collect_orphans(self) -> int:
        """Delete object files without a record; how many."""
        return integrity.collect_orphans(self)

    # -- eviction's side of the claims ---------------------------------------------------

    def _open_by_recency(self) -> list[Entry]:
        """Open entries, the one filled last first, then least recently used first."""
        with self._lock:
            filled = self._filled
            last = None if filled is None else self._open.get(filled._kh)
            if last is not filled:
                last = None
            others = sorted((e for e in self._open.values() if e is not last), key=lambda e: e._access_ns)
        return others if last is None else [last, *others]

    # -- small shared helpers ---------------------------------------------------------

    @contextmanager
    def _claimed(self, kh: bytes) -> Iterator[Entry | None]:
        """Hold a key exclusively; yields its open entry, if any."""
        with self._lock:
            while kh in self._busy:
                self._cond.wait()
            self._busy.add(kh)
            e = self._open.get(kh)
        try:
            yield e
        finally:
            self._unclaim(kh)

    def _try_claim(self, kh: bytes) -> bool:
        """Claim a key that is neither claimed nor open, without waiting."""
        with self._lock:
            if kh in self._busy or kh in self._open:
                return False
            self._busy.add(kh)
            return True

    def _unclaim(self, kh: bytes) -> None:
        with self._lock:
            self._busy.discard(kh)
            self._cond.notify_all()

    def account(self, delta: int, filled: EntryCore | None = None) -> None:
        """Tier 1 holds `delta` bytes more (`filled`: fetched into that open entry);
        the Evictor hears of it, and makes room beside the fill if needed."""
        if delta:
            with self._lock:
                self.used += delta
                used = self.used
                if filled is not None and delta > 0:
                    self._filled = filled
            self.evictor.counted(used)

    def count_corrupt(self, n: int) -> None:
        with self._lock:
            self._corrupt += n
