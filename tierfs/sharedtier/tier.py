"""The shared tier as a source of the read path's fetcher (read/sources.py).

It sits before the origin in the fetcher's list. A wanted range of a clean
object at least one block long is served in whole blocks: a want that is one
block (the fetcher's parts are block-sized by default) is filled straight into
the fetch's own buffer; any other (a part of several blocks, a demand read of a
few chunks) has each block it touches filled into memory of its own (from the
memory budget) and written whole into the tier-1 file (`Sink.tier1`: a block
may reach past the want, so its other chunks are not fetched again). Each
block comes from the shared tier if a verified copy is (or becomes) there,
else from the origin (`below`) with single-flight across nodes (claims.py).

It answers None ("ask the origin") for what it does not serve: objects under
one block, pages of small reads and reads through memory that are not whole
blocks, and everything while the shared tier is unreachable (`DOWN_FOR`
seconds, one warning line). A shared tier that fails never fails a read: a
block it cannot deliver comes from the origin.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import trio

from tierfs.budget import MemoryBudget
from tierfs.cache.directio import pwrite_all
from tierfs.read.sources import Below, Got, MemorySink, Sink, Tier1Fill, Want
from tierfs.sharedtier.blocks import BlockRef, Blocks
from tierfs.sharedtier.claims import BlockFlight, Counts, Runner, SharedError
from tierfs.store.base import UNREACHABLE_KINDS, Store

log = logging.getLogger(__name__)

DOWN_FOR = 30.0  # seconds an unreachable shared tier is not asked


class SharedTier:
    name = "shared"

    def __init__(
        self,
        store: Store,
        *,
        source: str,
        prefix: str = "",
        block: int,
        lease: float,
        origin_fetches: int,
        conditional: bool,
        secret: bytes | None,
        budget: MemoryBudget,
        meta: Runner,
        data: Runner,
        upload: Runner,
    ) -> None:
        self.store = store
        self.block = block
        # Blocks are named by the origin's bucket and full key (its prefix and the
        # mount's key), not by the endpoint that reaches it: nodes that reach one
        # bucket through different endpoints (a proxy, a VPC endpoint) share blocks.
        self.source, self.prefix = source, prefix
        self.blocks = Blocks(secret)
        self.counts = Counts()
        self.budget = budget
        self.flight = BlockFlight(store, self.blocks, lease=lease, conditional=conditional,
                                  meta=meta, data=data, upload=upload, counts=self.counts,
                                  origin_fetches=origin_fetches)
        self._down_until = -1.0
        self._warned: set[str] = set()

    @property
    def url(self) -> str:
        return self.store.url

    async def fetch(self, want: Want, sink: Sink, below: Below) -> Got | None:
        if want.size < self.block or not want.etag or trio.current_time() < self._down_until:
            return None
        first, last = want.start // self.block, (want.end - 1) // self.block
        if (first == last and want.start == first * self.block
                and want.end == min(want.start + self.block, want.size)):
            await self._deliver(want, first, sink.buffer(), sink, below)
            return Got(want.etag)  # the fetcher lands the buffer
        spans = [(i * self.block, min((i + 1) * self.block, want.size))
                 for i in range(first, last + 1)]
        fills = [sink.tier1(a, b) for a, b in spans]  # made now, entered in a worker
        if any(f is None for f in fills):
            return None
        try:
            async with trio.open_nursery() as n:
                for index, fill in zip(range(first, last + 1), fills, strict=True):
                    assert fill is not None
                    n.start_soon(self._into_tier1, want, index, fill, sink, below)
        except BaseExceptionGroup as group:  # one block's failure is the want's, as it was
            first_error: BaseException = group
            while isinstance(first_error, BaseExceptionGroup):
                first_error = first_error.exceptions[0]
            raise first_error from None
        return Got(want.etag, in_tier1=True)

    async def _into_tier1(self, want: Want, index: int, fill: AbstractContextManager[Tier1Fill],
                          sink: Sink, below: Below) -> None:
        """One whole block into memory of its own (from the budget), then into the
        tier-1 file."""
        n = min(self.block, want.size - index * self.block)
        await self.budget.take(n)
        try:
            buf = memoryview(bytearray(n))
            await self._deliver(want, index, buf, sink, below)
            await sink.worker(_write, fill, buf, index * self.block)
        finally:
            self.budget.give(n)

    async def _deliver(self, want: Want, index: int, buf: memoryview, sink: Sink,
                       below: Below) -> None:
        """Block `index` of `want`'s object into `buf`: from the shared tier, or from
        the origin through it (claimed, put), or from the origin alone where the
        shared tier fails."""
        a = index * self.block
        block = Want(want.key, want.etag, want.size, a, a + len(buf))

        async def origin(view: memoryview) -> int:
            await below(block, MemorySink(view, sink.worker))
            return len(view)

        ref = BlockRef(self.source, self.prefix + want.key, want.etag, want.size, self.block, index)
        try:
            await self.flight.fill(ref, buf, origin)
        except SharedError as exc:
            self.counts.errors += 1
            self._failed(exc)
            await origin(buf)

    def _failed(self, exc: SharedError) -> None:
        if exc.kind in UNREACHABLE_KINDS:
            self._down_until = trio.current_time() + DOWN_FOR
            log.warning("shared tier %s unreachable (%s): reading from the origin for %.0f s",
                        self.url, exc, DOWN_FOR)
        elif exc.kind not in self._warned:
            self._warned.add(exc.kind)
            log.warning("shared tier %s: %s; reading such blocks from the origin", self.url, exc)
        else:
            log.debug("shared tier %s: %s", self.url, exc)

    def figures(self) -> dict[str, float]:
        """Its counters as live metrics (metrics.LIVE_METRICS names)."""
        c = self.counts
        return {
            "tierfs_shared_hits": c.hits,
            "tierfs_shared_misses": c.misses,
            "tierfs_shared_corrupt_blocks": c.corrupt,
            "tierfs_shared_claims_won": c.claims_won,
            "tierfs_shared_claims_lost": c.claims_lost,
            "tierfs_shared_claims_expired": c.claims_expired,
            "tierfs_shared_own_fetches": c.own_fetches,
            "tierfs_shared_puts": c.puts,
            "tierfs_shared_put_failures": c.put_failures,
            "tierfs_shared_errors": c.errors,
            "tierfs_shared_bytes_from_shared": c.shared_bytes,
            "tierfs_shared_bytes_from_origin": c.origin_bytes,
        }


def _write(fill_cm: AbstractContextManager[Tier1Fill], buf: memoryview, at: int) -> None:
    """(worker) `buf` into its claimed tier-1 range at object offset `at`, committed
    (its chunks' checksums read back and taken)."""
    with fill_cm as fill:
        pwrite_all(fill.fd, buf, at)
        fill.commit(None)
