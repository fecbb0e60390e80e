"""file:// adapter over a tmp_path directory tree."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tierfs.store import LocalStore, StoreError, open_store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "src"
    r.mkdir()
    return r


@pytest.fixture
def store(root: Path) -> LocalStore:
    s = open_store(f"file://{root}")
    assert isinstance(s, LocalStore)
    s.check()
    return s


def test_open_and_check(root: Path, tmp_path: Path) -> None:
    s = open_store(f"file://{root}/")
    assert isinstance(s, LocalStore)
    assert s.url == f"file://{root}" and s.identity == f"file|{root}"
    assert s.supports_conditional_put and s.probe_conditional_put()

    with pytest.raises(StoreError) as ei:
        open_store(f"file://{tmp_path}/missing").check()
    assert str(ei.value) == f"file://{tmp_path}/missing: no such directory"
    assert ei.value.errno == errno.ENOENT

    (tmp_path / "plain").write_text("x")
    with pytest.raises(StoreError, match="not a directory") as ei:
        open_store(f"file://{tmp_path}/plain").check()
    assert ei.value.errno == errno.ENOTDIR


def test_put_head_get_and_etag(store: LocalStore, root: Path) -> None:
    info = store.put_bytes("a/b/c.bin", b"0123456789", metadata={"Step": "5"})
    assert (root / "a/b/c.bin").read_bytes() == b"0123456789"
    head = store.head("a/b/c.bin")
    assert head.size == 10 and head.etag == info.etag and head.metadata == {"step": "5"}
    assert head.mtime == pytest.approx((root / "a/b/c.bin").stat().st_mtime)

    assert store.get_range("a/b/c.bin", 2, 3) == b"234"
    assert store.get_range("a/b/c.bin", 8, 100) == b"89"  # clipped at EOF
    assert store.get_range("a/b/c.bin", 50, 10) == b""
    assert store.get_range("a/b/c.bin", 0, 1 << 40) == b"0123456789"  # buffer sized by the file
    buf = bytearray(4)
    assert store.get_range_into("a/b/c.bin", 6, 4, memoryview(buf), info.etag).length == 4
    assert buf == b"6789"

    again = store.put_bytes("a/b/c.bin", b"0123456789")  # same bytes, new version
    assert again.etag != info.etag
    with pytest.raises(StoreError) as ei:
        store.get_range("a/b/c.bin", 0, 4, etag=info.etag)
    assert ei.value.kind == "changed" and ei.value.errno == errno.ESTALE

    store.put_bytes("empty", b"")
    assert store.get_range("empty", 0, 100) == b""
    for missing in ("nope", "a/b", "a/b/c.bin/x"):  # absent, a bare prefix, under a file
        with pytest.raises(StoreError) as ei:
            store.head(missing)
        assert ei.value.kind == "not_found" and ei.value.errno == errno.ENOENT
    with pytest.raises(StoreError) as ei:
        store.get_range("nope", 0, 1)
    assert ei.value.kind == "not_found"


def test_list_dir_markers_and_hidden_files(store: LocalStore, root: Path) -> None:
    store.put_bytes("top.txt", b"t")
    store.put_bytes("d/x", b"xx")
    store.put_bytes("d/sub/y", b"y")
    marker = store.put_bytes("empty-dir/", b"")
    assert (root / "empty-dir").is_dir() and marker.size == 0
    assert store.head("empty-dir/").size == 0
    (root / "d" / ".tierfs-tmp-leftover").write_bytes(b"junk")

    top = store.list_dir("")
    assert [f.key for f in top.files] == ["top.txt"]
    assert sorted(top.dirs) == ["d", "empty-dir"]  # the lock file stays hidden
    d = store.list_dir("d/")
    assert [(f.key, f.size) for f in d.files] == [("d/x", 2)] and d.dirs == ["sub"]
    assert d.files[0].etag == store.head("d/x").etag
    assert store.list_dir("empty-dir/").files == []
    assert store.list_dir("missing/").files == []
    with pytest.raises(StoreError, match="must end with '/'"):
        store.list_dir("d")
    with pytest.raises(StoreError):
        store.put_bytes("m/", b"data")


def test_put_file_progress_and_conditions(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "upload"
    src.write_bytes(os.urandom(3 << 20))
    sent: list[int] = []
    info = store.put_file("ckpt/model.pt", str(src), metadata={"a": "1"}, progress=sent.append)
    assert sum(sent) == info.size == 3 << 20
    assert store.get_range("ckpt/model.pt", 0, 4 << 20) == src.read_bytes()
    assert store.head("ckpt/model.pt").metadata == {"a": "1"}

    first = store.put_bytes("latest", b"1", if_none_match=True)
    with pytest.raises(StoreError) as ei:
        store.put_bytes("latest", b"2", if_none_match=True)
    assert ei.value.kind == "precondition" and ei.value.errno == errno.ESTALE
    second = store.put_file("latest", str(src), if_match=first.etag)
    with pytest.raises(StoreError) as ei:
        store.put_bytes("latest", b"3", if_match=first.etag)
    assert ei.value.kind == "precondition"
    with pytest.raises(StoreError):
        store.put_bytes("absent", b"3", if_match=second.etag)
    assert store.head("latest").etag == second.etag
    assert not [p for p in os.listdir(store.root) if p.startswith(".tierfs-tmp")]


def test_concurrent_create_has_one_winner(store: LocalStore) -> None:
    barrier = threading.Barrier(8)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            store.put_bytes("manifest", str(i).encode(), if_none_match=True)
            return True
        except StoreError as exc:
            assert exc.kind == "precondition"
            return False

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(attempt, range(8))) == 1


@pytest.mark.parametrize(
    "key", ["../x", "a/../../x", "/etc/passwd", "a\0b", ".tierfs-lock", "d/.tierfs-tmp-1", ""]
)
def test_keys_cannot_escape_root(store: LocalStore, key: str, tmp_path: Path) -> None:
    for op in (
        lambda: store.put_bytes(key, b"x"),
        lambda: store.head(key),
        lambda: store.get_range(key, 0, 1),
        lambda: store.delete(key),
    ):
        with pytest.raises(StoreError) as ei:
            op()
        assert ei.value.kind == "invalid" and ei.value.errno == errno.EINVAL
    assert not (tmp_path / "x").exists()


def test_copy_and_delete(store: LocalStore, root: Path) -> None:
    src = store.put_bytes("s/a", b"payload", metadata={"k": "v"})
    out = store.copy("s/a", "t/b")
    assert out.size == 7 and out.metadata == {"k": "v"} and out.etag != src.etag
    assert store.get_range("t/b", 0, 100) == b"payload"
    assert store.head("t/b").metadata == {"k": "v"}
    store.copy("t/", "u/")
    assert (root / "u").is_dir()
    with pytest.raises(StoreError) as ei:
        store.copy("s/none", "t/c")
    assert ei.value.kind == "not_found"

    store.delete("t/b")
    store.delete("t/b")  # missing: fine
    store.delete("s/")  # marker of a non-empty directory: the prefix stays, like S3
    assert (root / "s/a").exists()
    store.delete("u/")
    assert not (root / "u").exists()


def test_odd_keys(store: LocalStore) -> None:
    store.put_bytes("a//b", b"1")
    store.put_bytes("x/./y", b"2")
    store.put_bytes("line\nbreak", b"3")
    assert store.get_range("a/b", 0, 10) == b"1"
    assert store.get_range("x/y", 0, 10) == b"2"
    assert "line\nbreak" in [f.key for f in store.list_dir("").files]
    with pytest.raises(StoreError) as ei:
        store.put_bytes("n/" + "z" * 300, b"4")
    assert ei.value.kind == "invalid" and ei.value.errno == errno.ENAMETOOLONG
