"""Tier-1 write-back hooks: dirty writes in place, sealing with checksums, becoming
a clean cached object, rename/remove, and recovery of a dirty file after a crash."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierfs.cache import Cache

CS = 4096
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Make real, small tmpfs filesystems (a full disk without faking ENOSPC)."""
    made: list[Path] = []

    def make(size: str) -> Path:
        root = tmp_path / f"tmpfs{len(made)}"
        root.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
                       check=True)
        made.append(root)
        return root

    yield make
    for root in made:
        subprocess.run(["umount", "-l", str(root)], check=False)


def new_cache(root: Path, chunk_size: int = CS, capacity: int = 1 << 30) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=chunk_size, min_free=0)
    c.bind("file:///src")
    return c


def test_write_seal_upload_cycle(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("run/ckpt.pt", "", 0, 0.0)
    assert e.state == "clean"
    data = os.urandom(3 * CS + 1000)
    for off in range(0, len(data), 1000):  # unaligned pieces, front to back
        assert e.local.write(off, data[off : off + 1000]) == len(data[off : off + 1000])
    assert e.state == "dirty" and e.size == len(data)
    assert e.serve.read(0, len(data)) == data
    assert c.stats().used_bytes == len(data)
    e.local.seal(mtime=42.0)
    assert c.lookup("run/ckpt.pt").state == "sealed"
    e.local.clean(etag="etag-from-store")
    c.release(e)
    obj = c.lookup("run/ckpt.pt")
    assert (obj.state, obj.etag, obj.size, obj.mtime, obj.cached_bytes) == (
        "clean",
        "etag-from-store",
        len(data),
        42.0,
        len(data),
    )
    c.close()

    c = new_cache(tmp_path / "c")
    e = c.open("run/ckpt.pt", "etag-from-store", len(data), 42.0)
    assert e.serve.read(0, len(data)) == data  # checksums recorded at sealing verify
    c.release(e)
    assert c.verify_all() == []
    assert c.evict("run/ckpt.pt") is True  # an ordinary cached object now
    c.close()


def test_write_needs_the_whole_object(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", 3 * CS, 0.0)
    e.serve.store(0, bytes(CS))
    with pytest.raises(ValueError, match="not fully cached"):
        e.local.write(10, b"x")
    with pytest.raises(ValueError):
        e.local.truncate(2 * CS)
    e.local.truncate(CS)  # only the surviving part must be cached
    assert e.state == "dirty" and e.size == CS
    assert c.stats().used_bytes == CS
    e.local.write(CS, b"tail")
    assert e.serve.read(CS - 2, 10) == b"\0\0tail"
    with pytest.raises(ValueError):
        e.serve.store(0, bytes(CS))  # fetched bytes never overwrite local ones
    c.release(e)
    c.close()


def test_truncate_grow_and_shrink(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "", 0, 0.0)
    e.local.write(0, b"a" * (CS + 10))
    e.local.truncate(5)
    e.local.truncate(2 * CS)
    assert e.serve.read(0, 2 * CS) == b"a" * 5 + bytes(2 * CS - 5)
    e.local.write(3 * CS, b"z")  # a gap past EOF reads as zeros
    assert e.size == 3 * CS + 1 and e.serve.read(2 * CS, CS + 1) == bytes(CS) + b"z"
    assert c.stats().used_bytes == 3 * CS + 1
    e.local.seal()
    c.release(e)
    c.close()
    c = new_cache(tmp_path / "c")
    assert c.verify_all() == []
    c.close()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("w"), st.integers(0, 700), st.binary(min_size=1, max_size=300)),
            st.tuples(st.just("a"), st.just(0), st.binary(min_size=1, max_size=150)),
            st.tuples(st.just("t"), st.integers(0, 900), st.just(b"")),
        ),
        max_size=25,
    )
)
def test_sealed_checksums_match_any_write_sequence(
    tmp_path_factory: pytest.TempPathFactory, ops: list
) -> None:
    """Running checksums (sequential writes) and read-back ones (the rest) must both
    describe the final file exactly: a fresh process verifies every chunk."""
    root = tmp_path_factory.mktemp("c")
    model = bytearray()
    c = new_cache(root, chunk_size=64)
    e = c.open("f", "", 0, 0.0)
    e.local.make_dirty()  # created by a writer
    for kind, off, data in ops:
        if kind == "a":  # append: the common, sequential case
            off = len(model)
        if kind != "t":
            e.local.write(off, data)
            model[len(model) :] = bytes(max(0, off - len(model)))
            model[off : off + len(data)] = data
        else:
            e.local.truncate(off)
            model = model[:off] + bytes(max(0, off - len(model)))
    e.local.seal()
    c.release(e)
    c.close()
    c = new_cache(root, chunk_size=64)
    e = c.open("f", "ignored", 0, 0.0)
    assert e.state == "sealed" and e.size == len(model)
    assert e.serve.read(0, len(model)) == bytes(model)
    c.release(e)
    assert c.verify_all() == []
    c.close()


