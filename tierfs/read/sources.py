"""Where fetched bytes come from: the source protocol of the fetcher (fetcher.py).

A fetch asks an ordered list of sources for a byte range of one object
version (`Want`); the first that has it delivers the bytes to the fetch's
`Sink`, either of two ways:

- into memory: `sink.buffer()` (an aligned part buffer, or memory of the
  range's own size), then `sink.land()` in the same worker thread: the fetcher
  writes them into tier 1 (O_DIRECT from the aligned buffer,
  cache/directio.py), keeps them in memory for the reads that follow, or only
  serves them (a read through memory). A source that does not call `land`
  has the fetcher call it, in a worker hop of its own (one more hop a fetch);
- into the tier-1 file itself, where the sink has one: `with sink.tier1(a, b)
  as fill:` claims chunk-aligned [a, b) of the object's cache file (no eviction
  punches it, no local write starts meanwhile); the source `pwrite`s the bytes
  at their object offsets into `fill.fd` from any thread (a C thread of the
  transfer engine included) and calls `fill.commit(digests)` with the chunks'
  xxh3-64 checksums, or with None to have them read back and taken (xxhash
  drops the GIL for the bytes). Its `Got` then says `in_tier1=True`. [a, b)
  may be larger than the wanted range (a shared tier's whole block).

`fetch` is async: a source runs its blocking work through `sink.worker(fn,
...)` (a worker thread of this fetch's kind, workers.py, which first drops a
fetch nobody waits for any more: `Abandoned`), and may wait on the trio loop
without holding a worker slot (a shared tier waiting out another node's
claim). It answers None for a miss: the next source is asked. It is handed
`below` (the sources after it), for a source that must see the bytes a later
one fetches (a shared tier putting a block it claimed). Single-flight,
readahead, the memory budget and degraded mode stay the fetcher's and the
reader's decisions. The store adapters' GETs return what the response said of
the object (`Received`: ETag, user metadata); a source passes it up in its
`Got`, and the fetcher passes it to the namespace.

Examples (sketches, not code of this module):

    class CrtSource:  # issue 34: awscrt.s3.S3Client moves the bytes
        async def fetch(self, want, sink, below):
            return await sink.worker(self._get, want, sink)

        def _get(self, want, sink):
            fill_cm = sink.tier1(want.start, want.end)
            if fill_cm is None:  # pages of a small read, a read through memory
                r = self.engine.get_into(want.key, want.start, len(want), sink.buffer(), want.etag)
                sink.land()
                return Got(r.etag, r.metadata)
            with fill_cm as fill:  # on_body(chunk, offset): pwrite(fill.fd, chunk, want.start + offset)
                r = self.engine.get_to_file(want.key, want.start, len(want), fill.fd, want.start, want.etag)
                fill.commit(None)
            return Got(r.etag, r.metadata, in_tier1=True)

    class SharedTier:  # issue 35: a bucket near the nodes, fixed-size verified blocks
        async def fetch(self, want, sink, below):
            a, b = self.block_of(want)  # the aligned block holding the range (larger)
            data = await sink.worker(self.get_verified_block, want, a, b)  # None: not there
            if data is None:
                if not await self.claim_or_wait(want, a):  # polls on the loop, no slot held
                    return None  # the origin, next
                data = bytearray(b - a)
                got = await below(Want(want.key, want.etag, want.size, a, b), MemorySink(data))
                await sink.worker(self.put_block, want, a, data)
            await sink.worker(self.deliver, want, sink, a, data)  # sink.tier1(a, b) +
            return Got(want.etag, None, in_tier1=...)  # commit, or copy into buffer() + land()
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from tierfs.store.base import Store, StoreError

T = TypeVar("T")


@dataclass(frozen=True)
class Want:
    """Bytes [start, end) of version `etag` of object `key` (`size` bytes long)."""

    key: str
    etag: str
    size: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Got:
    """A source's answer: what the response said of the object (its ETag, its user
    metadata where the source saw it), and whether the bytes went into the tier-1
    file (`in_tier1`) rather than into `Sink.buffer`."""

    etag: str
    metadata: dict[str, str] | None = None
    in_tier1: bool = False


class Tier1Fill(Protocol):
    """Chunk-aligned [start, end) of an object's tier-1 file, claimed for a fill."""

    fd: int  # open for writing at the object's own offsets
    start: int
    end: int

    def commit(self, digests: Sequence[bytes] | None = None) -> None:
        """The bytes are written: record them (xxh3-64 per chunk, in order; None:
        read them back and take them)."""


class Sink(Protocol):
    """Where one fetch's bytes go."""

    def buffer(self) -> memoryview:
        """Memory for the wanted range (exactly its length)."""

    def land(self) -> None:
        """(In a worker thread) `buffer()` holds the wanted bytes: put them where this
        fetch keeps them (tier 1, memory)."""

    def tier1(self, start: int, end: int) -> AbstractContextManager[Tier1Fill] | None:
        """The object's tier-1 file for chunk-aligned [start, end) (it may reach past
        the wanted range, to the object's end at most); None where this fetch's
        bytes go to memory only (pages of a small read, a read through memory)."""

    async def worker(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread of this fetch's kind."""


Below = Callable[["Want", Sink], Awaitable[Got]]


class Source(Protocol):
    name: str  # for logs and metrics

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        """Deliver the bytes of `want` to `sink`; None if this source does not have
        them (the next is asked). `below` asks the sources after this one.
        Failures raise (StoreError, OSError)."""


class MemorySink:
    """A sink that is just memory (a source fetching for itself: a shared tier's
    block from the origin): its worker threads are the caller's."""

    def __init__(self, buf: memoryview | bytearray,
                 worker: Callable[..., Awaitable[Any]]) -> None:
        self._buf = memoryview(buf)
        self._worker = worker

    def buffer(self) -> memoryview:
        return self._buf

    def land(self) -> None:
        """Nothing to put anywhere: the caller has the buffer."""

    def tier1(self, start: int, end: int) -> AbstractContextManager[Tier1Fill] | None:
        return None

    async def worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._worker(fn, *args)


class StoreSource:
    """The origin through the store adapter's own GETs (botocore's connection pool,
    or file://): into the sink's buffer, landed in the same worker hop."""

    name = "store"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got:
        return await sink.worker(self._get, want, sink)

    def _get(self, want: Want, sink: Sink) -> Got:
        n = len(want)
        got = self.store.get_range_into(want.key, want.start, n, sink.buffer(), want.etag)
        if got.length != n:
            raise StoreError(f"short read of {want.key!r}: {got.length} of {n} bytes")
        sink.land()
        return Got(got.etag, got.metadata)


async def ask(sources: Sequence[Source], want: Want, sink: Sink) -> Got:
    """The first answer of `sources`, in order."""
    for i, source in enumerate(sources):
        got = await source.fetch(want, sink, partial(ask, sources[i + 1 :]))
        if got is not None:
            return got
    raise StoreError(f"no source holds {want.key!r} [{want.start}, {want.end})")
