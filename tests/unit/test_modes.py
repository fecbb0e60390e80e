"""Which way a read-only open is served (tierfs/fuse/modes.py), below any mount:
a real tier-1 cache and real entries. Registering a backing file needs the
kernel's FUSE session (tests/integration/test_passthrough_mount.py does that);
every decision before it is made here, and counted as the metrics count it."""

from __future__ import annotations

import os

import trio

from tests.unit.conftest import SMALL_CHUNK as CS
from tierfs.cache import Cache
from tierfs.config import DEFAULT_CLASSES
from tierfs.fuse.modes import OpenModes
from tierfs.fuse.passthrough import Mode
from tierfs.workers import Workers

DATASET = DEFAULT_CLASSES["dataset"]
MANIFEST = DEFAULT_CLASSES["manifest"]


def modes(cache: Cache, nursery: trio.Nursery, counted: list[tuple[str, str]], on: bool) -> OpenModes:
    return OpenModes(Mode(on, "test"), cache, Workers(data=1, upload=1, meta=1, disk=1), nursery,
                     lambda mode, why: counted.append((mode, why)))


async def test_opens_that_cannot_pass_through_say_why(cache: Cache) -> None:
    data = os.urandom(4 * CS)
    partial = cache.open("partial", "e", len(data), 1.0)
    partial.serve.store(0, data[:CS])
    local = cache.open("local.pt", "", 0, 1.0)
    local.local.write(0, b"written here")
    counted: list[tuple[str, str]] = []
    async with trio.open_nursery() as n:
        off, on = modes(cache, n, counted, False), modes(cache, n, counted, True)
        assert off.open_read(1, partial, DATASET).backing_id == 0
        assert on.open_read(2, partial, MANIFEST).backing_id == 0
        assert on.open_read(3, partial, DATASET).backing_id == 0
        assert on.open_read(4, local, DATASET).backing_id == 0
        n.cancel_scope.cancel()
    assert counted == [("daemon", "off"), ("daemon", "revalidated"), ("daemon", "partial"),
                       ("daemon", "local")]
    cache.release_many([partial, local])


async def test_a_complete_unverified_object_is_verified_in_the_background(cache: Cache) -> None:
    """A remount's first open of a complete object: daemon path now, its chunks
    checked behind it, so that the next open may pass through."""
    data = os.urandom(3 * CS)
    e = cache.open("k", "e", len(data), 1.0)
    e.serve.store(0, data)
    cache.release(e)
    cache.close()
    again = Cache(cache.root, capacity=1 << 30, chunk_size=CS, min_free=0)
    again.bind("file:///src")
    e = again.open("k", "e", len(data), 1.0)
    assert e.serve.completeness() == "complete"
    counted: list[tuple[str, str]] = []
    async with trio.open_nursery() as n:
        m = modes(again, n, counted, True)
        assert m.open_read(1, e, DATASET).backing_id == 0
    assert counted == [("daemon", "unverified")]
    assert e.serve.completeness() == "verified"  # the next open may pass through
    again.release(e)
    again.close()
