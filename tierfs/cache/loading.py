"""Opening an object's tier-1 file: the Entry of a claimed key, from its index
record (or a new record), with what tier 1 holds of it (its chunk map)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Protocol

import xxhash

from tierfs.cache.chunkmap import nchunks
from tierfs.cache.core import Home
from tierfs.cache.index import ABSENT, CLEAN, DIRTY, PROBATION, SEALED, STORED, WRITTEN, Record
from tierfs.cache.objects import Entry


class Loading(Home, Protocol):
    """The Cache, as loading sees it (cache/__init__.py)."""

    _identity: str | None  # the source it is bound to
    _objects: str  # the objects dir, with a trailing separator

    def _drop(self, kh: bytes) -> Record | None: ...


def new_fid(identity: str, key: str, etag: str) -> bytes:
    """A new tier-1 file's id: a hash of source, key and etag; the random tail
    keeps a key that comes back (after a rename or removal) off a file still
    held elsewhere."""
    name = "\0".join((identity, key, etag)).encode("utf-8", "surrogateescape")
    return xxhash.xxh3_128_digest(name + os.urandom(8))


def load(
    cache: Loading, kh: bytes, key: str, want: tuple[str, int, float] | None, touch_ns: int | None
) -> Entry | None:
    """Build the entry of a claimed key from its record (or a new record)."""
    rec = cache.index.record(kh)
    if (
        rec is not None
        and want is not None
        and rec.state == CLEAN
        and (rec.etag, rec.size) != want[:2]
    ):
        cache._drop(kh)
        rec = None
    if rec is None:
        return None if want is None else create(cache, kh, key, *want, touch_ns=touch_ns)
    fd = os.open(cache._objects + rec.fid.hex(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if rec.state == DIRTY:
            # Never sealed: the file itself is the truth, the record may lag behind.
            size = os.fstat(fd).st_size
            e = Entry(
                cache,
                kh,
                rec,
                fd,
                bytearray((WRITTEN,)) * nchunks(size, cache.chunk_size),
                size=size,
                cached=rec.cached,
                touch_ns=touch_ns,
                reused=True,
            )
            e.local._resize(size)
            return e
        n = nchunks(rec.size, cache.chunk_size)
        unhashed = rec.state == SEALED and cache.index.unhashed(rec.fid) is not None
        states = cache.stash.take_states(rec.fid, n)
        if states is None:
            # Sealed with checksums still to take: the chunks without one are
            # this mount's own bytes (finish_seal decides after a restart).
            states = bytearray((WRITTEN,) if unhashed else (ABSENT,)) * n
            for i in cache.index.present_chunks(rec.fid):
                if i < n:
                    states[i] = STORED
        if os.fstat(fd).st_size != rec.size:
            # The file was lost or cut: whatever the index says, its chunks are gone.
            os.ftruncate(fd, 0)
            os.ftruncate(fd, rec.size)
            cache.stash.forget(rec.fid)
            with cache.index.write() as wt:
                cur = wt.record(kh)
                assert cur is not None  # the key is claimed: nobody else drops it
                wt.drop_all_chunks(rec.fid)
                rec = replace(cur, cached=0)
                wt.put(kh, cur, rec)
            cache.account(wt.used_delta)
            states = bytearray(n)
        return Entry(
            cache,
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


def create(
    cache: Loading, kh: bytes, key: str, etag: str, size: int, mtime: float, *, touch_ns: int | None
) -> Entry:
    assert cache._identity is not None
    now = time.time_ns()
    fid = new_fid(cache._identity, key, etag)
    rec = Record(fid, key, etag, size, mtime, 0, now, now, CLEAN, PROBATION)
    with cache.index.write() as wt:
        wt.put(kh, None, rec)
    fd = os.open(
        cache._objects + fid.hex(), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
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
        cache,
        kh,
        rec,
        fd,
        bytearray(nchunks(size, cache.chunk_size)),
        size=size,
        cached=0,
        touch_ns=touch_ns,
        reused=False,
    )
