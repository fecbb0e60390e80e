"""`ls -l` of a directory of tiny objects on a node that never saw them (issue 20).

N objects of 64 bytes are uploaded with boto3 (as any other tool writes a
dataset) under ls/ in the default class, beside N/100 symlinks made through a
tierfs mount (as another node would), and copied to a local ext4 directory.
Every run: page cache dropped, `ls -l` of the local copy; a fresh tierfs mount
with an empty tier 1, page cache dropped, `ls -l` twice, with the store
requests (LIST, HEAD) each cost. A listing carries no user metadata: tierfs
HEADs only the small objects whose ETag says they may be typed (the symlinks
it made), not one per object. Medians, the load beside them, JSON in
bench/results/lsl.json. Run as root (drop_caches).

Usage: python bench/lsl.py [--count 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import BUCKET, Bench, drop_caches, parse_args, report

from tests.support.mount import TierfsMount

DIR = "ls"
BODY = 64


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=2000, help="objects (default 2000)")


def ls_l(d: Path) -> float:
    t = time.perf_counter()
    res = subprocess.run(["ls", "-l", str(d)], capture_output=True, check=True, timeout=600)
    secs = time.perf_counter() - t
    assert res.stdout.count(b"\n") > 1
    return secs


def requests(m: TierfsMount) -> dict[str, float]:
    reqs = m.status()["store"]["requests"]
    return {op: float(reqs.get(op, {}).get("ok", 0)) for op in ("list", "head")}


def seed(b: Bench, local: Path, count: int) -> None:
    local.mkdir(parents=True)

    def one(i: int) -> None:
        data = f"{i:08d}".encode() * (BODY // 8)
        (local / f"obj-{i:05d}.txt").write_bytes(data)
        b.client.put_object(Bucket=BUCKET, Key=f"{DIR}/obj-{i:05d}.txt", Body=data)

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(count)))
    m = b.mount()
    for i in range(0, count, 100):  # symlinks another node made
        os.symlink(f"obj-{i:05d}.txt", m.mountpoint / DIR / f"link-{i:05d}")
        os.symlink(f"obj-{i:05d}.txt", local / f"link-{i:05d}")
    b.flush(m)
    b.unmount(m)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 0, 3, extra_args)
    with Bench(args, "lsl") as b:
        local = b.work / "local" / DIR
        seed(b, local, args.count)
        rows: dict[str, list[float]] = {}
        loads = []
        for i in range(args.runs):
            loads.append(os.getloadavg()[0])
            drop_caches()
            rows.setdefault("ext4", []).append(ls_l(local))
            m = b.mount()
            d = m.mountpoint / DIR
            drop_caches()
            for name in ("tierfs/first", "tierfs/second"):
                before = requests(m)
                rows.setdefault(name, []).append(ls_l(d))
                after = requests(m)
                for op in ("list", "head"):
                    rows.setdefault(f"{name}/{op}s", []).append(after[op] - before[op])
            b.unmount(m)
            print(f"run {i}: load {loads[-1]:.2f} " + ", ".join(
                f"{k}={v[-1]:.3f}" for k, v in rows.items()), flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        b.result.update(count=args.count, runs_raw=rows, medians=med, load1=loads)
        print(f"lsl: ls -l of {args.count} x {BODY} B objects + {len(range(0, args.count, 100))} "
              f"symlinks, median of {args.runs}; 1-min load: {', '.join(f'{x:.2f}' for x in loads)}")
        ext4 = med["ext4"]
        report([
            ("ext4 (page cache dropped)", f"{ext4:.3f}s"),
            ("tierfs, fresh node", f"{med['tierfs/first']:.3f}s = {med['tierfs/first'] / ext4:.1f}x ext4;"
             f" {med['tierfs/first/lists']:.0f} LISTs, {med['tierfs/first/heads']:.0f} HEADs"),
            ("tierfs, again", f"{med['tierfs/second']:.3f}s = {med['tierfs/second'] / ext4:.1f}x ext4;"
             f" {med['tierfs/second/lists']:.0f} LISTs, {med['tierfs/second/heads']:.0f} HEADs"),
        ])
        b.save()


if __name__ == "__main__":
    main()
