"""Tier-1 cache: layout, round trips, restarts, ETag validation, locking, identity."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tierfs.cache import Cache, CacheBusy, CacheConflict, CacheUnwritable
from tierfs.cache.directio import ALIGN, aligned_buffer

CS = 4096


def new_cache(root: Path, capacity: int = 1 << 30, **kw: int) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=CS, min_free=0, **kw)
    c.bind("file:///src")
    return c


def blob(n: int) -> bytes:
    return os.urandom(n)


def test_store_read_round_trip(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    data = blob(5 * CS + 123)
    e = c.open("a/b.bin", "e1", len(data), 1.0)
    e.serve.store(0, data[: 2 * CS])
    e.serve.store(2 * CS, data[2 * CS :])
    assert e.serve.read(0, len(data)) == data
    assert e.serve.read(CS - 7, 20) == data[CS - 7 : CS + 13]
    assert e.serve.read(len(data) - 10, 100) == data[-10:]  # clipped at EOF
    assert e.serve.read(len(data), 10) == b""
    buf = aligned_buffer(3 * CS + 2 * ALIGN)  # clean: served through O_DIRECT
    assert bytes(e.serve.read_aligned(CS + 5, 3 * CS, buf)) == data[CS + 5 : 4 * CS + 5]
    assert bytes(e.serve.read_aligned(len(data) - 3, 100, buf)) == data[-3:]  # clipped at EOF
    assert bytes(e.serve.read_aligned(len(data), 10, buf)) == b""
    assert c.stats().used_bytes == len(data)
    assert os.path.getsize(e.path) == len(data)
    c.release(e)
    c.close()


def test_missing_coalesces_and_clips(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    size = 10 * CS + 100
    e = c.open("k", "e", size, 0.0)
    assert e.serve.missing(0, 1 << 40) == [(0, size)]
    e.serve.store(2 * CS, bytes(2 * CS))
    e.serve.store(7 * CS, bytes(CS))
    assert e.serve.missing(0, 1 << 40) == [(0, 2 * CS), (4 * CS, 7 * CS), (8 * CS, size)]
    assert e.serve.missing(CS + 1, 2 * CS + 5) == [(CS, 2 * CS)]
    assert e.serve.missing(2 * CS, 4 * CS) == []
    assert e.serve.missing(size, size + 10) == []
    assert e.serve.missing(10 * CS + 1, 1 << 40) == [(10 * CS, size)]
    assert e.serve.present(2 * CS + 1, 4 * CS) and not e.serve.present(0, 3 * CS)
    e.serve.store(10 * CS, bytes(100))  # the short last chunk
    assert e.serve.missing(9 * CS, size) == [(9 * CS, 10 * CS)]
    c.release(e)
    c.close()


def test_store_and_read_preconditions(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", 3 * CS, 0.0)
    with pytest.raises(ValueError):
        e.serve.store(1, bytes(CS))  # unaligned
    with pytest.raises(ValueError):
        e.serve.store(0, bytes(CS + 1))  # not whole chunks, not EOF
    with pytest.raises(ValueError):
        e.serve.store(2 * CS, bytes(2 * CS))  # beyond EOF
    with pytest.raises(KeyError):
        e.serve.read(0, 10)
    e.serve.store(0, bytes(CS))
    with pytest.raises(KeyError):
        e.serve.read(CS - 1, 2)  # second chunk absent
    c.release(e)
    with pytest.raises(ValueError):
        e.serve.read(0, 1)  # released
    c.close()


def test_reopen_keeps_chunks_and_used_bytes(tmp_path: Path) -> None:
    data = blob(4 * CS + 10)
    c = new_cache(tmp_path / "c")
    e = c.open("x/y", "e1", len(data), 5.0)
    e.serve.store(0, data[: 2 * CS])
    e.serve.store(4 * CS, data[4 * CS :])
    c.release(e)
    c.close()

    c = Cache(tmp_path / "c", capacity=1 << 30, chunk_size=CS, min_free=0)
    assert c.bind("file:///src") is True
    assert c.stats().used_bytes == 2 * CS + 10
    obj = c.lookup("x/y")
    assert obj is not None and (obj.etag, obj.size, obj.cached_bytes, obj.state) == (
        "e1",
        len(data),
        2 * CS + 10,
        "clean",
    )
    e = c.open("x/y", "e1", len(data), 5.0)
    assert e.serve.missing(0, len(data)) == [(2 * CS, 4 * CS)]
    assert e.serve.read(0, 2 * CS) == data[: 2 * CS]
    assert e.serve.read(4 * CS, 10) == data[4 * CS :]
    c.release(e)
    c.close()


def test_etag_change_drops_chunks(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "v1", 2 * CS, 0.0)
    e.serve.store(0, blob(2 * CS))
    old_path = e.path
    c.release(e)
    e = c.open("k", "v2", 2 * CS, 1.0)
    assert e.serve.missing(0, 2 * CS) == [(0, 2 * CS)]
    assert not old_path.exists() and e.path != old_path
    assert c.stats().used_bytes == 0
    assert c.lookup("k").etag == "v2"
    c.release(e)
    c.close()


def test_etag_change_while_open_detaches_old_version(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    v1 = blob(2 * CS)
    old = c.open("k", "v1", len(v1), 0.0)
    old.serve.store(0, v1)
    new = c.open("k", "v2", CS, 1.0)
    assert new is not old
    assert old.serve.read(0, len(v1)) == v1  # the old holder keeps its version
    assert new.serve.missing(0, CS) == [(0, CS)]
    new.serve.store(0, bytes(CS))
    assert c.stats().used_bytes == CS
    assert c.open("k", "v2", CS, 1.0) is new
    c.release(new)
    c.release(new)
    c.release(old)
    assert c.stats().used_bytes == CS
    assert c.lookup("k").etag == "v2"
    c.close()


def test_same_object_shares_one_entry(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    a = c.open("k", "e", CS, 0.0)
    b = c.open("k", "e", CS, 0.0)
    assert a is b
    a.serve.store(0, bytes(CS))
    c.release(a)
    assert b.serve.read(0, 4) == bytes(4)  # still open once
    c.release(b)
    with pytest.raises(ValueError):
        c.release(b)
    assert c.stats().open_objects == 0
    c.close()


def test_second_cache_on_same_dir_is_busy(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    with pytest.raises(CacheBusy):
        Cache(tmp_path / "c", capacity=1 << 20, chunk_size=CS)
    c.close()
    Cache(tmp_path / "c", capacity=1 << 20, chunk_size=CS).close()  # free again


def test_unwritable_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheUnwritable) as ei:
        Cache(tmp_path / "file" / "cache", capacity=1 << 20)
    msg = str(ei.value)
    assert msg == f"cache dir {tmp_path / 'file' / 'cache'} is not writable: Not a directory"
    assert "\n" not in msg


def test_dirs_are_private(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    new_cache(root).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "objects").stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "index.lmdb").stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "key", ["../../etc/passwd", "/etc/passwd", "a/../../../b", "..", "x\0y", "é/" * 300 + "long"]
)
def test_keys_never_name_files(tmp_path: Path, key: str) -> None:
    root = tmp_path / "c"
    c = new_cache(root)
    e = c.open(key, "e", 10, 0.0)
    e.serve.store(0, b"0123456789")
    assert e.path.parent == root / "objects"
    assert len(e.path.name) == 32 and set(e.path.name) <= set("0123456789abcdef")
    c.release(e)
    assert c.lookup(key).cached_bytes == 10
    c.close()
    found = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    assert all(str(p).startswith("c") for p in found)
    assert {p.name for p in (root / "objects").iterdir()} == {e.path.name}


def test_lookup_and_iter_objects(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    for k in ["d/a", "d/b", "e/c"]:
        c.release(c.open(k, "t" + k, 1, 2.0))
    held = c.open("d/z", "tz", CS, 3.0)
    held.serve.store(0, bytes(CS))
    assert c.lookup("nope") is None
    assert sorted(o.key for o in c.iter_objects("d/")) == ["d/a", "d/b", "d/z"]
    assert {o.key: o.cached_bytes for o in c.iter_objects()} == {
        "d/a": 0,
        "d/b": 0,
        "e/c": 0,
        "d/z": CS,
    }
    assert c.stats().objects == 4
    c.release(held)
    c.close()


def test_bind_new_identity_wipes(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e", CS, 0.0)
    e.serve.store(0, bytes(CS))
    c.release(e)
    assert c.bind("file:///src") is True
    assert c.bind("s3://other") is False
    assert c.stats().used_bytes == 0 and c.lookup("k") is None
    assert list((tmp_path / "c" / "objects").iterdir()) == []
    c.close()
    c = Cache(tmp_path / "c", capacity=1 << 20, chunk_size=CS)
    assert c.bind("s3://other") is True
    c.close()


def test_bind_keeps_pending_uploads_of_another_source(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("ckpt.pt", "", 0, 0.0)
    e.local.write(0, b"weights")
    e.local.seal()
    c.release(e)
    with pytest.raises(CacheConflict):
        c.bind("s3://other")
    assert c.lookup("ckpt.pt").state == "sealed"
    c.close()


def test_existing_cache_keeps_its_chunk_size(tmp_path: Path) -> None:
    new_cache(tmp_path / "c").close()
    c = Cache(tmp_path / "c", capacity=1 << 20, chunk_size=1 << 20)
    assert c.chunk_size == CS
    c.close()
