"""Claims and leases: single-flight across nodes with the store's own conditional writes.

A node missing a block asks the shared tier; if the block is not there (or does
not verify) it tries to claim it: a conditional create (`If-None-Match: *`) of a
small claim object beside the block. The one node that creates it fetches the
block from the origin, puts it, and deletes the claim. A node claims only while
one of its few origin slots is free (slots.py), oldest fill first: a herd keeps
a few blocks on the origin link at a time, and they land in the order they are
read. Every other node looks for the block with bounded backoff (50 ms doubling
to 500 ms), at the claim about once a second, all through a listing of the
object's blocks that the node's fills share (looks.py; a first look included:
in a herd nearly every fill starts before its block lands, and a GET or HEAD
of each was a 404 per fill), and:

- takes the block as soon as it appears and verifies: a GET pinned to the
  listed ETag, whose answer carries the checksum (no HEAD first);
- claims it itself if the claim disappears without a block (the claimer's
  origin fetch failed: it deletes its claim so nobody waits for nothing);
- takes the claim over once it has waited `lease` seconds on it (counted on
  its own monotonic clock from when it first saw that claim), or at once if the
  claim's Last-Modified says it is older than the lease (a claim left by a node
  killed long ago): a conditional replace (`If-Match` on the claim's ETag), so
  that one waiter fetches and puts while the others wait for that one.

No node waits on one claim longer than the lease; after a takeover, the new
claimer (alive a moment ago) has a lease of its own. A killed claimer so costs
the others one lease plus one block's fetch.

Clocks only decide efficiency, never correctness: a node whose wall clock runs
ahead takes a fresh claim over early (one more origin fetch of that block);
the bytes served are always ones that verified or came from the origin.

Where the store does not enforce conditional writes there are no claims:
every node that misses fetches from the origin and puts the block (a later
node then finds it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any

import trio

from tierfs.sharedtier.blocks import SUM_META, BlockRef, Blocks
from tierfs.sharedtier.looks import Looks
from tierfs.sharedtier.slots import Line, OriginSlots, Slot
from tierfs.store.base import ObjectInfo, Store, StoreError

log = logging.getLogger(__name__)

# An async runner of a blocking call: Workers.meta / .data / .upload in the daemon.
Runner = Callable[..., Awaitable[Any]]
# One put of a block object: its ETag and checksum (an ETag alone does not tell a
# put that changed only the metadata).
Version = tuple[str, str | None]
# The rest of the fetch chain (the origin): fills the view, returns the bytes read.
Origin = Callable[[memoryview], Awaitable[int]]

POLL_FIRST = 0.05  # seconds before a waiter's first look for the block
POLL_MAX = 0.5  # its longest pause: a block is taken at most this late
POLL_GROWTH = 2.0
CLAIM_EVERY = 1.0  # seconds between looks at the claim waited on (released? taken over?)
# A fill looks through a listing of the object's blocks and claims that its
# node's other fills share (looks.py): one that is at most this many seconds old. With the next shard claimed ahead
# (read/prefetch.py) blocks mostly land before their reader needs them, and a
# herd on two cores spent its CPU on the looks: 0.5 s (and POLL_MAX 0.5) instead
# of 0.15 (0.25) cut the shared store's CPU 23 -> 21 s and each daemon's about
# 8 -> 7 s per herd (bench/sharedtier.py, 4 nodes, 1 GiB, one run each).
LOOK_FRESH = 0.5
SHARED_GETS = 2  # blocks a node takes from the shared tier at once, oldest first (slots.py)
# Wall-clock slack before a claim's Last-Modified alone (not this node's own
# wait) counts as expired: clocks of nodes and store may differ this much.
CLOCK_SKEW = 5.0


_REFUSED = "<If-Match refused>"  # _take_over's answer where the store has no If-Match


class Outcome(Enum):
    HIT = "shared"  # taken from the shared tier, verified
    FILLED = "filled"  # claimed (or taken over), fetched from the origin, put
    OWN = "own"  # fetched from the origin with no claim (no conditional writes), put


@dataclass
class Counts:
    """What the shared tier did; read by metrics and `tierfs status`."""

    hits: int = 0
    misses: int = 0  # blocks this node did not find (valid) at first look
    corrupt: int = 0  # block objects that failed verification: never served
    claims_won: int = 0
    claims_lost: int = 0  # another node held the claim: this one waited
    claims_expired: int = 0  # claims taken over: their lease ran out (or they were stale)
    own_fetches: int = 0  # origin fetches without a claim (no conditional writes)
    puts: int = 0
    put_failures: int = 0
    errors: int = 0  # shared-tier requests that failed: the block came from the origin
    polls: int = 0
    shared_bytes: int = 0  # bytes served from the shared tier
    origin_bytes: int = 0  # bytes fetched from the origin through the shared tier's path


class SharedError(Exception):
    """A shared-tier request failed (the origin's own errors pass through as they are)."""

    def __init__(self, exc: StoreError) -> None:
        super().__init__(str(exc))
        self.kind = exc.kind


def node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class BlockFlight:
    """One node's side of the protocol, over the shared store `store`."""

    def __init__(
        self,
        store: Store,
        blocks: Blocks,
        *,
        lease: float,
        origin_fetches: int,  # at once (slots.py); one more claimed, ready
        conditional: bool,
        meta: Runner,
        data: Runner,
        upload: Runner,
        counts: Counts | None = None,
        now: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
        node: str | None = None,
    ) -> None:
        self.store = store
        self.blocks = blocks
        self.lease = lease
        self.conditional = conditional
        self._meta, self._data, self._upload = meta, data, upload
        self.counts = counts if counts is not None else Counts()
        self._now, self._wall = now, wall
        self.node = node or node_id()
        self.slots = OriginSlots(origin_fetches)
        self._gets = Line(SHARED_GETS)
        self._looks = Looks(store, meta, fresh=LOOK_FRESH, now=now)

    async def fill(self, ref: BlockRef, buf: memoryview, origin: Origin) -> Outcome:
        """Fill `buf` (ref.length bytes) with block `ref`: from the shared tier if a
        verified copy is (or becomes) there, else from the origin. Raises what
        `origin` raises, or SharedError where the shared tier failed before the
        origin was asked (the caller then asks the origin itself)."""
        ticket = self.slots.ticket()
        try:
            return await self._fill(ref, buf, origin, ticket)
        finally:
            self.slots.leave(ticket)
            self._gets.leave(ticket)

    async def _fill(self, ref: BlockRef, buf: memoryview, origin: Origin, ticket: int) -> Outcome:
        name, claim = self.blocks.name(ref), self.blocks.claim_name(ref)
        bad: Version | None = None  # a put of the block that did not verify
        waited_on: str | None = None  # ETag of the claim this node waits on
        seen: ObjectInfo | None = None  # that claim, as last looked at
        waiting_since = looked = 0.0
        pause = POLL_FIRST
        missed = False
        while True:
            # Every look, the first included, is through a listing its node's fills
            # of the object share: a block missing costs no request of its own.
            listed = await self._landed(name, bad)
            if listed is not None:
                taken = await self._take(ref, name, listed, buf, ticket)
                if taken is True:
                    return Outcome.HIT
                if taken is not False:
                    bad = taken
            if not missed:
                missed = True
                self.counts.misses += 1
            if not self.conditional:
                return await self._fetch(ref, name, buf, origin, claim=None)
            now = self._now()
            if seen is None or now - looked >= CLAIM_EVERY or now - waiting_since >= self.lease:
                # The claim is looked at now and then, not at every look for the block;
                # one another node holds is seen in the listing: no claim tried on it.
                seen = await self._listed(claim)
                if seen is not None:
                    self.slots.leave(ticket)  # waiting on that claim, not for a slot
                else:
                    slot = await self._slot(ticket, pause)
                    if slot is None:
                        pause = min(pause * POLL_GROWTH, POLL_MAX)
                        continue
                    try:
                        done, seen = await self._claim(ref, name, claim, buf, origin, bad, slot,
                                                       ticket)
                    finally:
                        slot.give()
                    if done is not None:
                        return done
                    if seen is None:  # released in between: look for the block again
                        continue
                now = looked = self._now()
                if seen.etag != waited_on:  # a claim made (or taken over) since: its own lease
                    if waited_on is None:
                        self.counts.claims_lost += 1
                    waited_on, waiting_since = seen.etag, now
                stale = self._wall() - seen.mtime > self.lease + CLOCK_SKEW
                if stale or now - waiting_since >= self.lease:
                    slot = await self._slot(ticket, pause)
                    if slot is None:
                        pause = min(pause * POLL_GROWTH, POLL_MAX)
                        continue
                    try:
                        done = await self._expired(ref, name, claim, seen, buf, origin, slot)
                    finally:
                        slot.give()
                    if done is not None:
                        return done
                    # Another waiter took it over: wait for that one, whose claim the
                    # listing that showed the old one does not show yet.
                    self._looks.forget(claim)
                    seen = None
                    continue
            self.counts.polls += 1
            await trio.sleep(min(pause, waiting_since + self.lease - now))
            pause = min(pause * POLL_GROWTH, POLL_MAX)

    async def _slot(self, ticket: int, pause: float) -> Slot | None:
        """One of this node's origin slots for fill `ticket`; else None, once the
        line has moved or `pause` seconds have passed (the block may have landed)."""
        slot = self.slots.try_take(ticket)
        if slot is None:
            await self.slots.changed(pause)
        return slot

    async def _claim(
        self, ref: BlockRef, name: str, claim: str, buf: memoryview, origin: Origin,
        bad: Version | None, slot: Slot, ticket: int,
    ) -> tuple[Outcome | None, ObjectInfo | None]:
        """With `slot` taken: claim the block and fill it (its Outcome), or, where
        another node holds the claim, that claim as it is now (None: released in
        between)."""
        since = self._now()
        held = await self._create_claim(claim)
        if held is None:
            return None, await self._head(claim)
        if await self._landed_meanwhile(ref, name, buf, bad, ticket):
            await self._release(claim, held, since)
            return Outcome.HIT, None
        return await self._fetch(ref, name, buf, origin, claim=held, since=since, slot=slot), None

    async def _expired(
        self, ref: BlockRef, name: str, claim: str, seen: ObjectInfo, buf: memoryview,
        origin: Origin, slot: Slot,
    ) -> Outcome | None:
        """With `slot` taken: take over claim `seen`, which outlived its lease, and
        fill the block; None where another waiter took it over first."""
        since = self._now()
        held = await self._take_over(claim, seen.etag)
        if held is None:
            return None  # another waiter took it over first: not counted twice
        self.counts.claims_expired += 1
        if held is _REFUSED:  # no If-Match here: each waiter fetches for itself
            return await self._fetch(ref, name, buf, origin, claim=None, slot=slot)
        log.info("shared block %s: a claim made at %s UTC outlived its lease; taken over",
                 name, time.strftime("%H:%M:%S", time.gmtime(seen.mtime)))
        return await self._fetch(ref, name, buf, origin, claim=held, since=since, slot=slot)

    # -- steps -------------------------------------------------------------------

    async def _landed(self, name: str, bad: Version | None) -> ObjectInfo | None:
        """The block object as a listing shows it (no metadata: the GET brings that),
        once it shows a put of it other than the one that did not verify."""
        listed = await self._listed(name)
        if listed is None or (bad is not None and listed.etag == bad[0]):
            return None
        return listed

    async def _landed_meanwhile(
        self, ref: BlockRef, name: str, buf: memoryview, bad: Version | None, ticket: int,
    ) -> bool:
        """Whether the block landed between this node's look and its claim (its
        claimer put it, then released the claim): one more look saves an origin
        fetch. Mostly it has not: a GET out of line (its 404 costs what a HEAD's
        does; the slot taken is not held up behind other blocks' GETs); a HEAD
        first where a put of it did not verify (not taken twice). A failure here
        is no reason not to fetch: False."""
        try:
            if bad is None:
                return await self._take(ref, name, None, buf, ticket, in_line=False) is True
            info = await self._head(name)
            return info is not None and _version(info) != bad and await self._take(
                ref, name, info, buf, ticket) is True
        except SharedError:
            return False

    async def _take(
        self, ref: BlockRef, name: str, seen: ObjectInfo | None, buf: memoryview, ticket: int,
        *, in_line: bool = True,
    ) -> bool | Version:
        """GET the block into buf and verify it (its checksum comes with the GET's
        answer), once fill `ticket` is first in line for a GET (`in_line`). Pinned
        to the ETag of `seen` (listed or HEADed), if any. True: taken. False: not
        there (or replaced or removed since it was seen): look again. Else the put
        that did not verify, counted and never served."""
        slot = await self._gets.take(ticket) if in_line else None
        try:
            got = await self._data(self._get_verified, ref, name,
                                   None if seen is None else seen.etag, buf)
        except StoreError as exc:
            if exc.kind in ("changed", "not_found"):
                return False
            raise SharedError(exc) from exc
        finally:
            if slot is not None:
                slot.give()
        if got is True:
            self.counts.hits += 1
            self.counts.shared_bytes += ref.length
            return True
        self.counts.corrupt += 1
        log.warning("shared block %s (%r block %d) failed verification: not served, "
                    "fetching it again", name, ref.key, ref.index)
        return got

    def _get_verified(self, ref: BlockRef, name: str, etag: str | None,
                      buf: memoryview) -> bool | Version:
        """(worker) True if the block's bytes verify; else its version as answered."""
        view = buf[: ref.length]
        got = self.store.get_range_into(name, 0, ref.length, view, etag)
        metadata = got.metadata or {}
        if got.length == ref.length and self.blocks.verifies(ref, view, metadata):
            return True
        return got.etag, metadata.get(SUM_META)

    async def _fetch(
        self, ref: BlockRef, name: str, buf: memoryview, origin: Origin, *, claim: str | None,
        since: float = 0.0, slot: Slot | None = None,
    ) -> Outcome:
        """The block from the origin, put into the shared tier. `slot` (a claimed
        block's) waits for one of the node's fetches and is given back as soon as
        the origin is done with (the put does not use the link); `claim` (this
        node's claim's ETag; None where the store has no conditional writes) is
        released whatever happens, so that nobody waits for a fetch that failed
        (`since`: when this node asked for it, on its own clock)."""
        try:
            async with nullcontext() if slot is None else self.slots.fetching(slot):
                await self._from_origin(ref, buf, origin)
            try:
                await self._upload(self._put, ref, name, buf[: ref.length])
                self.counts.puts += 1
            except StoreError as exc:
                self.counts.put_failures += 1
                log.warning("could not put shared block %s: %s", name, exc)
        finally:
            if claim is not None:
                with trio.CancelScope(shield=True):
                    await self._release(self.blocks.claim_name(ref), claim, since)
        if claim is None:
            self.counts.own_fetches += 1
            return Outcome.OWN
        return Outcome.FILLED

    async def _from_origin(self, ref: BlockRef, buf: memoryview, origin: Origin) -> None:
        n = await origin(buf[: ref.length])
        if n != ref.length:
            raise OSError(errno.EIO, f"short read of {ref.key!r} block {ref.index}: "
                          f"{n} of {ref.length} bytes")
        self.counts.origin_bytes += n

    def _put(self, ref: BlockRef, name: str, data: memoryview) -> None:
        self.store.put_bytes(name, data, metadata={SUM_META: self.blocks.checksum(ref, data)})

    # -- claims ------------------------------------------------------------------

    def _claim_body(self) -> bytes:
        return json.dumps({"node": self.node, "lease": self.lease, "at": self._wall()}).encode()

    async def _create_claim(self, claim: str) -> str | None:
        """The new claim's ETag if this node created it; None if another node holds one."""
        try:
            info = await self._meta(self._put_claim, claim, None)
        except StoreError as exc:
            if exc.kind == "precondition":
                return None
            raise SharedError(exc) from exc
        self.counts.claims_won += 1
        return str(info.etag)

    async def _take_over(self, claim: str, etag: str) -> str | None:
        """Replace the expired claim `etag` with this node's; its ETag, or None if
        another waiter replaced (or its claimer released) it first, or _REFUSED
        where the store takes If-None-Match but refuses If-Match."""
        try:
            info = await self._meta(self._put_claim, claim, etag)
        except StoreError as exc:
            if exc.kind in ("precondition", "not_found"):
                return None
            if exc.kind == "invalid":
                return _REFUSED
            raise SharedError(exc) from exc
        return str(info.etag)

    def _put_claim(self, claim: str, if_match: str | None) -> ObjectInfo:
        return self.store.put_bytes(claim, self._claim_body(), if_match=if_match,
                                    if_none_match=if_match is None)

    async def _release(self, claim: str, etag: str, since: float) -> None:
        """Delete this node's claim (`etag`, asked for at `since` on this node's
        clock), unless another node has taken it over since. A plain DELETE cannot
        be conditional everywhere: a claim held half its lease or longer is looked
        at first. One held less cannot have been taken over: a waiter takes a claim
        over only once it has waited a whole lease on it (from when it first saw
        it, after `since`), or once its Last-Modified is a lease and CLOCK_SKEW old.
        The race left (a clock further off than that) costs at most one extra
        origin fetch, never a wrong byte."""
        try:
            if self._now() - since >= self.lease / 2:
                info = await self._head(claim)
                if info is None or info.etag != etag:
                    return
            await self._meta(self.store.delete, claim)
        except (SharedError, StoreError) as exc:
            log.debug("releasing claim %s: %s", claim, exc)

    async def _listed(self, name: str) -> ObjectInfo | None:
        """`name` as a recent listing shows it (looks.py; no metadata)."""
        try:
            return await self._looks.find(name)
        except StoreError as exc:
            raise SharedError(exc) from exc

    async def _head(self, name: str) -> ObjectInfo | None:
        try:
            info: ObjectInfo = await self._meta(self.store.head, name)
        except StoreError as exc:
            if exc.kind == "not_found":
                return None
            raise SharedError(exc) from exc
        return info


def _version(info: ObjectInfo) -> Version:
    """What tells one put of a block object from another: its ETag alone is not
    enough where a put changed only the metadata."""
    return info.etag, info.metadata.get(SUM_META)
