"""The origin through the transfer engine (store/crt.py), straight into tier 1.

Only the GETs the runtime makes faster go through it (`crt.runtime_get`: small
objects and small ranges); a longer range is fetched through botocore into the
sink's buffer and landed as StoreSource does. Where the fetch has a tier-1 file
(`Sink.tier1`) and the runtime can write into it (`CrtEngine.writes_files`: the
patched binding, third_party/awscrt), the runtime GETs the range into the file
at its object offsets from its own threads; the per-chunk xxh3-64 checksums are
then read back by the commit in this worker thread (the hash does not hold the
GIL for the bytes): no body byte passes through Python. A full cache disk met
by the runtime's writes fetches again into the sink's memory, whose landing
says NoRoom as any fetch's does (the reader then reads through memory). With
the stock binding the runtime's body pieces are written into the file from this
thread and hashed from the same piece. Fetches that go to memory only (pages of
a small read, a read through memory) take the store's GET into the sink's buffer.
"""

from __future__ import annotations

import errno
import threading

import xxhash

from tierfs.read.sources import Below, Got, Sink, Want
from tierfs.store.base import Received, StoreError
from tierfs.store.crt import runtime_get
from tierfs.store.s3 import S3Store


class _Digests:
    """xxh3-64 of each chunk of [start, end), from pieces that arrive in order."""

    def __init__(self, start: int, chunk_size: int) -> None:
        self.start = start
        self.chunk_size = chunk_size
        self.sums: list[bytes] = []
        self._mu = threading.Lock()

    def add(self, offset: int, piece: bytes) -> None:
        """A piece at object `offset`: chunk-aligned, whole chunks but at the end."""
        cs = self.chunk_size
        view = memoryview(piece)
        with self._mu:
            if offset != self.start + len(self.sums) * cs or (offset - self.start) % cs:
                raise StoreError(f"body piece at {offset} out of order", kind="io")
            self.sums += [xxhash.xxh3_64_digest(view[o : o + cs]) for o in range(0, len(view), cs)]


class EngineSource:
    name = "crt"

    def __init__(self, store: S3Store, chunk_size: int) -> None:
        self.store = store
        self.chunk_size = chunk_size

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got:
        return await sink.worker(self._get, want, sink)

    def _get(self, want: Want, sink: Sink) -> Got:
        # Long ranges go through botocore into the sink's buffer (crt.runtime_get).
        fill_cm = sink.tier1(want.start, want.end) if runtime_get(len(want)) else None
        if fill_cm is not None:
            try:
                with fill_cm as fill:
                    length = fill.end - fill.start
                    if self.store.engine is not None and self.store.engine.writes_files:
                        got = self.store.get_range_to_file(want.key, fill.start, length, fill.fd,
                                                           want.etag)
                        _check(want, got, length)
                        fill.commit(None)
                    else:
                        sums = _Digests(fill.start, self.chunk_size)
                        got = self.store.get_range_to_file(want.key, fill.start, length, fill.fd,
                                                           want.etag, sums.add)
                        _check(want, got, length)
                        fill.commit(sums.sums)
                return Got(got.etag, got.metadata, in_tier1=True)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        got = self.store.get_range_into(want.key, want.start, len(want), sink.buffer(), want.etag)
        _check(want, got, len(want))
        sink.land()
        return Got(got.etag, got.metadata)


def _check(want: Want, got: Received, length: int) -> None:
    if got.length != length:
        raise StoreError(f"short read of {want.key!r}: {got.length} of {length} bytes")
