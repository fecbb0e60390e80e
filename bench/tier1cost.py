"""Per-object cost of keeping small objects in tier 1: a file each, or packed?

N objects of K KiB are written into a scratch dir on the cache filesystem by
one thread (as one worker thread would), each way below, and read back with
the page cache dropped:

  file        create objects/<hash>, pwrite the object, close (no fsync)
  file+fsync  the same, fsync before close
  pack        pwrite at the end of one shared file (no fsync)
  lmdb/txn    one LMDB write transaction per ~100-byte record (sync=False, as
              tier 1's index commits)
  lmdb/64     the same records, 64 per transaction
  tierfs      tier 1's own path: Cache.open (record + sparse file), Entry.store
              of the whole object from aligned memory, as the read path does
              (O_DIRECT write, checksum + record), Cache.release (use)
  tierfs-buffered  the same from `bytes` (a buffered write into the page cache)

Reported per object: microseconds to write, to read back (open/pread/close of
a file vs a pread of the pack), allocated bytes beyond the data, and index
bytes per record. JSON in bench/results/tier1cost.json. Run as root
(drop_caches); no store, no mount.

Usage: python bench/tier1cost.py [--count 10000] [--kib 100] [--runs 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import xxhash
from common import RESULTS, median, report

from tierfs.cache import Cache
from tierfs.cache.directio import aligned_buffer


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def allocated(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def fid(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"bench\0train/img-{i:05d}.jpg\0etag{i}".encode())


def write_files(d: Path, data: bytes, n: int, fsync: bool) -> None:
    for i in range(n):
        fd = os.open(d / fid(i), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, data, 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def read_files(d: Path, size: int, n: int) -> None:
    for i in range(n):
        fd = os.open(d / fid(i), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if len(os.pread(fd, size, 0)) != size:
                raise RuntimeError("short read")
        finally:
            os.close(fd)


def write_pack(d: Path, data: bytes, n: int) -> None:
    fd = os.open(d / "pack", os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for i in range(n):
            os.pwrite(fd, data, i * len(data))
    finally:
        os.close(fd)


def read_pack(d: Path, size: int, n: int) -> None:
    fd = os.open(d / "pack", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for i in range(n):
            if len(os.pread(fd, size, i * size)) != size:
                raise RuntimeError("short read")
    finally:
        os.close(fd)


def lmdb_records(d: Path, n: int, per_txn: int) -> None:
    env = lmdb.open(str(d / "index"), map_size=1 << 30, sync=False, metasync=False, readahead=False)
    try:
        value = bytes(100)
        for a in range(0, n, per_txn):
            with env.begin(write=True) as txn:
                for i in range(a, min(n, a + per_txn)):
                    txn.put(xxhash.xxh3_128_digest(str(i).encode()), value)
    finally:
        env.close()


def tierfs_store(d: Path, data: bytes | memoryview, n: int) -> Cache:
    """Aligned memory (as the read path fetches into) is written with O_DIRECT;
    `bytes` take the buffered path (the page cache)."""
    cache = Cache(d / "cache", capacity=1 << 40, min_free=0)
    cache.bind("bench")
    for i in range(n):
        e = cache.open(f"train/img-{i:05d}.jpg", f"etag{i}", len(data), 0.0)
        try:
            e.store(0, data)
        finally:
            cache.release(e)
    return cache


def tierfs_read(cache: Cache, size: int, n: int) -> None:
    for i in range(n):
        e = cache.open(f"train/img-{i:05d}.jpg", f"etag{i}", size, 0.0)
        try:
            if len(e.read(0, size)) != size:
                raise RuntimeError("short read")
        finally:
            cache.release(e)


def timed(fn: Callable[[], object], n: int) -> float:
    """Microseconds per object, the dirty pages written out included (sync)."""
    t = time.perf_counter()
    fn()
    os.sync()
    return (time.perf_counter() - t) / n * 1e6


def one_run(work: Path, n: int, size: int) -> dict[str, float]:
    data = os.urandom(size)
    out: dict[str, float] = {}
    for name, fsync in (("file", False), ("file+fsync", True)):
        d = work / name
        d.mkdir()
        drop_caches()
        out[f"{name}/write_us"] = timed(lambda d=d, fsync=fsync: write_files(d, data, n, fsync), n)
        drop_caches()
        out[f"{name}/read_us"] = timed(lambda d=d: read_files(d, size, n), n)
        out[f"{name}/overhead_bytes"] = (allocated(d) - n * size) / n
        shutil.rmtree(d)
    d = work / "pack"
    d.mkdir()
    drop_caches()
    out["pack/write_us"] = timed(lambda: write_pack(d, data, n), n)
    drop_caches()
    out["pack/read_us"] = timed(lambda: read_pack(d, size, n), n)
    out["pack/overhead_bytes"] = (allocated(d) - n * size) / n
    shutil.rmtree(d)
    for per in (1, 64):
        d = work / f"lmdb{per}"
        d.mkdir()
        out[f"lmdb/{'txn' if per == 1 else per}_us"] = timed(lambda d=d, per=per: lmdb_records(d, n, per), n)
        out[f"lmdb/{'txn' if per == 1 else per}_bytes"] = (d / "index" / "data.mdb").stat().st_size / n
        shutil.rmtree(d)
    aligned = aligned_buffer(size)
    aligned[:] = data
    for name, src in (("tierfs", aligned), ("tierfs-buffered", data)):
        d = work / name
        d.mkdir()
        drop_caches()
        holder: list[Cache] = []
        out[f"{name}/write_us"] = timed(lambda d=d, src=src, h=holder: h.append(tierfs_store(d, src, n)), n)
        cache = holder[0]
        try:
            drop_caches()
            out[f"{name}/read_us"] = timed(lambda cache=cache: tierfs_read(cache, size, n), n)
        finally:
            cache.close()
        out[f"{name}/overhead_bytes"] = (allocated(d / "cache" / "objects") - n * size) / n
        out[f"{name}/index_bytes"] = (d / "cache" / "index.lmdb" / "data.mdb").stat().st_size / n
        shutil.rmtree(d)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--kib", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", help="scratch dir on the cache filesystem (default: a temp dir)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierfs-tier1cost-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, float]] = []
    loads = []
    try:
        for i in range(args.runs):
            loads.append(os.getloadavg())
            runs.append(one_run(work, args.count, args.kib * 1024))
            print(f"run {i} (load {loads[-1][0]:.2f}): " + ", ".join(f"{k}={v:.0f}" for k, v in runs[-1].items()),
                  flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    med = {k: median([r[k] for r in runs]) for k in runs[0]}
    print(f"tier1cost: {args.count} x {args.kib} KiB, median of {args.runs} runs, load "
          f"{', '.join(f'{x[0]:.2f}' for x in loads)}")
    report([(k, f"{v:10.1f}") for k, v in med.items()])
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "tier1cost.json"
    path.write_text(json.dumps({"count": args.count, "kib": args.kib, "loadavg_per_run": loads,
                                "medians": med, "raw": runs}, indent=2) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
