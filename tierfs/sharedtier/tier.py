"""The shared tier as one source of the read path's fetches.

The fetcher asks it for one aligned block of an origin object (its key, the
ETag the namespace knows it by, its size) with a buffer of that block's length
and the rest of the chain (`below`, the origin GET). It answers with the bytes
filled, or None: "not mine, ask the next source" (an object under one block,
or a shared tier that is unreachable or refusing). A shared tier that fails
never fails a read: the origin serves it, and an unreachable one is left alone
for `DOWN_FOR` seconds (one warning line).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from tierfs.sharedtier.blocks import BlockRef, Blocks
from tierfs.sharedtier.claims import BlockFlight, Counts, Runner, SharedError
from tierfs.store.base import UNREACHABLE_KINDS, Store

log = logging.getLogger(__name__)

DOWN_FOR = 30.0  # seconds an unreachable shared tier is not asked

# The rest of the chain below the shared tier: fill the view with the object's
# bytes from `start`; the count read.
Below = Callable[[int, memoryview], Awaitable[int]]


class SharedTier:
    name = "shared"

    def __init__(
        self,
        store: Store,
        *,
        source: str,
        block: int,
        lease: float,
        conditional: bool,
        secret: bytes | None,
        meta: Runner,
        data: Runner,
        upload: Runner,
    ) -> None:
        self.store = store
        self.block = block
        self.source = source
        self.blocks = Blocks(secret)
        self.counts = Counts()
        self.flight = BlockFlight(store, self.blocks, lease=lease, conditional=conditional,
                                  meta=meta, data=data, upload=upload, counts=self.counts)
        self._down_until = -1.0
        self._warned: set[str] = set()

    @property
    def url(self) -> str:
        return self.store.url

    async def fetch(
        self, key: str, etag: str, size: int, start: int, buf: memoryview, below: Below
    ) -> int | None:
        """Fill `buf` with the block of (key, etag) that starts at `start`; the bytes
        filled, or None for "ask the next source". `buf` is the block's length
        (up to the object's end); what `below` raises passes through."""
        if size < self.block or not etag:
            return None
        if start % self.block or len(buf) != min(self.block, size - start):
            raise ValueError(f"shared tier asked [{start}, +{len(buf)}) of {key!r}: "
                             f"not one {self.block}-byte block")
        if trio.current_time() < self._down_until:
            return None
        ref = BlockRef(self.source, key, etag, size, self.block, start // self.block)
        try:
            await self.flight.fill(ref, buf, lambda view: below(start, view))
        except SharedError as exc:
            self.counts.errors += 1
            self._failed(exc)
            return None
        return len(buf)

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
