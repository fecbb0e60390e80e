"""LMDB index of the tier-1 cache (DESIGN §4).

One environment, five sub-databases. Every key is a fixed-size hash, so object
keys of any length fit (LMDB keys stop at 511 bytes):

  objects  key_hash(16)                          -> Record
  chunks   file_id(16) + chunk_index(4, BE)      -> xxh3_64 digest (8)
           file_id(16) + UNHASHED(4)              -> boot_id(16) + durable(1): a sealed
                                                    file whose checksums are still
                                                    being taken (LocalCopy.take_digests)
  order    segment(1) + rank_ns(8, BE) + key_hash(16) -> b""   (clean objects only)
  listings key_hash(prefix)                      -> a kept directory listing (listings.py)
  meta     version, identity, chunk_size, used, protected
  attrs    key_hash(16)                          -> POSIX attributes of one object
                                                    version (posix.Known; not evicted)

`order` is the eviction order itself (see eviction.py); `used` and `protected`
are running byte totals kept exact by `WriteTxn.put`, so opening a cache with
a million objects reads two numbers instead of scanning.

Commits do not fsync (`sync=False`): read-cache records are cheap to lose and
every chunk is checksummed, so a record that outlived its data after a power
loss is caught on first read. State changes that must survive (sealing a
write-back file) call `Index.sync()`. No `writemap`: with a shared writable map
a full disk arrives as SIGBUS instead of ENOSPC.

The data file keeps RESERVE bytes (at most 1/16 of a small cache filesystem)
allocated past its end (`hold`): when writers have filled the cache disk, the
commits that give space back (an upload marked landed, an eviction) still have
pages to grow into.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from tierfs.cache.space import hold

FORMAT_VERSION = 1
CLEAN, DIRTY, SEALED = 0, 1, 2
STATE_NAMES = ("clean", "dirty", "sealed")
PROBATION, PROTECTED = 0, 1  # segments; eviction.py owns the policy
# Per-chunk states in an open Entry's in-memory bitmap (the index itself only
# stores checksums): STORED has a checksum not yet verified by this process.
ABSENT, STORED, VERIFIED, WRITTEN = 0, 1, 2, 3

# The chunk index of a sealed file's "checksums not taken yet" marker: it lives
# with the digests, so whatever drops a file's chunk records drops it too.
UNHASHED = 0xFFFFFFFF

_HDR = struct.Struct("<16sQQdQQBBHH")
_I64 = struct.Struct("<q")
RESERVE = 8 << 20  # bytes held past the end of data.mdb for the index to grow into


def _bytes(raw: bytes | memoryview) -> bytes:
    """An LMDB value: bytes already (the environment does not use buffers=True)."""
    return raw if isinstance(raw, bytes) else bytes(raw)


def key_hash(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode("utf-8", "surrogateescape"))


def chunk_key(fid: bytes, index: int) -> bytes:
    return fid + index.to_bytes(4, "big")


def order_key(kh: bytes, rec: Record) -> bytes:
    return bytes((rec.seg,)) + rec.rank_ns.to_bytes(8, "big") + kh


@dataclass(frozen=True)
class CachedObject:
    """What the index knows about one object (degraded mode, `tierfs cache ls`)."""

    key: str
    etag: str
    size: int
    mtime: float
    cached_bytes: int
    last_access: float
    state: str  # "clean" | "dirty" | "sealed"


@dataclass(slots=True)
class Record:
    fid: bytes  # names the sparse file: objects/<fid hex>
    key: str
    etag: str
    size: int
    mtime: float
    cached: int  # bytes of present chunks (the whole size while dirty/sealed)
    access_ns: int  # last use, wall clock
    rank_ns: int  # position inside its segment (demotion moves it, access does not lie)
    state: int
    seg: int

    def encode(self) -> bytes:
        k = self.key.encode("utf-8", "surrogateescape")
        e = self.etag.encode("utf-8", "surrogateescape")
        head = _HDR.pack(
            self.fid,
            self.size,
            self.cached,
            self.mtime,
            self.access_ns,
            self.rank_ns,
            self.state,
            self.seg,
            len(k),
            len(e),
        )
        return head + k + e

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        fid, size, cached, mtime, access, rank, state, seg, kl, el = _HDR.unpack_from(raw)
        o = _HDR.size
        key = raw[o : o + kl].decode("utf-8", "surrogateescape")
        etag = raw[o + kl : o + kl + el].decode("utf-8", "surrogateescape")
        return cls(fid, key, etag, size, mtime, cached, access, rank, state, seg)

    def public(self) -> CachedObject:
        return CachedObject(
            self.key,
            self.etag,
            self.size,
            self.mtime,
            self.cached,
            self.access_ns / 1e9,
            STATE_NAMES[self.state],
        )


def _protected_bytes(rec: Record | None) -> int:
    return rec.cached if rec is not None and rec.state == CLEAN and rec.seg == PROTECTED else 0


class WriteTxn:
    """One LMDB write transaction. Every record change goes through `put`, which
    keeps the order database and the byte totals consistent with the records."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self.ix = index
        self.txn = txn
        self.used_delta = 0  # applied to the in-memory total after commit

    def record(self, kh: bytes) -> Record | None:
        raw = self.txn.get(kh, db=self.ix.objects)
        return None if raw is None else Record.decode(_bytes(raw))

    def meta(self, name: bytes) -> bytes | None:
        raw = self.txn.get(name, db=self.ix.meta)
        return None if raw is None else _bytes(raw)

    def set_meta(self, name: bytes, value: bytes) -> None:
        self.txn.put(name, value, db=self.ix.meta)

    def counter(self, name: bytes) -> int:
        raw = self.meta(name)
        return 0 if raw is None else _I64.unpack(raw)[0]

    def _bump(self, name: bytes, delta: int) -> None:
        if delta:
            self.set_meta(name, _I64.pack(self.counter(name) + delta))

    def put(self, kh: bytes, old: Record | None, new: Record | None) -> None:
        """Replace record `old` (as read in this txn, or None) by `new` (None deletes)."""
        if old is not None and old.state == CLEAN:
            self.txn.delete(order_key(kh, old), db=self.ix.order)
        if new is not None:
            self.txn.put(kh, new.encode(), db=self.ix.objects)
            if new.state == CLEAN:
                self.txn.put(order_key(kh, new), b"", db=self.ix.order)
        elif old is not None:
            self.txn.delete(kh, db=self.ix.objects)
        du = (new.cached if new is not None else 0) - (old.cached if old is not None else 0)
        self._bump(b"used", du)
        self._bump(b"protected", _protected_bytes(new) - _protected_bytes(old))
        self.used_delta += du

    def delete_order_key(self, okey: bytes) -> None:
        self.txn.delete(okey, db=self.ix.order)

    def put_chunks(self, fid: bytes, first: int, digests: Iterable[bytes]) -> list[int]:
        """Record digests for chunks first, first+1, ...; return the indexes that were new."""
        new = []
        for i, d in enumerate(digests, first):
            if self.txn.replace(chunk_key(fid, i), d, db=self.ix.chunks) is None:
                new.append(i)
        return new

    def drop_chunks(self, fid: bytes, indexes: Iterable[int]) -> list[int]:
        """Delete chunk records; return the indexes that existed."""
        return [i for i in indexes if self.txn.delete(chunk_key(fid, i), db=self.ix.chunks)]

    def mark_unhashed(self, fid: bytes, boot_id: bytes, durable: bool) -> None:
        """A sealed file's checksums are still to be taken; its bytes are in the page
        cache of boot `boot_id` (and on disk too if `durable`)."""
        self.txn.put(chunk_key(fid, UNHASHED), boot_id + bytes((durable,)), db=self.ix.chunks)

    def drop_unhashed(self, fid: bytes) -> None:
        self.txn.delete(chunk_key(fid, UNHASHED), db=self.ix.chunks)

    def drop_all_chunks(self, fid: bytes) -> None:
        cur = self.txn.cursor(db=self.ix.chunks)
        if cur.set_range(fid):
            while cur.key()[:16] == fid and cur.delete():
                pass

    def drop(self, kh: bytes, rec: Record) -> None:
        """Forget an object: its record, order key and chunk records."""
        self.drop_all_chunks(rec.fid)
        self.put(kh, rec, None)

    def wipe(self) -> None:
        for db in (self.ix.objects, self.ix.chunks, self.ix.order, self.ix.attrs, self.ix.listings):
            self.txn.drop(db, delete=False)
        self.used_delta -= self.counter(b"used")
        self.set_meta(b"used", _I64.pack(0))
        self.set_meta(b"protected", _I64.pack(0))


