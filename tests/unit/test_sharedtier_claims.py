"""Claims, leases and verification of the shared tier (tierfs/sharedtier/), against
a real file:// store (LocalStore enforces If-None-Match / If-Match like S3) and
trio's MockClock: "no node waits longer than the lease" is a statement about
time, and a killed claimer is a claim nobody completes. Store calls run inline
in the trio thread (the daemon runs them in workers), so virtual time only moves
while every node waits."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tierfs.budget import MemoryBudget
from tierfs.read.sources import Got, MemorySink, Sink, Want
from tierfs.sharedtier.blocks import SUM_META, BlockRef, Blocks
from tierfs.sharedtier.claims import (
    CLOCK_SKEW,
    LOOK_FRESH,
    POLL_MAX,
    SHARED_GETS,
    BlockFlight,
    Counts,
    Outcome,
)
from tierfs.sharedtier.tier import SharedTier
from tierfs.store.base import StoreError
from tierfs.store.local import LocalStore

BLOCK = 64 << 10
LEASE = 10.0
FETCH = 1.0  # virtual seconds one origin fetch of a block takes
DATA = os.urandom(3 * BLOCK + 1000)


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Origin:
    """The origin as the shared tier sees it: fills a view with the object's bytes
    after FETCH virtual seconds; counts calls, the most in flight at once and the
    blocks asked for in order; can be told to fail or hang."""

    def __init__(self, data: bytes = DATA) -> None:
        self.data = data
        self.calls = 0
        self.inflight = self.most = 0
        self.asked: list[int] = []  # block indexes, in the order fetches started
        self.fail: Exception | None = None
        self.hang = False

    def at(self, start: int) -> Callable[[memoryview], Any]:
        async def fill(view: memoryview) -> int:
            self.calls += 1
            self.asked.append(start // BLOCK)
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            try:
                await trio.sleep(FETCH)
            finally:
                self.inflight -= 1
            if self.hang:
                await trio.sleep_forever()
            if self.fail is not None:
                raise self.fail
            view[:] = self.data[start : start + len(view)]
            return len(view)

        return fill


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    root = tmp_path / "shared"
    root.mkdir()
    return LocalStore(str(root))


def ref(index: int = 0, etag: str = "etag-1", size: int = len(DATA)) -> BlockRef:
    return BlockRef("s3://models", "llm/model.safetensors", etag, size, BLOCK, index)


def node(store: LocalStore, name: str, *, conditional: bool = True, secret: bytes | None = None,
         wall: Callable[[], float] | None = None, fetches: int = 2) -> BlockFlight:
    return BlockFlight(store, Blocks(secret), lease=LEASE, conditional=conditional,
                       meta=inline, data=inline, upload=inline, counts=Counts(), node=name,
                       origin_fetches=fetches, **({"wall": wall} if wall else {}))


async def fill(n: BlockFlight, r: BlockRef, origin: Origin) -> tuple[Outcome, bytes, float]:
    """One node's fill of block `r`: its outcome, bytes and virtual seconds taken."""
    buf = memoryview(bytearray(r.length))
    t0 = trio.current_time()
    outcome = await n.fill(r, buf, origin.at(r.start))
    return outcome, bytes(buf), trio.current_time() - t0


def want(r: BlockRef) -> bytes:
    return DATA[r.start : r.start + r.length]


def claim_of(store: LocalStore, r: BlockRef, blocks: Blocks | None = None) -> str:
    return (blocks or Blocks()).claim_name(r)


def exists(store: LocalStore, key: str) -> bool:
    try:
        store.head(key)
    except StoreError as exc:
        assert exc.kind == "not_found"
        return False
    return True


