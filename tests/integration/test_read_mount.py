"""The read side of a real mount: POSIX tools, mmap, tier-1 reuse, odd keys."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha(path: Path, bs: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(bs):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture
def seeded(s3_server: SeaweedServer, bucket: str) -> dict[str, bytes]:
    rng = random.Random(7)
    objs = {
        "top.txt": b"hello tierfs\n",
        "empty.bin": b"",
        "data/shard-0.tar": rng.randbytes(20 * MiB + 12345),
        "data/sub/deep/leaf.json": b'{"a": 1}',
        "data/sub/x.idx": rng.randbytes(3 * MiB),
        # not only dataset files: data/sub/'s listing is not kept across remounts
        # (kept_listings.listing_settings), so a replaced object shows after one
        "data/sub/README.txt": b"shards\n",
    }
    c = s3_server.client()
    for k, v in objs.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)
    return objs


def test_posix_tools_see_the_bucket(
    mount_factory: MountFactory, bucket: str, seeded: dict[str, bytes], s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    assert sorted(os.listdir(mp)) == ["data", "empty.bin", "top.txt"]
    assert sorted(os.listdir(mp / "data")) == ["shard-0.tar", "sub"]
    found = subprocess.run(["find", str(mp), "-type", "f"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert sorted(str(Path(p).relative_to(mp)) for p in found) == sorted(seeded)
    head = s3_server.client().head_object(Bucket=bucket, Key="data/shard-0.tar")
    st = os.stat(mp / "data/shard-0.tar")
    assert st.st_size == len(seeded["data/shard-0.tar"])
    assert int(st.st_mtime) == int(head["LastModified"].timestamp())
    assert os.stat(mp / "data").st_mode & 0o040000
    assert subprocess.run(["cat", str(mp / "top.txt")], capture_output=True, check=True).stdout == b"hello tierfs\n"
    assert (mp / "empty.bin").read_bytes() == b""
    for key, data in seeded.items():
        assert file_sha(mp / key) == sha(data), key
    out = m.mountpoint.parent / "copy.tar"
    subprocess.run(["cp", str(mp / "data/shard-0.tar"), str(out)], check=True)
    assert out.read_bytes() == seeded["data/shard-0.tar"]
    with pytest.raises(FileNotFoundError):
        os.stat(mp / "nope")


def test_random_preads_and_mmap(
    mount_factory: MountFactory, bucket: str, seeded: dict[str, bytes]
) -> None:
    m = mount_factory(f"s3://{bucket}")
    data = seeded["data/shard-0.tar"]
    rng = random.Random(1)
    fd = os.open(m.mountpoint / "data/shard-0.tar", os.O_RDONLY)
    try:
        for _ in range(200):
            off = rng.randrange(0, len(data))
            n = rng.choice([1, 4096, 65536, 1 << 20])
            assert os.pread(fd, n, off) == data[off : off + n]
        assert os.pread(fd, 100, len(data) + 10) == b""
    finally:
        os.close(fd)
    with open(m.mountpoint / "data/sub/x.idx", "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        expect = seeded["data/sub/x.idx"]
        assert mm[123456:123556] == expect[123456:123556]
        assert sha(mm[:]) == sha(expect)


def test_second_read_is_served_from_tier1(
    mount_factory: MountFactory, bucket: str, seeded: dict[str, bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "shared-cache"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    path = m.mountpoint / "data/shard-0.tar"
    assert file_sha(path) == sha(seeded["data/shard-0.tar"])
    fetched = m.metric("tierfs_store_bytes_total{op=get}")
    assert fetched >= len(seeded["data/shard-0.tar"])
    m.umount()
    # Remount on the same cache: the object is still valid by ETag and read from tier 1.
    m2 = mount_factory(f"s3://{bucket}", cache_dir=cache)
    assert file_sha(m2.mountpoint / "data/shard-0.tar") == sha(seeded["data/shard-0.tar"])
    assert m2.metric("tierfs_store_bytes_total{op=get}") == 0
    assert m2.metric("tierfs_read_bytes_total{tier=cache}") > 0


def test_changed_object_is_not_served_stale_after_remount(
    mount_factory: MountFactory, bucket: str, seeded: dict[str, bytes], tmp_path: Path,
    s3_server: SeaweedServer,
) -> None:
    cache = tmp_path / "cache-etag"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    assert (m.mountpoint / "data/sub/x.idx").read_bytes() == seeded["data/sub/x.idx"]
    m.umount()
    new = os.urandom(2 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="data/sub/x.idx", Body=new)
    m2 = mount_factory(f"s3://{bucket}", cache_dir=cache)
    assert (m2.mountpoint / "data/sub/x.idx").read_bytes() == new


def test_file_bigger_than_cache_streams_through(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    big = random.Random(3).randbytes(48 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="big.tar", Body=big)
    m = mount_factory(f"s3://{bucket}", "--cache-size", "16M")
    assert file_sha(m.mountpoint / "big.tar") == sha(big)
    st = m.status()
    assert st["cache"]["used_bytes"] <= 16 * MiB + 8 * MiB  # one part of slack in flight


def test_corrupted_chunk_is_refetched_never_served(
    mount_factory: MountFactory, bucket: str, seeded: dict[str, bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "cache-corrupt"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    data = seeded["data/shard-0.tar"]
    assert file_sha(m.mountpoint / "data/shard-0.tar") == sha(data)
    m.umount()
    files = [p for p in (cache / "objects").iterdir() if p.stat().st_size == len(data)]
    assert len(files) == 1
    with open(files[0], "r+b") as f:  # flip bytes in chunk 5
        f.seek(5 * MiB + 100)
        f.write(b"\xff" * 64)
    m2 = mount_factory(f"s3://{bucket}", cache_dir=cache)
    with open(m2.mountpoint / "data/shard-0.tar", "rb") as f:
        f.seek(5 * MiB)
        assert f.read(MiB) == data[5 * MiB : 6 * MiB]
    assert file_sha(m2.mountpoint / "data/shard-0.tar") == sha(data)
    assert m2.metric("tierfs_store_bytes_total{op=get}") >= MiB


def test_odd_keys_never_crash_the_daemon(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    # Keys SeaweedFS accepts; '.'/'..' segments and over-long names, which it
    # refuses to store, are covered in tests/unit/test_namespace.py.
    c = s3_server.client()
    odd = ["both", "both/inner", "line\nbreak", "tab\there", "sp ace/ok.txt", "dir-marker/",
           "unicodé/ß.txt", "n" * 255, "pct%2Fslash"]
    for key in odd:
        c.put_object(Bucket=bucket, Key=key, Body=b"z")
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    names = set(os.listdir(mp))
    assert {"both", "line\nbreak", "tab\there", "sp ace", "dir-marker", "unicodé", "n" * 255,
            "pct%2Fslash"} <= names
    assert os.path.isdir(mp / "both")  # object and prefix: the directory wins
    assert (mp / "both/inner").read_bytes() == b"z"
    assert os.listdir(mp / "dir-marker") == []
    assert (mp / "unicodé/ß.txt").read_bytes() == b"z"
    assert (mp / ("n" * 255)).read_bytes() == b"z"
    for root, _dirs, files in os.walk(mp):
        for f in files:
            (Path(root) / f).read_bytes()
    assert m.status()["pid"] == m.pid  # still alive


def test_file_source(mount_factory: MountFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    payload = os.urandom(5 * MiB)
    (src / "d" / "f.bin").write_bytes(payload)
    m = mount_factory(f"file://{src}")
    assert os.listdir(m.mountpoint) == ["d"]
    assert (m.mountpoint / "d" / "f.bin").read_bytes() == payload