class Index:
    def __init__(self, path: Path, *, map_size: int = 64 << 30) -> None:
        path.mkdir(mode=0o700, exist_ok=True)  # lmdb would give the directory the file mode
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            subdir=True,
            max_dbs=6,
            max_readers=1024,
            sync=False,
            metasync=False,
            readahead=False,
            mode=0o600,
        )
        self.env.reader_check()
        self.objects = self.env.open_db(b"objects")
        self.chunks = self.env.open_db(b"chunks")
        self.order = self.env.open_db(b"order")
        self.listings = self.env.open_db(b"listings")
        self.meta = self.env.open_db(b"meta")
        self.attrs = self.env.open_db(b"attrs")
        self._data_fd = os.open(path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
        self._can_hold = True
        st = os.statvfs(path)
        self._reserve = min(RESERVE, st.f_blocks * st.f_frsize // 16)
        self._hold_reserve()

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        os.close(self._data_fd)

    def _hold_reserve(self) -> None:
        """Top the space held past the data file's end back up to the reserve once
        half of it is used. One fstat per commit; on a full disk, as much as fits."""
        if not self._can_hold:
            return
        st = os.fstat(self._data_fd)
        held = st.st_blocks * 512 - st.st_size
        if held >= self._reserve // 2:
            return
        want = self._reserve
        while want > max(held, 0):
            try:
                hold(self._data_fd, st.st_size, want)
                return
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self._can_hold = False  # e.g. ZFS: the index grows as plain LMDB does
                    return
                if e.errno != errno.ENOSPC:
                    raise
                want //= 2

    def sync(self) -> None:
        """Make every committed transaction durable (journal-grade state changes)."""
        self.env.sync(True)

    def read(self) -> lmdb.Transaction:
        return self.env.begin()

    @contextmanager
    def write(self) -> Iterator[WriteTxn]:
        """A write transaction, committed on success. LMDB failures become OSError
        (ENOSPC for a full disk or map) so callers handle one exception family."""
        try:
            with self.env.begin(write=True) as txn:
                yield WriteTxn(self, txn)
            self._hold_reserve()
        except (lmdb.DiskError, lmdb.MapFullError) as e:
            raise OSError(errno.ENOSPC, f"cache index: {e}") from e
        except lmdb.Error as e:
            raise OSError(errno.EIO, f"cache index: {e}") from e

    def record(self, kh: bytes) -> Record | None:
        with self.read() as txn:
            raw = txn.get(kh, db=self.objects)
        return None if raw is None else Record.decode(_bytes(raw))

    def attrs_of(self, khs: Iterable[bytes]) -> dict[bytes, bytes]:
        """The attribute records of these key hashes (those that have one)."""
        with self.read() as txn:
            if not txn.stat(self.attrs)["entries"]:
                return {}
            out = {}
            for kh in khs:
                raw = txn.get(kh, db=self.attrs)
                if raw is not None:
                    out[kh] = _bytes(raw)
            return out

    def set_attrs(self, changes: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Write (or, for None, drop) attribute records."""
        with self.write() as wt:
            for kh, raw in changes:
                if raw is None:
                    wt.txn.delete(kh, db=self.attrs)
                else:
                    wt.txn.put(kh, raw, db=self.attrs)

    def counter(self, name: bytes) -> int:
        with self.read() as txn:
            raw = txn.get(name, db=self.meta)
        return 0 if raw is None else _I64.unpack(raw)[0]

    def digests(self, fid: bytes, indexes: Iterable[int]) -> dict[int, bytes]:
        with self.read() as txn:
            out = {}
            for i in indexes:
                d = txn.get(chunk_key(fid, i), db=self.chunks)
                if d is not None:
                    out[i] = _bytes(d)
            return out

    def unhashed(self, fid: bytes) -> tuple[bytes, bool] | None:
        """(boot id, durable) of a sealed file whose checksums are not all taken."""
        with self.read() as txn:
            raw = txn.get(chunk_key(fid, UNHASHED), db=self.chunks)
        return None if raw is None else (_bytes(raw)[:-1], bool(raw[-1]))

    def present_chunks(self, fid: bytes) -> Iterator[int]:
        """Indexes with a checksum record: one cursor range scan (loads a bitmap lazily)."""
        with self.read() as txn:
            cur = txn.cursor(db=self.chunks)
            if not cur.set_range(fid):
                return
            for k in cur.iternext(values=False):
                if k[:16] != fid:
                    return
                i = int.from_bytes(k[16:20], "big")
                if i != UNHASHED:
                    yield i

    def kept_listing(self, prefix: str) -> bytes | None:
        with self.read() as txn:
            raw = txn.get(key_hash(prefix), db=self.listings)
        return None if raw is None else _bytes(raw)

    def keep_listing(self, prefix: str, raw: bytes) -> None:
        with self.write() as wt:
            wt.txn.put(key_hash(prefix), raw, db=self.listings)

    def drop_listings(self, prefixes: Iterable[str]) -> None:
        with self.write() as wt:
            for p in prefixes:
                wt.txn.delete(key_hash(p), db=self.listings)

    def records(self, batch: int = 1024) -> Iterator[tuple[bytes, Record]]:
        """Every record, read in short transactions so a slow consumer pins no pages."""
        after = b""
        while True:
            rows: list[tuple[bytes, Record]] = []
            with self.read() as txn:
                cur = txn.cursor(db=self.objects)
                found = cur.set_range(after) if after else cur.first()
                if found and after and cur.key() == after:
                    found = cur.next()
                while found and len(rows) < batch:
                    rows.append((bytes(cur.key()), Record.decode(_bytes(cur.value()))))
                    found = cur.next()
            yield from rows
            if len(rows) < batch:
                return
            after = rows[-1][0]

    def order_keys(self) -> Iterator[bytes]:
        """The eviction order, least valuable first (probation before protected, by rank)."""
        with self.read() as txn:
            for okey in txn.cursor(db=self.order).iternext(values=False):
                yield _bytes(okey)

    def count(self) -> int:
        with self.read() as txn:
            return txn.stat(self.objects)["entries"]
