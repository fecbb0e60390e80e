"""The origin through the transfer engine (store/crt.py), straight into tier 1.

Where the fetch has a tier-1 file (`Sink.tier1`), the runtime's body pieces
(one per part, tens of MiB) are written into it at their object offsets from
the runtime's own threads, and their per-chunk xxh3-64 checksums taken there
from the same piece, then committed: no part buffer, no copy into Python
memory, no worker-thread write. Fetches that go to memory only (pages of a
small read, a read through memory) take the store's GET into the sink's buffer,
also through the runtime.
"""

from __future__ import annotations

import threading

import xxhash

from tierfs.read.sources import Below, Got, Sink, Want
from tierfs.store.base import StoreError
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
        n = len(want)
        fill_cm = sink.tier1(want.start, want.end)
        if fill_cm is None:
            got = self.store.get_range_into(want.key, want.start, n, sink.buffer(), want.etag)
            if got.length != n:
                raise StoreError(f"short read of {want.key!r}: {got.length} of {n} bytes")
            sink.land()
            return Got(got.etag, got.metadata)
        with fill_cm as fill:
            sums = _Digests(fill.start, self.chunk_size)
            length = fill.end - fill.start
            got = self.store.get_range_to_file(want.key, fill.start, length, fill.fd, want.etag,
                                               sums.add)
            if got.length != length:
                raise StoreError(f"short read of {want.key!r}: {got.length} of {length} bytes")
            fill.commit(sums.sums)
        return Got(got.etag, got.metadata, in_tier1=True)
