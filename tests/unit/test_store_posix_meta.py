"""User metadata through both store adapters, as the POSIX attributes need it:
kept on put and multipart uploads, returned by HEAD, updated in place
(CopyObject onto itself, multipart copy above the copy limit) without
touching the bytes, and written on directory markers. S3 against a real
SeaweedFS; file:// against a real directory."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tierfs.store import LocalStore, S3Store, StoreError, open_store

MiB = 1 << 20
META = {"mode": "33261", "uid": "1000", "gid": "100", "mtime": "1700000000.123456789"}


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> S3Store | LocalStore:
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("bucket")
        s = open_store(f"s3://{bucket}/p", part_size=5 * MiB)
    else:
        (tmp_path / "root").mkdir()
        s = open_store(f"file://{tmp_path / 'root'}")
    assert isinstance(s, S3Store | LocalStore)
    return s


def test_put_and_head_carry_the_metadata(store: S3Store | LocalStore) -> None:
    put = store.put_bytes("a/f", b"hello world", metadata=META)
    assert put.metadata == META
    head = store.head("a/f")
    assert head.metadata == META and head.etag == put.etag
    assert store.get_range("a/f", 0, 5) == b"hello"


def test_multipart_upload_keeps_metadata(store: S3Store | LocalStore) -> None:
    uid = store.create_upload("m", metadata=META)
    e1 = store.upload_part("m", uid, 1, 0, b"x" * (5 * MiB))
    e2 = store.upload_part("m", uid, 2, 5 * MiB, b"tail")
    store.complete_upload("m", uid, [(1, e1), (2, e2)], 5 * MiB + 4)
    assert store.head("m").metadata == META


def test_replace_metadata_in_place(store: S3Store | LocalStore) -> None:
    put = store.put_bytes("f", b"body", metadata=dict(META, **{"tierfs-xxh3tree": "d"}))
    info = store.replace_metadata("f", {"mode": str(0o100600)}, etag=put.etag)
    want = dict(META, mode=str(0o100600), **{"tierfs-xxh3tree": "d"})  # names not given stay
    assert info.metadata == want and info.size == 4
    head = store.head("f")
    assert head.metadata == want and head.etag == info.etag
    assert store.get_range("f", 0, 10) == b"body"
    # pinned to the version it was told of: a stale ETag changes nothing
    store.put_bytes("f", b"other", metadata=META)
    with pytest.raises(StoreError) as exc:
        store.replace_metadata("f", {"mode": "1"}, etag=info.etag)
    assert exc.value.kind == "precondition" and exc.value.errno == errno.ESTALE
    assert store.head("f").metadata == META


def test_replace_metadata_above_the_copy_limit(store: S3Store | LocalStore) -> None:
    if isinstance(store, S3Store):  # multipart copy from a 5 MiB limit, in 5 MiB parts
        store.multipart_copy_threshold = 5 * MiB
        store.copy_part_size = 5 * MiB
    data = bytes(range(256)) * (12 * MiB // 256) + b"end"
    put = store.put_bytes("big", data, metadata=META)
    info = store.replace_metadata("big", {"mode": "33152"}, etag=put.etag)
    assert store.head("big").metadata == dict(META, mode="33152")
    assert store.get_range("big", 0, len(data), etag=info.etag) == data


def test_copy_keeps_or_replaces_metadata(store: S3Store | LocalStore) -> None:
    store.put_bytes("src", b"data", metadata=META)
    store.copy("src", "kept")
    assert store.head("kept").metadata == META
    info = store.copy("src", "replaced", metadata={"mode": "4516"})
    assert info.metadata == {"mode": "4516"} == store.head("replaced").metadata
    assert store.get_range("replaced", 0, 4) == b"data"
    assert store.head("src").metadata == META


def test_markers_take_metadata(store: S3Store | LocalStore) -> None:
    info = store.put_bytes("d/", b"", metadata={"mode": str(0o40700)})
    assert info.metadata == {"mode": str(0o40700)}
    if isinstance(store, LocalStore):  # xattrs on the directory; SeaweedFS 4.48 drops them
        assert store.head("d/").metadata == {"mode": str(0o40700)}


@pytest.mark.parametrize("body", [b"../target/of/a/link", b""])  # a symlink; a FIFO
def test_typed_objects_show_in_listings_and_stay_typed_across_copies(
    store: S3Store | LocalStore, body: bytes
) -> None:
    """ListObjectsV2 carries no user metadata: a symlink made by tierfs must say in
    the listing itself that a HEAD would tell more (S3: a one-part multipart
    ETag), through chmod/utimens (replace_metadata) and rename (copy); a plain
    PUT, as any other tool makes, is a regular file with no HEAD to pay."""
    link = {**META, "mode": str(0o120777)}
    info = store.put_bytes("d/link", body, metadata=link, typed=True)
    assert info.metadata == link and info.size == len(body)
    store.put_bytes("d/plain", b"small regular file", metadata=META)
    listed = {o.key: o for o in store.list_dir("d/").files}
    assert listed["d/link"].etag == info.etag and store.may_be_typed(info.etag)
    if isinstance(store, S3Store):
        assert not store.may_be_typed(listed["d/plain"].etag)
    changed = store.replace_metadata("d/link", {"mtime": "1.5"}, etag=info.etag)
    moved = store.copy("d/link", "d/moved")
    for key, meta in (("d/link", {**link, "mtime": "1.5"}), ("d/moved", {**link, "mtime": "1.5"})):
        head = store.head(key)
        assert head.metadata == meta and store.may_be_typed(head.etag)
        assert store.get_range(key, 0, 100) == body
    assert store.head("d/link").etag == changed.etag
    assert store.head("d/moved").etag == moved.etag
