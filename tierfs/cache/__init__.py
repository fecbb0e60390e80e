"""Tier 1: the node-local block cache (DESIGN §4).

A blocking, thread-safe library: the daemon calls it from worker threads and
every call is short. Layout of the cache dir (0700):

  lock          flock()ed by the one process using the dir
  index.lmdb/   records, chunk checksums, eviction order (index.py)
  objects/<fid> one sparse file per object, same offsets as in the store (objects.py)

Locks, in the only order they nest: Entry._io, an LMDB write transaction,
Entry._mu, Cache._lock (a leaf: in-memory work only). Cache._evict_mu is taken with no
other lock held. A key being loaded, evicted, removed or renamed is "claimed"
(in `_busy`), which keeps opens and last releases of it waiting meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import lmdb
import xxhash

from tierfs.cache import listings
from tierfs.cache.directio import pwrite_all
from tierfs.cache.index import (
    ABSENT,
    CLEAN,
    DIRTY,
    FORMAT_VERSION,
    PROBATION,
    SEALED,
    STORED,
    VERIFIED,
    WRITTEN,
    CachedObject,
    Index,
    Record,
    key_hash,
    order_key,
)
from tierfs.cache.objects import ChunkCorrupt, Entry, Fill, file_digests, nchunks, tree_digest
from tierfs.cache.space import punch_hole
from tierfs.config import CHUNK_SIZE, MIN_FREE_DEFAULT
from tierfs.store.base import Listing

log = logging.getLogger(__name__)

FREE_RECHECK = 0.5  # seconds between statvfs calls of the free-space floor
FREE_RECHECK_BYTES = 64 << 20  # ...or sooner, after this much growth of our own

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
    "tree_digest",
]

_FID_NAME = re.compile(r"[0-9a-f]{32}")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def this_boot() -> bytes:
    """This boot of the machine. Unknown: a fresh value, so every restart of the
    daemon counts as one of the machine (the safe side)."""
    try:
        return uuid.UUID(BOOT_ID.read_text().strip()).bytes
    except (OSError, ValueError):
        return os.urandom(16)


_STASH_BYTES = 16 << 20  # verified bitmaps kept for closed objects (1 byte per chunk)
PAGE_STASH_OBJECTS = 4096  # closed objects whose fetched pages are remembered


class CacheBusy(Exception):
    """Another process holds the cache dir."""


class CacheUnwritable(Exception):
    """The cache dir cannot be created or written; the message is one line."""


class CacheConflict(Exception):
    """The cache dir belongs to another source and still holds its pending uploads."""


class WholeFill:
    """A whole object's new tier-1 file, being written by its fetcher (`Cache.whole_fill`)."""

    def __init__(self, cache: Cache, fd: int, fid: bytes,
                 identity: tuple[str, str, float, int]) -> None:
        self.fd = fd
        self.start = 0
        self.end = identity[3]
        self.fid = fid
        self.identity = identity  # key, etag, mtime, size
        self.kept = False
        self._cache = cache

    def commit(self, digests: Sequence[bytes] | None = None) -> None:
        """The whole object is written: keep it, with its xxh3-64 checksums per chunk
        in order (None: read back and taken here), unless refused (see whole_fill):
        `kept` says which."""
        self.kept = self._cache._commit_whole(self, digests)


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
        self._lock_fd = self._take_dir()
        try:
            self.index = Index(self.root / "index.lmdb")
        except (OSError, lmdb.Error) as e:
            os.close(self._lock_fd)
            raise CacheUnwritable(f"cache dir {self.root}: cannot open index.lmdb: {e}") from None
        try:
            with self.index.write() as wt:
                if wt.meta(b"version") is None:
                    wt.set_meta(b"version", FORMAT_VERSION.to_bytes(4, "big"))
                    wt.set_meta(b"chunk_size", chunk_size.to_bytes(8, "big"))
                version = int.from_bytes(wt.meta(b"version") or b"", "big")
                self.chunk_size = int.from_bytes(wt.meta(b"chunk_size") or b"", "big")
                identity = wt.meta(b"identity")
            if version != FORMAT_VERSION:
                raise CacheUnwritable(
                    f"cache dir {self.root}: index format {version} is not supported "
                    f"(this tierfs writes {FORMAT_VERSION}); move the directory away"
                )
        except BaseException as e:
            self.index.close()
            os.close(self._lock_fd)
            if isinstance(e, OSError):
                raise CacheUnwritable(
                    f"cache dir {self.root} is not writable: {e.strerror}"
                ) from None
            raise
        self._identity = None if identity is None else identity.decode()
        self._used = self.index.counter(b"used")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._open: dict[bytes, Entry] = {}
        self._busy: set[bytes] = set()
        self._stashed: OrderedDict[bytes, bytearray] = OrderedDict()
        self._stashed_bytes = 0
        # Pages of absent chunks fetched by small random reads (Entry._pages) of
        # closed objects, for their next open; dropped with the file (`_unlink`).
        self._page_stash: OrderedDict[bytes, dict[int, int]] = OrderedDict()
        self._evict_mu = threading.Lock()
        self._free_seen = (-FREE_RECHECK - 1.0, 0, 0)  # (monotonic, free bytes, used then)
        self._evictions = self._evicted_bytes = self._corrupt = 0
        self._closed = False

    def _take_dir(self) -> int:
        """Create the dir 0700, take its lock, probe that it can hold sparse files."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            self.objects_dir.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise CacheUnwritable(f"cache dir {self.root} is not writable: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CacheBusy(f"cache dir {self.root} is in use by another tierfs process") from None
        except OSError as e:
            os.close(fd)
            raise CacheUnwritable(f"cache dir {self.root} cannot be locked: {e.strerror}") from None
        probe = self.objects_dir / ".probe"
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
                    f"cache dir {self.root}: its filesystem cannot punch holes (sparse files needed)"
                ) from None
            raise CacheUnwritable(f"cache dir {self.root} is not writable: {e.strerror}") from None
        return fd

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
        with self._lock:
            self._stashed.clear()
            self._stashed_bytes = 0
            self._page_stash.clear()
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
                used_bytes=self._used,
                capacity=self.capacity,
                objects=objects,
                open_objects=len(self._open),
                evictions_total=self._evictions,
                evicted_bytes_total=self._evicted_bytes,
                corrupt_chunks_total=self._corrupt,
            )

    # -- kept directory listings (listings.py) ------------------------------------

    def keep_listing(self, prefix: str, listing: Listing, listed_at: float) -> None:
        """Keep the store's complete listing of `prefix`, taken at `listed_at`."""
        self.index.keep_listing(prefix, listings.encode(prefix, listing, listed_at))

    def kept_listing(self, prefix: str) -> tuple[Listing, float] | None:
        """The listing kept for `prefix` and when it was taken, if any (one that
        cannot be read is dropped)."""
        raw = self.index.kept_listing(prefix)
        if raw is None:
            return None
        try:
            return listings.decode(prefix, raw)
        except listings.BadListing as exc:
            log.warning("%s: dropped", exc)
            self.index.drop_listings([prefix])
            return None

    def drop_listings(self, prefixes: Iterable[str]) -> None:
        self.index.drop_listings(prefixes)

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
        """Evict clean data until within capacity and above the free-space floor
        (before retrying a local write that hit ENOSPC)."""
        self.make_room(None)

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
            loaded = self._load(kh, key, want, now if touch else None)
            return loaded
        finally:
            with self._lock:
                if loaded is not None:
                    self._open[kh] = loaded
                self._busy.discard(kh)
                self._cond.notify_all()

    def _load(
        self, kh: bytes, key: str, want: tuple[str, int, float] | None, touch_ns: int | None
    ) -> Entry | None:
        """Build the entry of a claimed key from its record (or a new record)."""
        rec = self.index.record(kh)
        if (
            rec is not None
            and want is not None
            and rec.state == CLEAN
            and (rec.etag, rec.size) != want[:2]
        ):
            self._drop(kh)
            rec = None
        if rec is None:
            return None if want is None else self._create(kh, key, *want, touch_ns=touch_ns)
        fd = os.open(self._objects + rec.fid.hex(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if rec.state == DIRTY:
                # Never sealed: the file itself is the truth, the record may lag behind.
                size = os.fstat(fd).st_size
                e = Entry(
                    self,
                    kh,
                    rec,
                    fd,
                    bytearray((WRITTEN,)) * nchunks(size, self.chunk_size),
                    size=size,
                    cached=rec.cached,
                    touch_ns=touch_ns,
                    reused=True,
                )
                e._resize(size)
                return e
            n = nchunks(rec.size, self.chunk_size)
            unhashed = rec.state == SEALED and self.index.unhashed(rec.fid) is not None
            states = self._unstash(rec.fid, n)
            if states is None:
                # Sealed with checksums still to take: the chunks without one are
                # this mount's own bytes (finish_seal decides after a restart).
                states = bytearray((WRITTEN,) if unhashed else (ABSENT,)) * n
                for i in self.index.present_chunks(rec.fid):
                    if i < n:
                        states[i] = STORED
            if os.fstat(fd).st_size != rec.size:
                # The file was lost or cut: whatever the index says, its chunks are gone.
                os.ftruncate(fd, 0)
                os.ftruncate(fd, rec.size)
                with self._lock:
                    self._page_stash.pop(rec.fid, None)
                with self.index.write() as wt:
                    cur = wt.record(kh)
                    assert cur is not None  # the key is claimed: nobody else drops it
                    wt.drop_all_chunks(rec.fid)
                    rec = replace(cur, cached=0)
                    wt.put(kh, cur, rec)
                self.account(wt.used_delta)
                states = bytearray(n)
            return Entry(
                self,
                kh,
                rec,
                fd,
                states,
                size=rec.size,
                cached=rec.cached,
                touch_ns=touch_ns,
                reused=True,
                unhashed=unhashed,
            )
        except BaseException:
            os.close(fd)
            raise

    def put_whole(self, key: str, etag: str, mtime: float, data: memoryview) -> bool:
        """Keep a whole clean object fetched ahead of its reader (a small object of a
        directory walk): `whole_fill` with the bytes at hand."""
        cs = self.chunk_size
        digests = [xxhash.xxh3_64_digest(data[o : o + cs]) for o in range(0, len(data), cs)]
        with self.whole_fill(key, etag, mtime, len(data)) as fill:
            pwrite_all(fill.fd, data, 0)
            fill.commit(digests)
        return fill.kept

    @contextmanager
    def whole_fill(self, key: str, etag: str, mtime: float, size: int) -> Iterator[WholeFill]:
        """A new tier-1 file for a whole clean object, for its fetcher to write
        (`WholeFill.fd`, from any thread) and `commit`: its record and chunk
        checksums then go in with one index transaction, its chunks marked
        verified for its next open. Not a use for eviction. The file is nobody's
        until the commit (a fresh name), so the key is not held while the bytes
        arrive; the commit refuses it (False, the file dropped) where tier 1 has
        this version already, holds a local one, or the key is open (its holder
        fetches what it lacks). One transaction instead of the three of open,
        store and release: index commits were a sixth of the daemon's CPU in a
        walk through 10,000 small objects (issue 21)."""
        if self._identity is None:
            raise RuntimeError("Cache.bind(identity) must come before whole_fill()")
        fid = self._new_fid(key, etag)
        name = fid.hex()
        fd = os.open(self._objects + name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fill = WholeFill(self, fd, fid, (key, etag, mtime, size))
        try:
            yield fill
        finally:
            os.close(fd)
            if not fill.kept:
                (self.objects_dir / name).unlink(missing_ok=True)
        if fill.kept:
            self.make_room(None)

    def _commit_whole(self, fill: WholeFill, digests: Sequence[bytes] | None) -> bool:
        key, etag, mtime, size = fill.identity
        cs = self.chunk_size
        if digests is None:
            digests = list(file_digests(fill.fd, 0, size, cs))
        if len(digests) != nchunks(size, cs):
            raise ValueError(f"{len(digests)} checksums for {nchunks(size, cs)} chunks of {key!r}")
        kh = key_hash(key)
        with self._lock:
            if kh in self._busy or kh in self._open:
                return False
            self._busy.add(kh)
        try:
            rec = self.index.record(kh)
            if rec is not None:
                if rec.state != CLEAN or (rec.etag, rec.size, rec.cached) == (etag, size, size):
                    return False
                self._drop(kh)  # an older version, or a part of this one
            now = time.time_ns()
            rec = Record(fill.fid, key, etag, size, mtime, size, now, now, CLEAN, PROBATION)
            with self.index.write() as wt:
                wt.put(kh, None, rec)
                wt.put_chunks(fill.fid, 0, digests)
            self.account(wt.used_delta)
            self.stash(fill.fid, bytearray((VERIFIED,)) * len(digests))
            return True
        finally:
            with self._lock:
                self._busy.discard(kh)
                self._cond.notify_all()

    def _new_fid(self, key: str, etag: str) -> bytes:
        """A new tier-1 file's id: a hash of source, key and etag; the random tail
        keeps a key that comes back (after a rename or removal) off a file still
        held elsewhere."""
        assert self._identity is not None
        name = "\0".join((self._identity, key, etag)).encode("utf-8", "surrogateescape")
        return xxhash.xxh3_128_digest(name + os.urandom(8))

    def _create(
        self, kh: bytes, key: str, etag: str, size: int, mtime: float, *, touch_ns: int | None
    ) -> Entry:
        assert self._identity is not None
        now = time.time_ns()
        fid = self._new_fid(key, etag)
        rec = Record(fid, key, etag, size, mtime, 0, now, now, CLEAN, PROBATION)
        with self.index.write() as wt:
            wt.put(kh, None, rec)
        fd = os.open(
            self._objects + fid.hex(), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
        )
        try:
            # Never an ftruncate to 0: ext4 (auto_da_alloc, meant for replace-by-
            # truncate) then writes the file's delayed allocations out at its last
            # close, which took 0.38 s per GiB written after it (safetensors' file).
            if size:
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return Entry(
            self,
            kh,
            rec,
            fd,
            bytearray(nchunks(size, self.chunk_size)),
            size=size,
            cached=0,
            touch_ns=touch_ns,
            reused=False,
        )

    # -- dropping objects ------------------------------------------------------------

    def evict(self, key: str) -> bool:
        """Drop an object's cached data. Refused (False) for dirty or sealed objects;
        chunks of an open object being read right now stay."""
        kh = key_hash(key)
        with self._claimed(kh) as e:
            if e is not None:
                freed = e._drop_unpinned()
                if freed < 0:
                    return False
                self._count_eviction(freed)
                return True
            with self.index.write() as wt:
                rec = wt.record(kh)
                if rec is not None and rec.state == CLEAN:
                    wt.drop(kh, rec)
            self.account(wt.used_delta)
            if rec is None or rec.state != CLEAN:
                return False
            self._unlink(rec.fid.hex())
            self._count_eviction(rec.cached)
            return True

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
        with self._lock:
            states = (
                self._stashed.pop(bytes.fromhex(name), None) if _FID_NAME.fullmatch(name) else None
            )
            if states is not None:
                self._stashed_bytes -= len(states)
            if _FID_NAME.fullmatch(name):
                self._page_stash.pop(bytes.fromhex(name), None)
        (self.objects_dir / name).unlink(missing_ok=True)

    # -- integrity -------------------------------------------------------------------

    def verify_all(self) -> list[tuple[str, list[int]]]:
        """Check every checksummed chunk of every object against its file, drop the
        bad ones, and remove files no record names. Returns [(key, bad chunks)]."""
        report = []
        for _, rec in self.index.records():
            if rec.state == DIRTY:
                continue
            e = self._acquire(rec.key, None, touch=False)
            if e is None:
                continue
            try:
                bad = e.verify()
            finally:
                self.release(e)
            if bad:
                report.append((e.key, bad))
        self.collect_orphans()
        return report

    def finish_seal(self, key: str) -> bool:
        """After a restart: take the checksums a seal left to take, if its bytes can
        be vouched for: the machine has not restarted since (its page cache held
        every byte the writer wrote; a daemon crash loses none), or they were
        fsynced. False if they cannot (closed without fsync, then the machine went
        down: a torn file would be uploaded as if whole)."""
        rec = self.index.record(key_hash(key))  # most seals have none to take: no open
        mark = None if rec is None else self.index.unhashed(rec.fid)
        if mark is None:
            return True
        boot, durable = mark
        if boot != self.boot_id and not durable:
            return False
        e = self._acquire(key, None, touch=False)
        if e is None:
            return True
        try:
            e.take_all_digests()
            log.info("%r: checksums taken after a restart (its seal %s)", key,
                     "was fsynced" if durable else "was made in this boot")
            return True
        finally:
            self.release(e)

    def collect_orphans(self) -> int:
        """Delete object files without a record (left by a crash between a record
        change and its file change). Returns how many. A scan of the index: run it
        in the background, not on the mount path."""
        with os.scandir(self.objects_dir) as it:
            names = {de.name for de in it if _FID_NAME.fullmatch(de.name)}
        for _, rec in self.index.records():
            names.discard(rec.fid.hex())
        for name in names:
            self._unlink(name)
        return len(names)

    # -- eviction ---------------------------------------------------------------------

    def _deficit(self) -> int:
        """Bytes to free: over capacity, or under the free-space floor. The free
        space is measured at most every FREE_RECHECK seconds (it is asked on every
        growing write) and estimated in between from our own growth."""
        with self._lock:
            used = self._used
        over = used - self.capacity
        if not self.min_free:
            return over
        now = time.monotonic()
        checked, free, used_then = self._free_seen
        if now - checked > FREE_RECHECK or used - used_then > FREE_RECHECK_BYTES:
            st = os.statvfs(self.root)
            free, used_then = st.f_bavail * st.f_frsize, used
            self._free_seen = (now, free, used_then)
        return max(over, self.min_free - (free - max(0, used - used_then)))

    def make_room(self, current: Entry | None) -> None:
        """Evict until within bounds: whole unopened objects in policy order, then
        chunks of open ones (`current` first: a file bigger than the cache sheds its
        own past), never dirty or sealed data."""
        if self._deficit() <= 0:
            return
        with self._evict_mu:
            need = self._deficit()
            while need > 0 and (victim := self._claim_victim()) is not None:
                need -= self._evict_claimed(*victim)
            if need <= 0:
                return
            with self._lock:
                others = sorted(
                    (e for e in self._open.values() if e is not current), key=lambda e: e._access_ns
                )
            for e in [current, *others] if current is not None else others:
                freed = e._shed(need)
                if freed:
                    self._count_eviction(freed)
                    need -= freed
                    if need <= 0:
                        return

    def _claim_victim(self) -> tuple[bytes, bytes] | None:
        for okey in self.index.order_keys():
            kh = okey[9:]
            with self._lock:
                if kh in self._open or kh in self._busy:
                    continue
                self._busy.add(kh)
            return okey, kh
        return None

    def _evict_claimed(self, okey: bytes, kh: bytes) -> int:
        try:
            with self.index.write() as wt:
                rec = wt.record(kh)
                if rec is None or rec.state != CLEAN or order_key(kh, rec) != okey:
                    wt.delete_order_key(okey)  # left over from a lost transaction
                    rec = None
                else:
                    wt.drop(kh, rec)
            self.account(wt.used_delta)
        finally:
            self._unclaim(kh)
        if rec is None:
            return 0
        self._unlink(rec.fid.hex())
        self._count_eviction(rec.cached)
        return rec.cached

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

    def _unclaim(self, kh: bytes) -> None:
        with self._lock:
            self._busy.discard(kh)
            self._cond.notify_all()

    def account(self, delta: int) -> None:
        if delta:
            with self._lock:
                self._used += delta

    def _count_eviction(self, nbytes: int) -> None:
        with self._lock:
            self._evictions += 1
            self._evicted_bytes += nbytes

    def count_corrupt(self, n: int) -> None:
        with self._lock:
            self._corrupt += n

    def stash(self, fid: bytes, states: bytearray) -> None:
        """Keep a closed object's bitmap, verified marks included, for its next open.
        Sound because a closed object's chunks only change by dropping it whole,
        which discards the stash (`_unlink`)."""
        with self._lock:
            old = self._stashed.pop(fid, None)
            self._stashed_bytes += len(states) - (len(old) if old is not None else 0)
            self._stashed[fid] = states
            while self._stashed_bytes > _STASH_BYTES:
                self._stashed_bytes -= len(self._stashed.popitem(last=False)[1])

    def take_pages(self, fid: bytes) -> dict[int, int]:
        """The fetched pages an object had when it was last closed (Entry._pages)."""
        with self._lock:
            return self._page_stash.pop(fid, None) or {}

    def keep_pages(self, fid: bytes, pages: dict[int, int]) -> None:
        with self._lock:
            self._page_stash[fid] = pages
            while len(self._page_stash) > PAGE_STASH_OBJECTS:
                self._page_stash.popitem(last=False)

    def _unstash(self, fid: bytes, n: int) -> bytearray | None:
        with self._lock:
            states = self._stashed.pop(fid, None)
            if states is not None:
                self._stashed_bytes -= len(states)
        return states if states is not None and len(states) == n else None
