"""Tier-1 cache integrity: checksums catch bit rot and torn writes, first serve per process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierfs.cache import Cache, ChunkCorrupt
from tierfs.cache.directio import ALIGN, aligned_buffer

CS = 4096


def new_cache(root: Path) -> Cache:
    c = Cache(root, capacity=1 << 30, chunk_size=CS, min_free=0)
    c.bind("file:///src")
    return c


def cached_file(root: Path, key: str, data: bytes) -> Path:
    """Cache `data` completely under `key`, then close the cache (a restart follows)."""
    c = new_cache(root)
    e = c.open(key, "e", len(data), 0.0)
    e.serve.store(0, data)
    path = e.path
    c.release(e)
    c.close()
    return path


def poke(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_flipped_byte_is_detected_and_dropped(tmp_path: Path) -> None:
    data = os.urandom(4 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    poke(path, 2 * CS + 17, bytes([data[2 * CS + 17] ^ 0x01]))

    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    assert e.serve.read(0, 2 * CS) == data[: 2 * CS]
    with pytest.raises(ChunkCorrupt) as ei:
        e.serve.read(0, len(data))
    assert ei.value.chunks == [2]
    assert e.serve.missing(0, len(data)) == [(2 * CS, 3 * CS)]
    assert c.stats().corrupt_chunks_total == 1
    assert c.stats().used_bytes == 3 * CS
    e.serve.store(2 * CS, data[2 * CS : 3 * CS])  # the reader refetches
    assert e.serve.read(0, len(data)) == data
    c.release(e)
    c.close()


def test_torn_write_zeroed_region(tmp_path: Path) -> None:
    """After a crash the index may say present while the file holds zeros."""
    data = os.urandom(3 * CS + 5)
    path = cached_file(tmp_path / "c", "k", data)
    poke(path, CS, bytes(CS + 3))  # chunk 1 whole and the start of chunk 2

    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    with pytest.raises(ChunkCorrupt) as ei:
        e.serve.read(CS + 100, 10)  # a small read inside the chunk still verifies all of it
    assert ei.value.chunks == [1]
    with pytest.raises(ChunkCorrupt) as ei:
        e.serve.read(2 * CS, 10)  # ends inside chunk 2: all of it is verified too
    assert ei.value.chunks == [2]
    assert e.serve.missing(0, len(data)) == [(CS, 3 * CS)]
    assert e.serve.read(3 * CS, 5) == data[3 * CS :]
    c.release(e)
    c.close()


def test_chunks_verified_once_per_process(tmp_path: Path) -> None:
    data = os.urandom(2 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    assert e.serve.read(0, len(data)) == data  # verified now
    poke(path, 0, b"\xff")  # later damage is not re-checked on the hot path...
    assert e.serve.read(1, 10) == data[1:11]
    c.release(e)
    assert c.verify_all() == [("k", [0])]  # ...but a full verification finds it
    assert c.lookup("k").cached_bytes == CS
    c.close()


def test_verified_state_survives_release_and_reopen(tmp_path: Path) -> None:
    data = os.urandom(2 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    e.serve.read(0, len(data))
    c.release(e)
    poke(path, 5, b"\x00")
    e = c.open("k", "e", len(data), 0.0)
    assert e.serve.present(0, len(data))
    assert len(e.serve.read(0, len(data))) == len(data)  # no second verification in this process
    c.release(e)
    c.close()


def test_read_into_detects_corruption(tmp_path: Path) -> None:
    data = os.urandom(3 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    poke(path, 3 * CS - 1, b"\x00" if data[-1] else b"\x01")
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    buf = aligned_buffer(len(data) + 2 * ALIGN)  # through O_DIRECT: the on-disk bytes
    with pytest.raises(ChunkCorrupt):
        e.serve.read_aligned(0, len(data), buf)
    assert e.serve.missing(0, len(data)) == [(2 * CS, 3 * CS)]
    c.release(e)
    c.close()


def test_lost_object_file_means_lost_chunks(tmp_path: Path) -> None:
    data = os.urandom(2 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    path.unlink()
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    assert e.serve.missing(0, len(data)) == [(0, 2 * CS)]
    assert c.stats().used_bytes == 0
    c.release(e)
    c.close()


def test_truncated_object_file_is_caught(tmp_path: Path) -> None:
    data = os.urandom(2 * CS)
    path = cached_file(tmp_path / "c", "k", data)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", len(data), 0.0)
    e.serve.read(0, len(data))
    os.truncate(path, CS + 10)  # damage behind the back of a verified entry
    with pytest.raises(ChunkCorrupt) as ei:
        e.serve.read(0, len(data))
    assert ei.value.chunks == [1]
    c.release(e)
    c.close()


def test_orphan_files_are_collected(tmp_path: Path) -> None:
    data = os.urandom(CS)
    path = cached_file(tmp_path / "c", "k", data)
    orphan = path.with_name("0" * 32)
    orphan.write_bytes(b"left by a crash")
    c = new_cache(tmp_path / "c")
    assert c.collect_orphans() == 1
    assert not orphan.exists() and path.exists()
    c.close()
