"""What the write path may not do to everyone else (issue 16): hold the trio
loop or a shared lock across disk I/O, or take the read path's worker slots.

Latency bounds are the issue's (generous for the work measured: a cached read
or a stat answers in well under a millisecond when nothing blocks it)."""

from __future__ import annotations

import mmap
import os
import random
import statistics
import threading
import time
from pathlib import Path

from tests.integration.conftest import MountFactory
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
# Directories' attributes never cached by the kernel: every stat reaches the daemon.
NO_ATTR_CACHE = '[classes.default]\nattr_ttl = 0\nlist_ttl = 300\n'


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.9))]


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
    reads: list[tuple[float, float]] = []  # (start, seconds)
    stats: list[tuple[float, float]] = []
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
                t0 = time.monotonic()
                assert os.preadv(rfd, [buf], off) == MiB
                reads.append((t0, time.monotonic() - t0))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def statter() -> None:
        rng = random.Random(6)
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                os.stat(mp / f"d{rng.randrange(8)}")
                stats.append((t0, time.monotonic() - t0))
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
        seal_start = time.monotonic()
        os.fsync(wfd)
        deadline = seal_start + 60
        while m.status()["pending"]["checksums_pending"]:
            assert time.monotonic() < deadline, "checksums never taken"
            time.sleep(0.01)
        seal_end = time.monotonic()
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        os.close(rfd)
        os.close(wfd)
    assert not errors, errors
    # every request that was waiting at some moment of the seal
    during_reads = [s for t, s in reads if t <= seal_end and t + s >= seal_start]
    during_stats = [s for t, s in stats if t <= seal_end and t + s >= seal_start]
    print(f"seal {seal_end - seal_start:.2f}s: {len(during_reads)} reads "
          f"p50 {statistics.median(during_reads or [0]) * 1e3:.1f} ms "
          f"p99 {p99(during_reads or [0]) * 1e3:.1f} ms; {len(during_stats)} stats "
          f"p99 {p99(during_stats or [0]) * 1e3:.1f} ms")
    assert len(during_reads) >= 3 and len(during_stats) >= 3, (seal_end - seal_start)
    # A loop blocked by the seal makes every request that came in meanwhile wait
    # until it ends, about half the seal on average; a free one answers in
    # milliseconds. The bounds leave room for a loaded 2-core machine (and a
    # read or two behind the fsync's disk writes: the seal alone is ~0.15 s)
    # without letting a blocked loop through.
    span = seal_end - seal_start
    for during in (during_reads, during_stats):
        assert statistics.median(during) < max(0.02, span / 6), (span, sorted(during))
        assert p90(during) < max(0.1, span / 3), (span, sorted(during))


def test_write_through_closes_do_not_delay_uncached_reads(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """Four concurrent write-through closes of 64 MiB files (each one uploading
    while its close waits) delay no uncached read (a ranged GET) by more than
    200 ms (p90) beyond what the same 4 KiB ranged GET costs a plain boto3
    client at the same moment: the store itself is busy taking the uploads
    (on a 2-core machine it shares with them), which is not tierfs's delay.
    Before: uploads took the GET worker slots, so reads queued behind whole
    uploads (p90 1.3-2.3 s where boto3 took a few hundred ms)."""
    data = os.urandom(64 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="cold.tar", Body=data)
    cfg = tmp_path / "through.toml"  # write-through, a per-class option
    cfg.write_text('[classes.default]\nwrite_mode = "writethrough"\n')
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    mp = m.mountpoint
    fd = os.open(mp / "cold.tar", os.O_RDONLY)  # dataset class: 4 KiB reads fetch 4 KiB
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    client = s3_server.client()
    payload = os.urandom(64 * MiB)
    started = threading.Barrier(5)
    errors: list[BaseException] = []

    def close_one(i: int) -> None:
        try:
            with open(mp / f"out-{i}.txt", "wb") as f:  # default class: write-through
                f.write(payload)
                started.wait()
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=close_one, args=(i,)) for i in range(4)]
    for w in writers:
        w.start()
    started.wait()
    lat: list[float] = []
    ref: list[float] = []
    rng = random.Random(3)
    try:
        t_end = time.monotonic() + 60
        while any(w.is_alive() for w in writers) and time.monotonic() < t_end:
            off = rng.randrange(0, len(data) // 4096) * 4096
            t0 = time.monotonic()
            assert os.pread(fd, 4096, off) == data[off : off + 4096]
            lat.append(time.monotonic() - t0)
            off = rng.randrange(0, len(data) // 4096) * 4096
            t0 = time.monotonic()
            body = client.get_object(Bucket=bucket, Key="cold.tar",
                                     Range=f"bytes={off}-{off + 4095}")["Body"].read()
            ref.append(time.monotonic() - t0)
            assert body == data[off : off + 4096]
    finally:
        for w in writers:
            w.join(120)
        os.close(fd)
    assert not errors, errors
    print(f"{len(lat)} uncached reads during the closes: p50 {statistics.median(lat) * 1e3:.1f} ms "
          f"p90 {p90(lat) * 1e3:.1f} ms max {max(lat) * 1e3:.1f} ms; boto3 4 KiB GETs meanwhile: "
          f"p50 {statistics.median(ref) * 1e3:.1f} ms p90 {p90(ref) * 1e3:.1f} ms")
    assert len(lat) >= 5
    # 200 ms: tierfs's reads and boto3's alternate, so each p90 is of a dozen or
    # two moments of a store busy with four uploads; in a loaded CI-like pass they
    # differed by 118 ms once (0.32 vs 0.20 s; alone 3 of 3 within 100 ms). Reads
    # queued behind whole uploads, what this guards against, took 1.3-2.3 s.
    assert p90(lat) <= p90(ref) + 0.200