def test_dirty_file_survives_a_crash(tmp_path: Path) -> None:
    child = textwrap.dedent(
        f"""
        import os, sys
        from tierfs.cache import Cache
        c = Cache({str(tmp_path / "c")!r}, capacity=1 << 30, chunk_size={CS}, min_free=0)
        c.bind("file:///src")
        e = c.open("half.pt", "", 0, 0.0)
        e.local.write(0, b"x" * {CS + 1})
        c.release(e)  # the record knows CS+1 bytes
        e = c.open("half.pt", "", 0, 0.0)
        e.local.write({CS + 1}, b"y" * {2 * CS})  # this growth never reaches the record
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, cwd=Path(__file__).parents[2])
    c = new_cache(tmp_path / "c")
    assert c.lookup("half.pt").state == "dirty"
    assert [o.key for o in c.iter_objects() if o.state != "clean"] == ["half.pt"]
    e = c.open("half.pt", "", 0, 0.0)
    assert e.size == 3 * CS + 1 and e.serve.read(0, e.size) == b"x" * (CS + 1) + b"y" * (2 * CS)
    assert c.stats().used_bytes == 3 * CS + 1
    c.release(e)
    assert c.lookup("half.pt").cached_bytes == 3 * CS + 1
    assert c.remove("half.pt") is True  # quarantine done: forget it
    assert c.stats().used_bytes == 0 and list((tmp_path / "c" / "objects").iterdir()) == []
    c.close()


def test_rename_moves_pending_file(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("tmp-checkpoint-5/model.pt", "", 0, 0.0)
    e.local.write(0, b"weights")
    e.local.seal()
    target = c.open("checkpoint-5/model.pt", "old", CS, 0.0)  # an older object there
    target.serve.store(0, bytes(CS))
    assert c.rename("tmp-checkpoint-5/model.pt", "checkpoint-5/model.pt") is True
    assert e.key == "checkpoint-5/model.pt"
    assert c.lookup("tmp-checkpoint-5/model.pt") is None
    assert target.serve.read(0, 4) == bytes(4)  # the replaced version stays readable to its holder
    assert c.open("checkpoint-5/model.pt", "whatever", 1, 0.0) is e
    c.release(e)
    c.release(e)
    c.release(target)
    obj = c.lookup("checkpoint-5/model.pt")
    assert (obj.state, obj.size) == ("sealed", 7)
    assert c.stats().used_bytes == 7
    assert c.rename("nope", "x") is False
    c.close()


def test_open_seen_of_a_local_file_keeps_its_landed_version(tmp_path: Path) -> None:
    """The namespace shows a file this mount wrote with ETag "" and size 0; its upload
    can land before the open reaches tier 1. open_seen takes the landed (clean)
    record; open(key, "", 0) would drop it as another version and make an empty
    one (the reads of 0 bytes right after an os.replace)."""
    c = new_cache(tmp_path / "c")
    data = os.urandom(2 * CS + 7)
    e = c.open("ck/x.pt", "", 0, 0.0)
    e.local.write(0, data)
    e.local.seal()
    e.local.clean(etag="landed")  # the uploader, between the look and the open
    c.release(e)
    seen = c.open_seen("ck/x.pt", "", 0, 0.0)
    assert seen is not None
    assert (seen.state, seen.etag, seen.size) == ("clean", "landed", len(data))
    assert seen.serve.read(0, len(data)) == data
    c.release(seen)
    same = c.open_seen("ck/x.pt", "landed", len(data), 0.0)  # with an ETag: as `open`
    assert same is not None and same.serve.read(0, len(data)) == data
    c.release(same)
    assert c.remove("ck/x.pt")
    assert c.open_seen("ck/x.pt", "", 0, 0.0) is None  # landed and gone: ask the store
    c.close()


def test_remove_while_open(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", CS, 0.0)
    e.serve.store(0, b"q" * CS)
    assert c.remove("k") is True
    assert c.lookup("k") is None and not e.path.exists()
    assert e.serve.read(0, CS) == b"q" * CS
    fresh = c.open("k", "e", CS, 0.0)
    assert fresh is not e and fresh.serve.missing(0, CS) == [(0, CS)]
    c.release(e)
    c.release(fresh)
    assert c.stats().used_bytes == 0
    c.close()


def test_state_transitions_are_checked(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "", 0, 0.0)
    with pytest.raises(ValueError):
        e.local.seal()  # nothing written
    e.local.write(0, b"abc")
    with pytest.raises(ValueError):
        e.local.clean()  # not sealed yet
    e.local.seal()
    e.local.write(3, b"d")  # written again after an fsync: dirty again
    assert e.state == "dirty"
    e.local.seal()
    e.local.clean(etag="v1")
    c.release(e)
    assert c.lookup("k").size == 4
    c.close()


def test_sealing_a_sequential_write_reads_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierfs.cache.local as local

    c = new_cache(tmp_path / "c")
    e = c.open("big.distcp", "", 0, 0.0)
    data = os.urandom(5 * CS + 333)
    for off in range(0, len(data), 1500):
        e.local.write(off, data[off : off + 1500])

    def no_reads(*args: object) -> bytes:
        raise AssertionError("sealing re-read the file")

    monkeypatch.setattr(local, "pread_full", no_reads)
    e.local.seal()
    monkeypatch.undo()
    c.release(e)
    c.close()
    c = new_cache(tmp_path / "c")
    assert c.verify_all() == []
    c.close()


@needs_root
def test_failed_write_leaves_a_sealable_file(tmpfs: Callable[[str], Path]) -> None:
    """A write that fails halfway on a really full disk (ENOSPC) must not leave a
    running checksum that no longer matches the file, nor a file longer than
    the entry."""
    root = tmpfs("2m")
    cs = 64 << 10
    c = new_cache(root / "c", chunk_size=cs)
    e = c.open("k", "", 0, 0.0)
    e.local.write(0, b"a" * (cs + 100))
    filler = fill(root, leave=cs)
    with pytest.raises(OSError) as exc:
        e.local.write(cs + 100, b"b" * (4 * cs))  # sequential: a running checksum was going
    assert exc.value.errno == errno.ENOSPC
    assert e.size == cs + 100 and os.path.getsize(e.path) == cs + 100
    assert e.serve.read(0, cs + 100) == b"a" * (cs + 100)
    filler.unlink()
    e.local.seal()
    c.release(e)
    c.close()
    c = new_cache(root / "c", chunk_size=cs)
    assert c.verify_all() == []
    c.close()


def fill(root: Path, leave: int) -> Path:
    """A file that takes all of `root`'s free space but about `leave` bytes."""
    filler = root / "filler"
    with open(filler, "wb") as f:
        block = b"\0" * (64 << 10)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        f.truncate(max(0, f.tell() - leave))
    return filler


def test_going_dirty_waits_for_stores_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch that lands after a local write must not overwrite it: the write
    waits for the store in flight. The store is held mid-way by a patched
    pwrite_direct (no real disk can be paused on demand between the claim and
    the write of fetched bytes)."""
    import threading
    import time

    import tierfs.cache.serve as serve

    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", CS, 0.0)
    e.serve.store(0, b"o" * CS)
    real = serve.pwrite_direct
    storing, proceed = threading.Event(), threading.Event()

    def held(dfd: int, fd: int, data: memoryview, offset: int) -> None:
        if threading.current_thread().name == "fetcher":
            storing.set()
            assert proceed.wait(10)
        real(dfd, fd, data, offset)

    monkeypatch.setattr(serve, "pwrite_direct", held)
    fetcher = threading.Thread(target=e.serve.store, args=(0, b"o" * CS), name="fetcher")
    fetcher.start()
    assert storing.wait(10)
    writer = threading.Thread(target=e.local.write, args=(0, b"new"))
    writer.start()
    deadline = time.monotonic() + 10
    while not e._stores_done._waiters:  # type: ignore[attr-defined]  # the writer waits
        # hang guard
        assert time.monotonic() < deadline and writer.is_alive(), "the write did not wait"
        time.sleep(0.001)
    proceed.set()
    fetcher.join(10)
    writer.join(10)
    assert e.serve.read(0, 4) == b"newo"
    c.release(e)
    c.close()


@needs_root
def test_index_commits_on_a_full_disk(tmpfs: Callable[[str], Path]) -> None:
    """A writer fills the cache disk; sealing, marking landed and evicting its file
    still commit (they are what frees the disk), from the index's held reserve."""
    root = tmpfs("16m")
    c = new_cache(root / "c", chunk_size=64 << 10)
    e = c.open("ckpt/huge.pt", "", 0, 0.0)
    off, piece = 0, os.urandom(64 << 10)
    with pytest.raises(OSError) as full:
        while True:
            off += e.local.write(off, piece)
    assert full.value.errno == errno.ENOSPC
    assert os.statvfs(root).f_bavail < 16  # the disk really is full
    for i in range(200):  # more index work than a few pages' worth
        e.local.seal(mtime=float(i))
        e.local.clean(etag=f"etag-{i}")
        e.local.write(0, b"x")  # dirty again: a chunk checksum record per round
    e.local.seal(mtime=1.0)
    e.local.clean(etag="landed")
    c.release(e)
    assert c.lookup("ckpt/huge.pt").state == "clean"
    assert c.evict("ckpt/huge.pt") is True
    assert os.statvfs(root).f_bavail > 1000  # the space came back
    c.close()
