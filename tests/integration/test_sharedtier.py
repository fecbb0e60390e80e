"""The shared tier across real mounts: tierfs daemons (each its own cache dir) over
one real SeaweedFS, origin and shared tier as two buckets of it. Origin bytes are the
daemons' own GET byte counters (`tierfs_store_bytes_total{op=get}`: shared-tier
requests are counted apart, as shared_*); the rest are the shared tier's counters.

The rows of issue 35's table at small sizes (the bench, bench/sharedtier.py, has
them with 4 nodes and 1 GiB behind a shaped origin link). A herd is 2 nodes here:
single-flight is shown by 2 as by 4 (every block fetched once, the other node's
reads all hits), and each daemon costs the suite a start and a stop; where it is
the point (a takeover that happens once among several waiters), 2 waiters."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
BLOCK = 2 * MiB
SIZE = 12 * MiB + 12345  # 7 blocks, the last one short
BLOCKS = -(-SIZE // BLOCK)
KEY = "models/llm/model.bin"
NODES = 2
# A lease no block's fetch outlives, however loaded the machine: only the kill -9
# test waits one out, with its own short lease.
LEASE = 60.0
SHORT_LEASE = 2.0
# Hang guard of the kill -9 test: normal completion is a few seconds plus one lease.
HANG_GUARD = 120.0


@pytest.fixture
def shared_bucket(s3_server: SeaweedServer, _made_buckets: list[tuple[SeaweedServer, str]]) -> str:
    name = f"shared{os.getpid()}-{len(_made_buckets)}"
    s3_server.make_bucket(name)
    _made_buckets.append((s3_server, name))
    return name


@pytest.fixture
def model(s3_server: SeaweedServer, bucket: str) -> bytes:
    data = os.urandom(SIZE)
    s3_server.client().put_object(Bucket=bucket, Key=KEY, Body=data)
    return data


def config(tmp_path: Path, lease: float, extra: str = "") -> Path:
    path = tmp_path / f"shared-{lease:g}-{len(extra)}.toml"
    path.write_text(f'[shared]\nblock_size = "{BLOCK >> 20}M"\nlease = {lease}\n{extra}')
    return path


Node = Callable[..., TierfsMount]
Nodes = Callable[..., list[TierfsMount]]


@pytest.fixture
def nodes(mount_factory: MountFactory, bucket: str, shared_bucket: str, tmp_path: Path,
          s3_server: SeaweedServer) -> Nodes:
    """`n` mounts of the origin bucket with the shared tier (at `endpoint`, by
    default the same server), started at once (a daemon's start is mostly waits)."""

    def make(n: int, endpoint: str | None = None, origin: str | None = None,
             lease: float = LEASE, extra: str = "") -> list[TierfsMount]:
        env = None if origin is None else {**s3_server.env(), "AWS_ENDPOINT_URL": origin}
        ms = [mount_factory(f"s3://{bucket}", "--config", str(config(tmp_path, lease, extra)),
                            "--shared-cache", f"s3://{shared_bucket}/fleet",
                            "--shared-endpoint-url", endpoint or s3_server.endpoint,
                            env=env, start=False) for _ in range(n)]
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(TierfsMount.start, ms))
        return ms

    return make


@pytest.fixture
def node(nodes: Nodes) -> Node:
    """One such mount."""
    return lambda *args, **kw: nodes(1, *args, **kw)[0]


