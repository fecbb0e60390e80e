"""`ls -l` of a directory of tiny objects on a node that never saw them (issues 20, 36).

N objects of 64 bytes are uploaded with boto3 (as any other tool writes a
dataset) under ls/ in the default class, beside N/100 symlinks made through a
tierfs mount (as another node would), and copied to a local ext4 directory.
Every run: page cache dropped, `ls -l` of the local copy; a fresh tierfs mount
with an empty tier 1, page cache dropped, `ls -l` twice, with the store
requests (LIST, HEAD, GET) each cost. A listing carries no user metadata:
tierfs HEADs none of the objects other tools wrote, and learns what it wrote
itself (the symlinks) from the directory's attribute object (one GET).

Also N images (`*.jpg`, dataset by default: issue 36) written by boto3 under
img/: per run, `ls -l` of them after a remount on the same cache dir (the
listing kept within the dataset TTL), against the local ext4 copy.

--cp-a M: also M files of 100 bytes, 0644 and 0600, each with its own
preserved mtime, copied into the mount with `cp -a` (issue 36), then per run
`ls -l` of them from a fresh node: its time, its requests per 1,000 entries
(LIST pages + attribute objects; HEADs), and whether every mtime and mode
shown is the local copy's.

Medians, the load beside them, JSON in bench/results/lsl.json. Run as root
(drop_caches).

Usage: python bench/lsl.py [--count 2000] [--runs 3] [--cp-a 10000]
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
from tests.support.trees import T0, preserved_files

DIR = "ls"
BODY = 64


CP_DIR = "cpa"
IMG_DIR = "img"


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=2000, help="objects (default 2000)")
    p.add_argument("--cp-a", type=int, default=0, help="files copied with cp -a (default 0: none)")


def ls_l(d: Path, out: list[bytes] | None = None) -> float:
    t = time.perf_counter()
    res = subprocess.run(["ls", "-l", "--time-style=+%s", str(d)], capture_output=True,
                         check=True, timeout=600)
    secs = time.perf_counter() - t
    assert res.stdout.count(b"\n") > 1
    if out is not None:
        out[:] = res.stdout.splitlines()[1:]
    return secs


def requests(m: TierfsMount) -> dict[str, float]:
    reqs = m.status()["store"]["requests"]
    return {op: float(reqs.get(op, {}).get("ok", 0)) for op in ("list", "head", "get")}


def seed_cp_a(b: Bench, local: Path, count: int) -> None:
    """`count` files with their own mtimes and two modes, cp -a'd into a mount."""
    preserved_files(local, count)
    m = b.mount()
    subprocess.run(["cp", "-a", str(local), str(m.mountpoint / CP_DIR)], check=True, timeout=3600)
    b.flush(m)
    b.unmount(m)


def cp_a_right(lines: list[bytes], count: int) -> bool:
    """Whether `ls -l` shows each copied file's mtime and mode as cp -a kept them."""
    seen = 0
    for line in lines:
        mode, _, _, _, _, mtime, name = line.split()
        i = int(name[1:6])
        seen += int(mtime) == T0 + i and mode == (b"-rw-------" if i % 10 == 0 else b"-rw-r--r--")
    return seen == count


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


def seed_images(b: Bench, local: Path, count: int) -> None:
    local.mkdir(parents=True)
    body = b"\xff\xd8\xff" + bytes(BODY - 3)

    def one(i: int) -> None:
        (local / f"img-{i:05d}.jpg").write_bytes(body)
        b.client.put_object(Bucket=BUCKET, Key=f"{IMG_DIR}/img-{i:05d}.jpg", Body=body)

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(count)))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 0, 3, extra_args)
    with Bench(args, "lsl") as b:
        local = b.work / "local" / DIR
        seed(b, local, args.count)
        seed_images(b, b.work / "local" / IMG_DIR, args.count)
        img_cache = b.work / "img-cache"
        if args.cp_a:
            seed_cp_a(b, b.work / "local" / CP_DIR, args.cp_a)
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
                for op in ("list", "head", "get"):
                    rows.setdefault(f"{name}/{op}s", []).append(after[op] - before[op])
            b.unmount(m)
            m = b.mount(img_cache)  # lists the images: a listing kept for the next mount
            ls_l(m.mountpoint / IMG_DIR)
            b.unmount(m, wipe=False)
            drop_caches()
            rows.setdefault("jpg/ext4", []).append(ls_l(b.work / "local" / IMG_DIR))
            m = b.mount(img_cache)
            drop_caches()
            before = requests(m)
            rows.setdefault("jpg/tierfs", []).append(ls_l(m.mountpoint / IMG_DIR))
            after = requests(m)
            for op in ("list", "head", "get"):
                rows.setdefault(f"jpg/{op}s", []).append(after[op] - before[op])
            b.unmount(m, wipe=False)
            if args.cp_a:
                drop_caches()
                rows.setdefault("cp-a/ext4", []).append(ls_l(b.work / "local" / CP_DIR))
                m = b.mount()
                drop_caches()
                before, lines = requests(m), list[bytes]()
                rows.setdefault("cp-a/tierfs", []).append(ls_l(m.mountpoint / CP_DIR, lines))
                after = requests(m)
                for op in ("list", "head", "get"):
                    rows.setdefault(f"cp-a/{op}s", []).append(after[op] - before[op])
                rows.setdefault("cp-a/right", []).append(float(cp_a_right(lines, args.cp_a)))
                b.unmount(m)
            print(f"run {i}: load {loads[-1]:.2f} " + ", ".join(
                f"{k}={v[-1]:.3f}" for k, v in rows.items()), flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        b.result.update(count=args.count, cp_a=args.cp_a, runs_raw=rows, medians=med, load1=loads)
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
        report([
            (f"{args.count} .jpg, ext4", f"{med['jpg/ext4']:.3f}s"),
            ("tierfs, after a remount",
             f"{med['jpg/tierfs']:.3f}s = {med['jpg/tierfs'] / med['jpg/ext4']:.1f}x ext4;"
             f" {med['jpg/lists']:.0f} LISTs, {med['jpg/heads']:.0f} HEADs,"
             f" {med['jpg/gets']:.0f} GETs"),
        ])
        if args.cp_a:
            per = 1000 / args.cp_a
            report([
                (f"cp -a of {args.cp_a}, ext4", f"{med['cp-a/ext4']:.3f}s"),
                ("cp -a, tierfs fresh node",
                 f"{med['cp-a/tierfs']:.3f}s = {med['cp-a/tierfs'] / med['cp-a/ext4']:.1f}x ext4;"
                 f" {med['cp-a/lists']:.0f} LISTs + {med['cp-a/gets']:.0f} GETs"
                 f" = {(med['cp-a/lists'] + med['cp-a/gets']) * per:.2f} per 1,000 entries,"
                 f" {med['cp-a/heads']:.0f} HEADs; mtimes and modes right in"
                 f" {sum(rows['cp-a/right']):.0f}/{len(rows['cp-a/right'])} runs"),
            ])
        b.save()


if __name__ == "__main__":
    main()
