"""What the write path may not do to everyone else (issue 16): hold the trio
loop or a shared lock across disk I/O, or take the read path's worker slots.

Checked as orderings, never as latencies: requests that start and are answered
while a seal is still in progress, reads answered while uploads are held by
the fault proxy. The latencies themselves are bench/writelatency.py's."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
# Directories' attributes never cached by the kernel: every stat reaches the daemon.
NO_ATTR_CACHE = '[classes.default]\nattr_ttl = 0\nlist_ttl = 300\n'


@pytest.fixture
def proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def test_reads_and_stats_answer_while_a_1gib_file_is_sealed(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    """While fsync seals a 1 GiB write-back file, and while its checksums are
    taken after (bytes the kernel wrote through passthrough), O_DIRECT reads
    through another handle of the same file and stats of other paths keep
    being answered. Before: the seal held the entry's lock across the fsync and
    the trio loop waited on it, so every request of the mount stalled."""
    cfg = tmp_path / "attr.toml"
    cfg.write_text(NO_ATTR_CACHE)
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    mp = m.mountpoint
    for i in range(8):
        os.mkdir(mp / f"d{i}")
    path = mp / "big.pt"  # checkpoint class: write-back
    size = 1 << 30
    piece = os.urandom(4 * MiB)
    wfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    # Each request notes the seal's phase when it started and when it was answered:
    # 0 before, 1 fsync(2) running, 2 checksums being taken after it, 3 done.
    phase = [0]
    reads: list[tuple[int, int]] = []
    stats: list[tuple[int, int]] = []
    stop = threading.Event()
    low = [size]  # written from the top down: [low, size) holds data
    errors: list[BaseException] = []

    def reader() -> None:
        rng = random.Random(5)
        try:
            while not stop.is_set():
                first = low[0] // MiB
                if first >= size // MiB:
                    time.sleep(0.001)
                    continue
                off = rng.randrange(first, size // MiB) * MiB
                began = phase[0]
                assert os.preadv(rfd, [buf], off) == MiB
                reads.append((began, phase[0]))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def statter() -> None:
        rng = random.Random(6)
        try:
            while not stop.is_set():
                began = phase[0]
                os.stat(mp / f"d{rng.randrange(8)}")
                stats.append((began, phase[0]))
                time.sleep(0.002)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader), threading.Thread(target=statter)]
    for th in threads:
        th.start()
    try:
        # Top down: tier 1's write-behind (which follows a writer moving forward)
        # leaves the bytes dirty in the page cache, so the seal's fsync writes ~1 GiB.
        while low[0] > 0:
            assert os.pwrite(wfd, piece, low[0] - len(piece)) == len(piece)
            low[0] -= len(piece)
        phase[0] = 1
        os.fsync(wfd)
        phase[0] = 2
        deadline = time.monotonic() + 120
        while m.status()["pending"]["checksums_pending"]:
            assert time.monotonic() < deadline, "checksums never taken"  # hang guard
            time.sleep(0.01)
        phase[0] = 3
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        os.close(rfd)
        os.close(wfd)
    assert not errors, errors
    # A loop blocked by the seal answers nothing until it ends: no request could
    # start and be answered while the fsync was still running, or while the
    # checksums were taken. A free one answers stats in milliseconds throughout;
    # reads of the same file also wait for the kernel's writeback of their range
    # during the fsync (O_DIRECT), so they are counted in both phases together.
    stats_in_fsync = sum(1 for began, done in stats if began == done == 1)
    reads_in_seal = sum(1 for began, done in reads if began == done and began in (1, 2))
    print(f"answered within the seal: {stats_in_fsync} stats during the fsync, "
          f"{reads_in_seal} reads during the fsync or the checksums")
    assert stats_in_fsync >= 3 and reads_in_seal >= 3, (stats_in_fsync, reads_in_seal)


def test_write_through_closes_do_not_delay_uncached_reads(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """Concurrent write-through closes wait for their uploads, whose parts the fault
    proxy holds unanswered (at least as many as the mount has GET slots: 64 MiB
    of reads in flight / 16 MiB parts): uncached reads (ranged GETs) are answered
    meanwhile, so uploads take none of the read path's worker slots. Before:
    uploads took the GET worker slots, so reads queued behind whole uploads."""
    data = os.urandom(16 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="cold.tar", Body=data)
    cfg = tmp_path / "through.toml"  # write-through, a per-class option; a deadline
    cfg.write_text('[classes.default]\nwrite_mode = "writethrough"\n'  # past the hold
                   "[store]\ndeadline = 300\n")
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg))
    mp = m.mountpoint
    fd = os.open(mp / "cold.tar", os.O_RDONLY)  # dataset class: 4 KiB reads fetch 4 KiB
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    payload = os.urandom(32 * MiB)  # two 16 MiB parts each: 8 parts, more than 4 GET slots
    proxy.set_rules([Rule("blackhole", ops={"multipart"}, path=r"/out-.*partNumber=")])
    errors: list[BaseException] = []

    def close_one(i: int) -> None:
        try:
            with open(mp / f"out-{i}.txt", "wb") as f:  # default class: write-through
                f.write(payload)
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=close_one, args=(i,)) for i in range(4)]
    for w in writers:
        w.start()
    try:
        deadline = time.monotonic() + 120
        while proxy.stats()[("multipart", "blackhole")] < 4:  # parts held: 4 at least
            assert time.monotonic() < deadline and not errors, errors  # hang guard
            time.sleep(0.02)
        # (No subprocess meanwhile: a forked child closes its copies of the writers'
        # descriptors, and each such close is a FLUSH: a write-through upload.)
        rng = random.Random(3)
        gets = proxy.stats()[("get", "none")]
        for _ in range(20):
            off = rng.randrange(0, len(data) // 4096) * 4096
            assert os.pread(fd, 4096, off) == data[off : off + 4096]
        # answered from the store while every upload was still held, every close waiting
        assert proxy.stats()[("get", "none")] > gets
        # and no held part was given up and sent again meanwhile: the reads did not
        # wait out a stall of the uploads (one runtime client for both did: ~90 s)
        parts = [e.path for e in list(proxy.log) if "partNumber=" in e.path]
        assert len(parts) == len(set(parts)), parts
        assert all(w.is_alive() for w in writers) and not errors, errors
    finally:
        proxy.clear()  # the held requests are dropped: the uploads retry and land
        for w in writers:
            w.join(120)
        os.close(fd)
    assert not errors, errors
    assert [s3_server.client().head_object(Bucket=bucket, Key=f"out-{i}.txt")["ContentLength"]
            for i in range(4)] == [len(payload)] * 4
