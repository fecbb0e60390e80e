"""Read path through a real mount: single-flight, small random reads, streams,
model prefetch, kernel page cache invalidation."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
GETS = "tierfs_store_bytes_total{op=get}"


def put(s3: SeaweedServer, bucket: str, key: str, data: bytes) -> None:
    s3.client().put_object(Bucket=bucket, Key=key, Body=data)


def read_all(path: Path, bs: int = MiB) -> bytes:
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(bs):
            out += chunk
    return bytes(out)


def config(tmp_path: Path, text: str) -> str:
    p = tmp_path / f"tierfs-{abs(hash(text))}.toml"
    p.write_text(text)
    return str(p)


def alive(m: TierfsMount) -> None:
    """The daemon answers its control socket and the mount its root (a dead one: ENOTCONN)."""
    assert m.status()["pid"] == m.pid
    assert os.stat(m.mountpoint).st_ino == 1


def test_concurrent_readers_of_a_cold_file_fetch_it_once(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    data = random.Random(1).randbytes(24 * MiB + 777)
    put(s3_server, bucket, "d/shard.tar", data)
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "d/shard.tar"
    results: list[bytes] = []
    barrier = threading.Barrier(6)

    def reader() -> None:
        barrier.wait()
        results.append(read_all(path))

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data] * 6
    fetched = m.metric(GETS)
    assert len(data) <= fetched <= 1.05 * len(data)
    alive(m)


def test_random_4k_reads_fetch_about_what_they_ask(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    data = random.Random(2).randbytes(16 * MiB)
    put(s3_server, bucket, "d/records.tar", data)
    m = mount_factory(f"s3://{bucket}")
    rng = random.Random(3)
    offsets = [rng.randrange(0, len(data) // 4096) * 4096 for _ in range(200)]
    fd = os.open(m.mountpoint / "d/records.tar", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            assert os.pread(fd, 4096, off) == data[off : off + 4096]
    finally:
        os.close(fd)
    requested = len(set(offsets)) * 4096
    fetched = m.metric(GETS)
    assert fetched <= 2 * requested, (fetched, requested)
    # Unaligned small reads stay correct (they span two pages).
    fd = os.open(m.mountpoint / "d/records.tar", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in (5, 4095, len(data) - 3000):
            assert os.pread(fd, 4096, off) == data[off : off + 4096]
    finally:
        os.close(fd)
    alive(m)


def test_two_streams_in_one_file_each_read_ahead(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    data = random.Random(4).randbytes(32 * MiB)
    put(s3_server, bucket, "d/two.tar", data)
    m = mount_factory(f"s3://{bucket}")
    half = len(data) // 2
    fd = os.open(m.mountpoint / "d/two.tar", os.O_RDONLY)
    got: dict[int, bytes] = {}

    def stream(start: int) -> None:
        parts = []
        for off in range(start, start + half, MiB):
            parts.append(os.pread(fd, MiB, off))
        got[start] = b"".join(parts)

    try:
        threads = [threading.Thread(target=stream, args=(s,)) for s in (0, half)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    assert got[0] == data[:half] and got[half] == data[half:]
    fetched = m.metric(GETS)
    assert len(data) <= fetched <= 1.05 * len(data)
    # Readahead ran: far fewer GETs than the 32 one-MiB reads.
    gets = m.metric("tierfs_store_requests_total{op=get,status=ok}")
    assert gets <= 12, gets


def test_model_file_is_prefetched_whole_on_open(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    data = random.Random(5).randbytes(24 * MiB + 123)
    put(s3_server, bucket, "m/model.safetensors", data)
    put(s3_server, bucket, "m/small.safetensors", data[: 2 * MiB])
    cfg = config(tmp_path, '[read]\nprefetch_min_size = "4M"\n')
    m = mount_factory(f"s3://{bucket}", "--config", cfg)
    with open(m.mountpoint / "m/small.safetensors", "rb") as f:
        assert f.read(8) == data[:8]
    with open(m.mountpoint / "m/model.safetensors", "rb") as f:
        assert f.read(8) == data[:8]  # like safetensors: read the header, close, mmap later
    deadline = time.monotonic() + 30
    while m.metric(GETS) < len(data) + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    fetched = m.metric(GETS)
    # the big one whole (tier 1 now serves every fault), the small one only what was read
    assert len(data) <= fetched <= len(data) + 2 * MiB + 8 * MiB
    before = fetched
    import mmap

    with open(m.mountpoint / "m/model.safetensors", "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for off in range(0, len(data), 3 * MiB + 4096):
            assert mm[off : off + 100] == data[off : off + 100]
    assert m.metric(GETS) == before  # mmap faults hit tier 1
    alive(m)


def test_kernel_page_cache_is_dropped_when_the_object_changes(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    old = random.Random(6).randbytes(3 * MiB)
    new = random.Random(7).randbytes(3 * MiB)
    put(s3_server, bucket, "d/changing.tar", old)
    # the listing of d/ (default class) decides what a lookup sees: short TTLs for both
    cfg = config(tmp_path, "[classes.dataset]\nattr_ttl = 1\nlist_ttl = 1\n"
                 "[classes.default]\nattr_ttl = 1\nlist_ttl = 1\n")
    m = mount_factory(f"s3://{bucket}", "--config", cfg)
    path = m.mountpoint / "d/changing.tar"
    assert read_all(path) == old
    assert read_all(path) == old  # kept in the page cache across opens
    served_before = m.metric("tierfs_read_bytes_total{tier=cache}") + m.metric(
        "tierfs_read_bytes_total{tier=store}")
    assert read_all(path) == old
    served_after = m.metric("tierfs_read_bytes_total{tier=cache}") + m.metric(
        "tierfs_read_bytes_total{tier=store}")
    # An open that dropped the pages would have the daemon serve all 3 MiB again.
    # Not "nothing at all": this VM runs DAMON with a pageout scheme (kdamond),
    # which reclaims single page-cache pages of an idle file with GiBs free
    # (fincore showed 681..768 of 768 pages resident before a third read,
    # scattered 4 KiB reads at the daemon), and CI failed once so.
    assert served_after - served_before < len(old) // 2
    put(s3_server, bucket, "d/changing.tar", new)
    deadline = time.monotonic() + 10  # the TTLs are 1 s: well within
    while read_all(path) != new:
        # hang guard
        assert time.monotonic() < deadline, "the new version never showed"
        time.sleep(0.1)
    alive(m)


def test_object_deleted_under_a_reader_fails_the_read_not_the_daemon(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    data = random.Random(8).randbytes(12 * MiB)
    put(s3_server, bucket, "d/gone.tar", data)
    m = mount_factory(f"s3://{bucket}")
    fd = os.open(m.mountpoint / "d/gone.tar", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 0) == data[:4096]
        s3_server.client().delete_object(Bucket=bucket, Key="d/gone.tar")
        with pytest.raises(OSError):
            os.pread(fd, 4096, 10 * MiB)
    finally:
        os.close(fd)
    alive(m)