async def test_the_first_node_fetches_puts_and_releases_the_next_takes_it(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    origin = Origin()
    a, b = node(store, "a"), node(store, "b")
    r = ref(1)
    assert await fill(a, r, origin) == (Outcome.FILLED, want(r), FETCH)
    assert (a.counts.misses, a.counts.claims_won, a.counts.puts, origin.calls) == (1, 1, 1, 1)
    assert not exists(store, claim_of(store, r))  # released
    assert exists(store, Blocks().name(r))
    outcome, got, _ = await fill(b, r, origin)
    assert (outcome, got, origin.calls) == (Outcome.HIT, want(r), 1)
    assert (b.counts.hits, b.counts.misses, b.counts.shared_bytes) == (1, 0, r.length)


async def test_a_herd_costs_the_origin_one_fetch_per_block(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    origin = Origin()
    nodes = [node(store, f"n{i}") for i in range(4)]
    results: list[tuple[Outcome, bytes, float]] = []
    r = ref(3)  # the short last block

    async def one(n: BlockFlight) -> None:
        results.append(await fill(n, r, origin))

    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(one, n)
    assert origin.calls == 1
    assert sorted(o.value for o, _, _ in results) == ["filled", "shared", "shared", "shared"]
    assert all(got == want(r) for _, got, _ in results)
    assert sum(n.counts.claims_won for n in nodes) == 1
    assert sum(n.counts.claims_lost for n in nodes) == 3
    assert sum(n.counts.claims_expired for n in nodes) == 0
    # Waiters take the block at most POLL_MAX after it landed.
    assert max(t for _, _, t in results) <= FETCH + POLL_MAX


async def fill_all(nodes: list[BlockFlight], origin: Origin) -> dict[str, list[Outcome]]:
    """Every node fills every block of DATA at once, each starting its fills in
    block order (a prefetch window): each node's outcomes by block."""
    refs = [ref(i) for i in range(-(-len(DATA) // BLOCK))]
    out: dict[str, list[Outcome]] = {n.node: [Outcome.OWN] * len(refs) for n in nodes}

    async def one(n: BlockFlight, r: BlockRef) -> None:
        outcome, got, _ = await fill(n, r, origin)
        assert got == want(r)
        out[n.node][r.index] = outcome

    async with trio.open_nursery() as nursery:
        for n in nodes:
            for r in refs:
                nursery.start_soon(one, n, r)
                await trio.testing.wait_all_tasks_blocked()  # started in order
    return out


async def test_a_node_fetches_a_few_blocks_at_once_in_the_order_they_were_asked_for(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A whole window of blocks asked for at once: the origin carries `fetches` of
    them at a time, oldest first, so that they land in order rather than all at
    the window's end."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    a = node(store, "a", fetches=2)
    out = await fill_all([a], origin)
    assert out["a"] == [Outcome.FILLED] * 4
    assert (origin.asked, origin.most) == ([0, 1, 2, 3], 2)
    assert a.counts.claims_won == 4
    assert trio.current_time() == 2 * FETCH  # no gap between one fetch and the next


async def test_the_next_block_is_claimed_while_the_fetch_before_it_runs(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """One claim more than fetches: it waits, ready, and starts the moment the
    fetch before it ends, not a claim's round trips later."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    a = node(store, "a", fetches=1)
    claimed: list[list[bool]] = []

    async def watch() -> None:
        await trio.sleep(FETCH / 2)  # block 0 on the link
        claimed.append([exists(store, claim_of(store, ref(i))) for i in range(3)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        for i in range(3):
            nursery.start_soon(fill, a, ref(i), origin)
            await trio.testing.wait_all_tasks_blocked()
    assert claimed == [[True, True, False]]
    assert (origin.asked, origin.most, trio.current_time()) == ([0, 1, 2], 1, 3 * FETCH)


async def test_a_herd_spreads_the_claims_and_keeps_its_fetches_on_the_link(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """Two nodes, one fetch each, ask for the same four blocks at once: each claims
    the oldest blocks nobody holds, so the origin carries two different blocks
    at once, each fetched once, and each node takes the other's."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    a, b = node(store, "a", fetches=1), node(store, "b", fetches=1)
    out = await fill_all([a, b], origin)
    assert (sorted(origin.asked), origin.most) == ([0, 1, 2, 3], 2)
    assert (a.counts.puts, b.counts.puts) == (2, 2)  # each fetched two
    assert sorted(out["a"] + out["b"], key=lambda o: o.value) == (
        [Outcome.FILLED] * 4 + [Outcome.HIT] * 4)
    # Two fetches' time for four blocks over two fetches at once, not four.
    assert trio.current_time() <= 2 * FETCH + 2 * POLL_MAX


async def test_a_fill_waiting_for_a_slot_takes_the_block_another_node_put(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A node whose slots are all taken does not claim, but keeps looking: the
    block another node fetched meanwhile is taken from the shared tier."""
    mock_clock.autojump_threshold = 0
    slow, origin = Origin(), Origin()
    slow.hang = True
    a, b = node(store, "a", fetches=1), node(store, "b", fetches=1)
    results: list[tuple[Outcome, bytes, float]] = []

    async def a_block_2() -> None:
        results.append(await fill(a, ref(2), origin))

    async with trio.open_nursery() as nursery:
        for i in (0, 1):  # a's fetch and its claim ready behind it: both slots
            nursery.start_soon(fill, a, ref(i), slow)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(a_block_2)
        await trio.testing.wait_all_tasks_blocked()
        assert await fill(b, ref(2), origin) == (Outcome.FILLED, want(ref(2)), FETCH)
        while not results:
            await trio.sleep(POLL_MAX)
        nursery.cancel_scope.cancel()
    [(outcome, got, took)] = results
    assert (outcome, got, origin.calls) == (Outcome.HIT, want(ref(2)), 1)
    assert took <= FETCH + POLL_MAX
    assert a.counts.claims_won == 2  # blocks 0 and 1 only


async def test_a_fill_that_finds_its_block_claimed_meanwhile_leaves_the_line(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A fill in line for a slot whose block another node claims meanwhile waits on
    that claim instead: the younger fill behind it takes the next free slot, not
    one after."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    a = node(store, "a", fetches=1)
    async with trio.open_nursery() as nursery:
        for i in (2, 3, 0):  # 2 fetching and 3 claimed behind it: both slots; 0 in line
            nursery.start_soon(fill, a, ref(i), origin)
            await trio.testing.wait_all_tasks_blocked()
        store.put_bytes(Blocks().claim_name(ref(0)), b"{}", if_none_match=True)  # node b's
        await trio.sleep(POLL_MAX + LOOK_FRESH)  # 0 has seen it
        nursery.start_soon(fill, a, ref(1), origin)
        await trio.sleep(FETCH + FETCH / 2 - trio.current_time())  # 3 on the link
        assert exists(store, claim_of(store, ref(1)))  # claimed, ready behind it
        await trio.sleep(2 * FETCH)
        nursery.cancel_scope.cancel()  # 0 would wait out b's lease
    assert origin.asked == [2, 3, 1]


async def test_blocks_that_landed_are_taken_a_few_at_a_time_oldest_first(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """Four blocks there at once: taken SHARED_GETS at a time in the order their
    fills started, so that the oldest arrives first, not all of them last."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    first = node(store, "first")
    await fill_all([first], origin)  # puts every block
    started: list[int] = []
    inflight = most = 0

    async def data(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal inflight, most
        started.append(args[0].index)
        inflight += 1
        most = max(most, inflight)
        await trio.sleep(0.1 * (1 + args[0].index))  # a GET; one ends at a time
        inflight -= 1
        return fn(*args)

    later = BlockFlight(store, Blocks(), lease=LEASE, origin_fetches=1, conditional=True,
                        meta=inline, data=data, upload=inline, node="later")
    out = await fill_all([later], origin)
    assert out["later"] == [Outcome.HIT] * 4
    assert (started, most, origin.calls) == ([0, 1, 2, 3], SHARED_GETS, 4)


async def test_a_killed_claimer_is_taken_over_once_the_lease_runs_out(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """The claimer dies mid-fetch (its claim stays, no block ever comes): one waiter
    takes the claim over, the others wait for it; all done within lease + one fetch."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    dead = node(store, "dead")
    waiters = [node(store, f"w{i}") for i in range(3)]
    r = ref(0)
    results: list[tuple[Outcome, bytes, float]] = []

    async def killed() -> None:
        hung = Origin()
        hung.hang = True
        with trio.move_on_after(LEASE * 10):  # kill -9: it never finishes or releases
            await fill(dead, r, hung)

    async def one(n: BlockFlight) -> None:
        await trio.sleep(0.1)  # after the claim
        results.append(await fill(n, r, origin))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killed)
        for w in waiters:
            nursery.start_soon(one, w)
        while len(results) < len(waiters):
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert all(got == want(r) for _, got, _ in results)
    assert max(t for _, _, t in results) <= LEASE + FETCH + POLL_MAX
    assert sorted(o.value for o, _, _ in results) == ["filled", "shared", "shared"]
    assert origin.calls == 1
    assert sum(w.counts.claims_expired for w in waiters) == 1  # the others waited for it
    assert sum(w.counts.puts for w in waiters) == 1
    # The block the takeover put serves the next node.
    assert await fill(node(store, "late"), r, origin) == (Outcome.HIT, want(r), 0.0)


async def test_a_claim_left_long_ago_is_taken_over_at_once(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A node arriving long after a claimer died does not wait out a lease: the
    claim's Last-Modified is older than the lease (plus clock skew)."""
    mock_clock.autojump_threshold = 0
    r = ref(2)
    blocks = Blocks()
    store.put_bytes(blocks.claim_name(r), b"{}", if_none_match=True)
    import time

    later = node(store, "later", wall=lambda: time.time() + LEASE + CLOCK_SKEW + 1)
    origin = Origin()
    assert await fill(later, r, origin) == (Outcome.FILLED, want(r), FETCH)
    assert (later.counts.claims_expired, later.counts.polls, origin.calls) == (1, 0, 1)


async def test_waiters_poll_with_bounded_backoff(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A whole lease of waiting costs a bounded number of looks, growing apart up to
    POLL_MAX: the store is not hammered by a herd waiting on one block."""
    mock_clock.autojump_threshold = 0
    r = ref(0)
    store.put_bytes(Blocks().claim_name(r), b"{}", if_none_match=True)
    w = node(store, "w")
    _, got, took = await fill(w, r, Origin())
    assert got == want(r)
    assert took == pytest.approx(LEASE + FETCH)
    assert LEASE / POLL_MAX <= w.counts.polls <= LEASE / POLL_MAX + 12


async def test_a_nodes_waiters_share_their_looks_at_an_object(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """Three fills waiting a whole lease on claims of one object look through
    shared listings: a bounded number of LISTs, and HEADs only for first looks,
    lost claims and blocks listed, not one per fill at every poll."""
    mock_clock.autojump_threshold = 0
    calls: Counter[str] = Counter()

    async def counted(fn: Callable[..., Any], *args: Any) -> Any:
        calls[fn.__name__] += 1
        return fn(*args)

    refs = [ref(i) for i in range(3)]
    for r in refs:
        store.put_bytes(Blocks().claim_name(r), b"{}", if_none_match=True)
    w = BlockFlight(store, Blocks(), lease=LEASE, conditional=True, meta=counted, data=inline,
                    upload=inline, counts=Counts(), node="w", origin_fetches=3)
    origin = Origin()
    async with trio.open_nursery() as nursery:
        for r in refs:
            nursery.start_soon(fill, w, r, origin)
    assert origin.calls == 3  # each claim taken over once its lease ran out
    assert calls["list_dir"] <= LEASE / LOOK_FRESH + 3
    assert calls["head"] <= 3 * 3  # first look, landed-meanwhile, release
    assert w.counts.polls >= 3 * LEASE / POLL_MAX  # while looking as often as before
    # The claims were seen in the listing: none tried before the takeovers.
    assert (calls["_put_claim"], w.counts.claims_lost) == (3, 3)


async def test_a_failed_origin_fetch_releases_the_claim(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """The claimer's origin GET fails: the error is its own; its claim goes, so the
    waiter claims and fetches at once instead of waiting out the lease."""
    mock_clock.autojump_threshold = 0
    r = ref(1)
    bad, good = Origin(), Origin()
    bad.fail = StoreError("origin says no", kind="io")
    a, b = node(store, "a"), node(store, "b")
    errors: list[BaseException] = []
    results: list[tuple[Outcome, bytes, float]] = []

    async def claimer() -> None:
        try:
            await fill(a, r, bad)
        except StoreError as exc:
            errors.append(exc)

    async def waiter() -> None:
        await trio.sleep(0.01)
        results.append(await fill(b, r, good))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer)
        nursery.start_soon(waiter)
    assert len(errors) == 1
    [(outcome, got, took)] = results
    assert (outcome, got) == (Outcome.FILLED, want(r))
    assert took < FETCH + 2 * FETCH  # not a lease
    assert (b.counts.claims_expired, b.counts.claims_won) == (0, 1)


async def test_a_corrupt_block_is_never_served_and_is_refetched(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    origin = Origin()
    r = ref(1)
    blocks = Blocks()
    name = blocks.name(r)
    good = want(r)
    # Overwritten in place with other bytes, the metadata kept (as a tool that
    # copies the block's old metadata along would): the checksum no longer matches.
    store.put_bytes(name, bytes(len(good)), metadata={SUM_META: blocks.checksum(r, good)})
    a = node(store, "a")
    assert await fill(a, r, origin) == (Outcome.FILLED, good, FETCH)
    assert (a.counts.corrupt, a.counts.hits, origin.calls) == (1, 0, 1)
    # The block put again verifies for the next node.
    b = node(store, "b")
    assert (await fill(b, r, origin))[:2] == (Outcome.HIT, good)
    assert (b.counts.corrupt, origin.calls) == (0, 1)


@pytest.mark.parametrize("how", ["truncated", "no checksum", "another index", "another etag"])
async def test_blocks_that_do_not_verify(
    store: LocalStore, mock_clock: trio.testing.MockClock, how: str
) -> None:
    """A torn put, a block without its checksum, or a valid block copied under the
    name of another index or another version (a new ETag) is a counted miss."""
    mock_clock.autojump_threshold = 0
    r = ref(1)
    blocks = Blocks()
    other = {"another index": ref(0), "another etag": ref(1, etag="etag-0")}.get(how, r)
    body = want(other)
    meta = {SUM_META: blocks.checksum(other, body)}
    if how == "truncated":
        body = body[: len(body) // 2]
    if how == "no checksum":
        meta = {}
    store.put_bytes(blocks.name(r), body, metadata=meta)
    n = node(store, "n")
    assert await fill(n, r, Origin()) == (Outcome.FILLED, want(r), FETCH)
    assert (n.counts.hits, n.counts.corrupt, n.counts.misses) == (0, 1, 1)


async def test_without_conditional_writes_every_node_fetches_for_itself(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    origin = Origin()
    nodes = [node(store, f"n{i}", conditional=False) for i in range(3)]
    r = ref(0)
    results: list[tuple[Outcome, bytes, float]] = []

    async def one(n: BlockFlight) -> None:
        results.append(await fill(n, r, origin))

    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(one, n)
    assert origin.calls == 3
    assert [o for o, _, _ in results] == [Outcome.OWN] * 3
    assert all(got == want(r) for _, got, _ in results)
    assert not exists(store, Blocks().claim_name(r))  # no claims at all
    # What they put serves a later node.
    assert (await fill(node(store, "late", conditional=False), r, origin))[0] == Outcome.HIT


async def test_a_fleet_secret_authenticates_blocks(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """With a secret, a block whose checksum anyone could compute (SHA-256 over
    bytes of the writer's choosing) is not served; fleets with another secret,
    or none, use names of their own."""
    mock_clock.autojump_threshold = 0
    secret = b"s" * 32
    keyed, plain, other = Blocks(secret), Blocks(), Blocks(b"t" * 32)
    r = ref(0)
    assert len({keyed.name(r), plain.name(r), other.name(r)}) == 3
    forged = bytes(r.length)
    store.put_bytes(keyed.name(r), forged, metadata={SUM_META: plain.checksum(r, forged)})
    n = node(store, "n", secret=secret)
    assert await fill(n, r, Origin()) == (Outcome.FILLED, want(r), FETCH)
    assert n.counts.corrupt == 1
    assert keyed.verifies(r, want(r), store.head(keyed.name(r)).metadata)
    assert not other.verifies(r, want(r), store.head(keyed.name(r)).metadata)


def test_block_names_stand_for_their_whole_identity() -> None:
    b = Blocks()
    base = ref(0)
    variants = [ref(1), ref(0, etag="etag-2"), ref(0, size=len(DATA) + 1),
                BlockRef(base.source, "llm/other", base.etag, base.size, BLOCK, 0),
                BlockRef("s3://elsewhere", base.key, base.etag, base.size, BLOCK, 0),
                BlockRef(base.source, base.key, base.etag, base.size, 2 * BLOCK, 0)]
    checks = {b.checksum(v, b"x" * 10) for v in [base, *variants]}
    assert len(checks) == 1 + len(variants)  # the checksum binds every field
    names = {b.name(v) for v in [base, *variants] if v.size == base.size}
    assert len(names) == len(variants)  # the name binds all but the size
    assert b.name(ref(0, etag='"odd/etag"')).count("/") == b.name(base).count("/")


async def test_the_tier_leaves_small_objects_and_a_failing_store_to_the_origin(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """As a fetcher source: an object under one block and a range that is not whole
    blocks with no tier-1 file to put them in are the origin's (None); a block the
    shared store fails on comes from the origin, counted, never an error."""
    mock_clock.autojump_threshold = 0
    (tmp_path / "a-file").write_bytes(b"")
    gone = LocalStore(str(tmp_path / "a-file"))  # a root that is a file: every put fails
    tier = SharedTier(gone, source="s3://models", block=BLOCK, lease=LEASE, origin_fetches=1,
                      conditional=True, secret=None, budget=MemoryBudget(1 << 30), meta=inline,
                      data=inline, upload=inline)
    asked: list[Want] = []

    async def below(want: Want, sink: Sink) -> Got:
        asked.append(want)
        sink.buffer()[:] = DATA[want.start : want.end]
        return Got(want.etag)

    def sink(n: int) -> MemorySink:
        return MemorySink(bytearray(n), inline)

    small = Want("k", "e", BLOCK - 1, 0, BLOCK - 1)
    assert await tier.fetch(small, sink(len(small)), below) is None
    part = Want("k", "e", len(DATA), 10, 4096)
    assert await tier.fetch(part, sink(len(part)), below) is None
    assert (tier.counts.misses, asked) == (0, [])  # not even asked
    # A HEAD under that root is "not found": the node claims; the claim's put
    # fails, a shared-tier error: the block comes from the origin.
    block = Want("k", "e", len(DATA), BLOCK, 2 * BLOCK)
    out = sink(len(block))
    assert await tier.fetch(block, out, below) == Got("e")
    assert bytes(out.buffer()) == DATA[BLOCK : 2 * BLOCK]
    assert (tier.counts.errors, asked) == (1, [block])


def counting(calls: Counter[str]) -> Callable[..., Any]:
    async def counted(fn: Callable[..., Any], *args: Any) -> Any:
        calls[fn.__name__] += 1
        return fn(*args)

    return counted


def counted_node(store: LocalStore, name: str, calls: Counter[str]) -> BlockFlight:
    run = counting(calls)
    return BlockFlight(store, Blocks(), lease=LEASE, conditional=True, meta=run, data=run,
                       upload=run, counts=Counts(), node=name, origin_fetches=2)


async def test_a_block_there_costs_a_listing_and_one_get(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A node that finds its block listed takes it with one GET: the checksum comes
    with the GET's answer; a HEAD before it would double the store's requests."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    r = ref(1)
    assert (await fill(node(store, "a"), r, origin))[0] == Outcome.FILLED
    calls: Counter[str] = Counter()
    b = counted_node(store, "b", calls)
    assert await fill(b, r, origin) == (Outcome.HIT, want(r), 0.0)
    assert calls == Counter({"list_dir": 1, "_get_verified": 1})


async def test_a_waiter_takes_a_landed_block_from_a_listing_and_one_get(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A waiter looks through listings, and takes the block a listing shows with
    one GET pinned to the listed ETag: no HEAD, no GET of a block not there. The
    claimer, whose claim is young, deletes it without a look."""
    mock_clock.autojump_threshold = 0
    origin = Origin()
    r = ref(0)
    ca: Counter[str] = Counter()
    cb: Counter[str] = Counter()
    a, b = counted_node(store, "a", ca), counted_node(store, "b", cb)
    results: dict[str, tuple[Outcome, bytes, float]] = {}

    async def one(n: BlockFlight, delay: float) -> None:
        await trio.sleep(delay)
        results[n.node] = await fill(n, r, origin)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, a, 0.0)
        nursery.start_soon(one, b, 0.1)
    assert (results["a"][:2], results["b"][:2]) == ((Outcome.FILLED, want(r)),
                                                    (Outcome.HIT, want(r)))
    assert (origin.calls, b.counts.claims_lost) == (1, 1)
    assert cb["head"] == 0
    assert cb["_get_verified"] == 1  # the block
    assert cb["list_dir"] >= 1
    # The claimer: a GET (404) for the look after its claim, the claim, the put
    # and the DELETE of its claim, without a HEAD before it.
    assert ca["head"] == 0
    assert (ca["_get_verified"], ca["_put_claim"], ca["_put"], ca["delete"]) == (1, 1, 1, 1)
    assert not exists(store, claim_of(store, r))


async def test_a_claim_held_past_half_its_lease_is_looked_at_before_it_is_deleted(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """A claimer whose fetch outlived its lease was taken over: its release must not
    delete a claim that is no longer its own (others wait on that one). A HEAD
    first tells; the claim it finds is another's, and stays."""
    mock_clock.autojump_threshold = 0
    r = ref(0)
    blocks = Blocks()
    claim = blocks.claim_name(r)
    real = Origin().at(r.start)

    async def slow(view: memoryview) -> int:
        await trio.sleep(LEASE * 1.5)
        return int(await real(view))

    calls: Counter[str] = Counter()
    a, b = counted_node(store, "a", calls), node(store, "b")
    other: list[str] = []

    async def waiter_then_another_claim() -> None:
        await trio.sleep(0.1)
        await fill(b, r, Origin())  # took a's claim over, put the block, released
        other.append(store.put_bytes(claim, b"{}", if_none_match=True).etag)

    buf = memoryview(bytearray(r.length))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter_then_another_claim)
        assert await a.fill(r, buf, slow) == Outcome.FILLED
    assert bytes(buf) == want(r)
    assert (b.counts.claims_expired, calls["head"], calls["delete"]) == (1, 1, 0)
    assert store.head(claim).etag == other[0]  # not a's to delete


async def test_fills_of_blocks_not_there_share_their_first_look(
    store: LocalStore, mock_clock: trio.testing.MockClock
) -> None:
    """In a herd nearly every fill starts before its block lands: a fill's first
    look is the listing its node's fills of the object share, not a request of
    its own (a GET or HEAD per fill, each a 404)."""
    mock_clock.autojump_threshold = 0
    refs = [ref(i) for i in range(3)]
    a = node(store, "a", fetches=3)
    calls: Counter[str] = Counter()
    b = counted_node(store, "b", calls)
    origin = Origin()
    async with trio.open_nursery() as nursery:
        for r in refs:
            nursery.start_soon(fill, a, r, origin)
        await trio.sleep(0.01)  # a's claims made, its fetches under way
        looked = trio.Event()

        async def fills_of_b() -> None:
            async with trio.open_nursery() as inner:
                for r in refs:
                    inner.start_soon(fill, b, r, origin)
                await trio.sleep(0)
                looked.set()

        nursery.start_soon(fills_of_b)
        await looked.wait()
        assert calls == Counter({"list_dir": 1})  # one look for the three fills
    assert origin.calls == 3
    assert (b.counts.hits, calls["_get_verified"], calls["head"]) == (3, 3, 0)