def read_together(mounts: list[TierfsMount]) -> dict[int, bytes | BaseException]:
    """Every mount reads the model whole, all starting at the same moment."""
    start = threading.Barrier(len(mounts))
    out: dict[int, bytes | BaseException] = {}

    def read(i: int) -> None:
        start.wait()
        try:
            out[i] = (mounts[i].mountpoint / KEY).read_bytes()
        except OSError as exc:
            out[i] = exc

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(mounts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def wait_for(cond: Callable[[], bool], what: str) -> None:
    """Poll `cond` (a condition, not a delay); the bound only ends a hang."""
    deadline = time.monotonic() + HANG_GUARD
    while not cond():
        assert time.monotonic() < deadline, f"hang: never saw {what}"  # hang guard
        time.sleep(0.05)


def origin_bytes(m: TierfsMount) -> float:
    return m.metric("tierfs_store_bytes_total{op=get}")


def shared(m: TierfsMount, what: str) -> float:
    return m.metric(f"tierfs_shared_{what}_total")


def shared_keys(s3: SeaweedServer, bucket: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="fleet/")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_a_herd_costs_the_origin_one_copy_a_later_node_none_and_a_corrupt_block_is_never_served(
    nodes: Nodes, node: Node, model: bytes, s3_server: SeaweedServer, shared_bucket: str
) -> None:
    herd = nodes(NODES)
    got = read_together(herd)
    assert all(got[i] == model for i in range(NODES))
    assert sum(origin_bytes(m) for m in herd) <= 1.1 * SIZE
    # Every block was claimed once; the others waited for it or found it.
    assert sum(shared(m, "claims_won") for m in herd) >= BLOCKS
    assert sum(shared(m, "puts") for m in herd) == BLOCKS
    assert sum(shared(m, "hits") for m in herd) == (NODES - 1) * BLOCKS
    assert sum(shared(m, "corrupt_blocks") for m in herd) == 0
    blocks = [k for k in shared_keys(s3_server, shared_bucket) if not k.endswith(".claim")]
    assert len(blocks) == BLOCKS  # and no claim left behind
    assert len(shared_keys(s3_server, shared_bucket)) == BLOCKS
    fifth = node()
    assert (fifth.mountpoint / KEY).read_bytes() == model
    assert origin_bytes(fifth) == 0
    assert shared(fifth, "hits") == BLOCKS
    assert shared(fifth, "bytes_from_shared") == SIZE
    shown = run_tierfs("status", str(fifth.mountpoint), env={**fifth.env, "COLUMNS": "300"},
                       check=True).stdout
    [row] = [line for line in shown.splitlines() if "shared tier" in line]
    assert f"{BLOCKS} blocks taken, 0 missed, 0 corrupt" in row

    # One block overwritten by boto3 with other bytes, its checksum kept in the metadata.
    client = s3_server.client()
    [name] = [k for k in blocks if k.endswith("/5")]
    meta = client.head_object(Bucket=shared_bucket, Key=name)["Metadata"]
    client.put_object(Bucket=shared_bucket, Key=name, Body=os.urandom(BLOCK), Metadata=meta)
    later = node()
    assert (later.mountpoint / KEY).read_bytes() == model
    assert shared(later, "corrupt_blocks") == 1
    assert origin_bytes(later) == BLOCK  # that block, from the origin
    assert shared(later, "hits") == BLOCKS - 1
    # ... and put again, whole: the shared tier holds the origin's bytes once more.
    put_again = client.get_object(Bucket=shared_bucket, Key=name)
    assert put_again["Body"].read() == model[5 * BLOCK:6 * BLOCK]
    assert put_again["Metadata"] == meta  # the same identity, so the same checksum


@pytest.mark.parametrize(("if_match", "waiters"), [("enforced", 2), ("refused", 1)])
def test_a_claimer_killed_mid_fetch_is_taken_over(
    node: Node, nodes: Nodes, model: bytes, s3_server: SeaweedServer, shared_bucket: str,
    if_match: str, waiters: int,
) -> None:
    """The claimer's origin GETs hang (a proxy holds them: it is mid-fetch, holding
    its claims); it is killed with -9 once the others wait on it. They take its
    claims over when the lease runs out and read every byte right; two waiters
    take each claim over once. Where the shared store refuses If-Match (501, as a
    store with If-None-Match alone would), a waiter fetches those blocks for
    itself instead."""
    with FaultProxy(s3_server.endpoint) as origin, FaultProxy(s3_server.endpoint) as tier:
        origin.set_rules([Rule("blackhole", ops={"get"})])
        if if_match == "refused":
            tier.set_rules([Rule("501", ops={"put"}, header="if-match")])
        claimer = node(tier.endpoint, origin=origin.endpoint, lease=SHORT_LEASE)
        stuck = threading.Thread(target=read_together, args=([claimer],), daemon=True)
        stuck.start()
        wait_for(lambda: any(k.endswith(".claim") for k in shared_keys(s3_server, shared_bucket)),
                 "the stuck node's claim")
        others = nodes(waiters, tier.endpoint, lease=SHORT_LEASE)
        result: dict[int, bytes | BaseException] = {}
        readers = threading.Thread(target=lambda: result.update(read_together(others)))
        readers.start()
        wait_for(lambda: sum(shared(m, "claims_lost") for m in others) > 0,
                 "the others waiting on its claims")
        claimer.kill9()
        readers.join(HANG_GUARD)
        assert not readers.is_alive()  # hang guard: done within a lease plus a fetch, normally
    assert [result[i] == model for i in range(waiters)] == [True] * waiters
    assert sum(shared(m, "claims_expired") for m in others) >= 1
    if if_match == "enforced":
        assert sum(origin_bytes(m) for m in others) <= 1.1 * SIZE  # the takeover fetched, once
        assert sum(shared(m, "own_fetches") for m in others) == 0
    else:
        assert sum(shared(m, "own_fetches") for m in others) >= 1


@pytest.fixture
def no_conditional_writes(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    """The shared tier behind a proxy answering conditional PUTs 501 Not Implemented,
    as stores without conditional writes do: SeaweedFS enforces them, so a store
    without them is made by refusing the header (the probe's own criterion)."""
    with FaultProxy(s3_server.endpoint) as p:
        p.set_rules([Rule("501", ops={"put"}, header="if-none-match"),
                     Rule("501", ops={"put"}, header="if-match")])
        yield p


def test_without_conditional_writes_every_node_fetches_for_itself(
    nodes: Nodes, node: Node, model: bytes, s3_server: SeaweedServer, shared_bucket: str,
    no_conditional_writes: FaultProxy,
) -> None:
    herd = nodes(NODES, no_conditional_writes.endpoint)
    assert all(m.stderr.count("does not enforce conditional writes") == 1 for m in herd)
    got = read_together(herd)
    assert all(got[i] == model for i in range(NODES))
    for m in herd:
        assert shared(m, "claims_won") == shared(m, "claims_lost") == 0
        assert shared(m, "own_fetches") + shared(m, "hits") == BLOCKS
        assert origin_bytes(m) == shared(m, "bytes_from_origin")
    assert not [k for k in shared_keys(s3_server, shared_bucket) if k.endswith(".claim")]
    late = node(no_conditional_writes.endpoint)  # what they put serves a later node
    assert (late.mountpoint / KEY).read_bytes() == model
    assert origin_bytes(late) == 0


SHARDS = [f"models/llm/model-0000{i}-of-00002.safetensors" for i in (1, 2)]


def test_the_next_shard_is_claimed_and_put_ahead_of_its_open(
    nodes: Nodes, node: Node, s3_server: SeaweedServer, bucket: str, shared_bucket: str,
) -> None:
    """A node reading the first shard of a model (whole-object prefetch on: small
    files count as model-like here) fetches the second through the shared tier
    before anyone opens it: its blocks land in the shared tier, each fetched from
    the origin once; the second shard's read then costs the origin nothing, and a
    later node takes the whole model from the shared tier."""
    client = s3_server.client()
    shards = {key: os.urandom(SIZE) for key in SHARDS}
    for key, data in shards.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    extra = '[read]\nprefetch_min_size = "1M"\n'
    [first] = nodes(1, extra=extra)
    assert (first.mountpoint / SHARDS[0]).read_bytes() == shards[SHARDS[0]]

    def blocks_of(key: str) -> list[str]:  # block names hold a hash of the key (blocks.py)
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return [k for k in shared_keys(s3_server, shared_bucket)
                if not k.endswith(".claim") and f"/{digest}/" in k]

    # Both shards' blocks, the second's though nobody opened it.
    wait_for(lambda: len(blocks_of(SHARDS[1])) == BLOCKS, "the second shard's blocks")
    assert len(blocks_of(SHARDS[0])) == BLOCKS
    wait_for(lambda: origin_bytes(first) >= 2 * SIZE, "the second shard fetched")
    assert (first.mountpoint / SHARDS[1]).read_bytes() == shards[SHARDS[1]]
    assert origin_bytes(first) == 2 * SIZE  # each block once, the second shard's too
    later = node(extra=extra)
    assert [(later.mountpoint / k).read_bytes() == d for k, d in shards.items()] == [True, True]
    assert origin_bytes(later) == 0
