"""A dataset of small objects: N x 100 KiB objects in one directory (issue 21).

The objects are uploaded with boto3 under train/ (img-00000.jpg, ...) and
copied to a local ext4 directory. tierfs mounts with a config that makes train/
and its files the dataset class (listings and attributes kept for minutes), as a
user with such a dataset would. Every run measures, in this order:

  references  local ext4 serial read of all (page cache dropped); raw boto3 GET
              of every object, serial and with 8 threads
  tierfs      fresh mount, empty tier 1:
                ls -l of train/ twice (LISTs counted)
                cold serial read of all, in listing order (what `cat train/*` does)
              umount, page cache dropped, remount on the same cache dir:
                ls -l (LISTs counted: 0 expected within the TTL)
                warm serial read of all (GETs counted: 0 expected)
              tier-1 space and index size per object (after the cold read)
              fresh mount, empty tier 1: cold read of all by 8 readers (xargs -P8
                -n64: batches of 64 files in listing order, 8 at a time)
              fresh mount, empty tier 1: a listing, then a shuffled read of
                --sample of the objects by 4 workers (store bytes vs bytes read)
  --peers     rclone / s3fs (bench/peers.py), each fresh: ls -l twice, cold
              serial read of all, cold read by 8 readers

Reads are open / read(128 KiB) until EOF / close per file, as cat does. Store
requests (GET, LIST, HEAD) and GET bytes come from the mount's `tierfs status`
before and after each step. Beside every measurement: the 1-minute load average
and the share of the machine left idle during it. JSON and a PNG chart in
bench/results/ (smallfiles[-TAG].json/.png). Run as root (drop_caches).

Usage: python bench/smallfiles.py [--count 10000] [--kib 100] [--runs 3]
       [--sample 1000] [--tag NAME] [--peers] [--tierfs-config FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import peers
from common import (
    BUCKET,
    RESULTS,
    Bench,
    _machine_ticks,
    drop_caches,
    median,
    parse_args,
    report,
)

from tests.support.mount import TierfsMount

DIR = "train"
READ_BUF = 128 << 10  # what cat reads at a time
BATCH = 64  # xargs -n: files per cat process
READERS = 8
SHUFFLE_WORKERS = 4
# The dataset class for the directory and everything in it: listings and
# attributes trusted for minutes, no revalidation on open.
CONFIG = f"""\
[[rules]]
glob = "{DIR}"
class = "dataset"

[[rules]]
glob = "{DIR}/**"
class = "dataset"
"""


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=10_000, help="objects (default 10000)")
    p.add_argument("--kib", type=int, default=100, help="KiB per object (default 100)")
    p.add_argument("--sample", type=int, default=1000, help="objects of the shuffled read (default 1000)")
    p.add_argument("--tag", help="suffix of the result files: smallfiles-TAG.json/.png")
    p.add_argument("--tierfs-config", metavar="FILE",
                   help="mount tierfs with this config file instead of the built-in dataset rules")
    p.add_argument("--skip-refs", action="store_true", help="measure tierfs (and peers) only")


def names(count: int) -> list[str]:
    return [f"img-{i:05d}.jpg" for i in range(count)]


# -- reading ------------------------------------------------------------------------


def read_file(path: Path | str, buf: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
        return total
    finally:
        os.close(fd)


def serial(paths: Iterable[Path]) -> int:
    buf = memoryview(bytearray(READ_BUF))
    return sum(read_file(p, buf) for p in paths)


def pulled(items: list[Any], workers: int, batch: int, work: Callable[[list[Any]], int]) -> int:
    """`workers` threads each take the next `batch` of `items` (in order) until none
    is left: xargs -P`workers` -n`batch`, or a DataLoader's workers."""
    batches = iter([items[i : i + batch] for i in range(0, len(items), batch)])
    lock = threading.Lock()

    def worker() -> int:
        total = 0
        while True:
            with lock:
                part = next(batches, None)
            if part is None:
                return total
            total += work(part)

    with ThreadPoolExecutor(workers) as ex:
        return sum(ex.map(lambda _: worker(), range(workers)))


def boto_get(b: Bench, keys: list[str]) -> int:
    total = 0
    for k in keys:
        total += len(b.client.get_object(Bucket=BUCKET, Key=k)["Body"].read())
    return total


def ls_l(d: Path) -> int:
    res = subprocess.run(["ls", "-l", str(d)], capture_output=True, check=True)
    return len(res.stdout.splitlines()) - 1  # the "total" line


# -- measuring ----------------------------------------------------------------------


def measure(fn: Callable[[], int]) -> dict[str, float]:
    """Seconds of one call and what it returned, the 1-minute load average before it
    and the share of the machine left idle during it."""
    load1 = os.getloadavg()[0]
    idle0, ticks0 = _machine_ticks()
    t = time.perf_counter()
    n = fn()
    secs = time.perf_counter() - t
    idle1, ticks1 = _machine_ticks()
    return {"s": secs, "n": n, "load1": load1, "idle": (idle1 - idle0) / max(1, ticks1 - ticks0)}


def counters(m: TierfsMount) -> dict[str, float]:
    """The mount's store requests that succeeded, by op, and GET bytes."""
    st = m.status()
    reqs = st["store"]["requests"]
    out = {op: float(reqs.get(op, {}).get("ok", 0)) for op in ("get", "list", "head")}
    out["get_bytes"] = float(st["store"]["get_bytes"])
    return out


def with_requests(m: TierfsMount, fn: Callable[[], int]) -> dict[str, float]:
    before = counters(m)
    out = measure(fn)
    after = counters(m)
    out.update({k: after[k] - before[k] for k in after})
    return out


def tier1_footprint(cache: Path) -> dict[str, float]:
    """Allocated bytes of the object files, how many there are, and the index's size."""
    files = blocks = 0
    for de in os.scandir(cache / "objects"):
        if de.is_file(follow_symlinks=False):
            files += 1
            blocks += de.stat(follow_symlinks=False).st_blocks * 512
    data = cache / "index.lmdb" / "data.mdb"
    index = data.stat().st_size if data.exists() else 0
    return {"object_files": files, "object_bytes_allocated": blocks, "index_bytes": index}


# -- one run ------------------------------------------------------------------------


class Run:
    def __init__(self, b: Bench, args: argparse.Namespace, local: Path, cfg: Path,
                 res: dict[str, list[dict[str, float]]]) -> None:
        self.b, self.args, self.local, self.cfg, self.res = b, args, local, cfg, res
        self.files = names(args.count)
        self.keys = [f"{DIR}/{n}" for n in self.files]
        self.total = args.count * args.kib * 1024

    def put(self, name: str, row: dict[str, float]) -> None:
        self.res.setdefault(name, []).append(row)
        extra = "".join(f" {k}={row[k]:.0f}" for k in ("get", "list", "head") if k in row)
        print(f"  {name}: {row['s']:.2f}s (load {row['load1']:.2f}, idle {row['idle']:.0%}){extra}",
              flush=True)

    def mount(self, cache: Path | None = None) -> TierfsMount:
        return self.b.mount(cache, "--config", str(self.cfg))

    def references(self) -> None:
        drop_caches()
        self.put("local/serial", measure(lambda: serial(self.local / f for f in self.files)))
        self.put("boto3/serial", measure(lambda: boto_get(self.b, self.keys)))
        self.put("boto3/8threads", measure(
            lambda: pulled(self.keys, READERS, 1, lambda ks: boto_get(self.b, ks))))

    def tierfs(self) -> None:
        b = self.b
        m = self.mount()
        d = m.mountpoint / DIR
        drop_caches()
        self.put("tierfs/ls1", with_requests(m, lambda: ls_l(d)))
        self.put("tierfs/ls2", with_requests(m, lambda: ls_l(d)))
        drop_caches()
        self.put("tierfs/cold_serial", with_requests(m, lambda: serial(d / f for f in self.files)))
        foot = tier1_footprint(m.cache_dir)
        st = m.status()["cache"]
        foot.update(used_bytes=st["used_bytes"], objects=st["objects"])
        self.res.setdefault("tier1", []).append(foot)
        print(f"  tier1: {foot}", flush=True)
        cache = m.cache_dir
        b.unmount(m, wipe=False)
        drop_caches()
        m = self.mount(cache)
        d = m.mountpoint / DIR
        self.put("tierfs/ls_remount", with_requests(m, lambda: ls_l(d)))
        drop_caches()
        self.put("tierfs/warm_serial", with_requests(m, lambda: serial(d / f for f in self.files)))
        b.unmount(m)
        m = self.mount()
        d = m.mountpoint / DIR
        self.put("tierfs/list", with_requests(m, lambda: len(os.listdir(d))))
        drop_caches()
        self.put("tierfs/cold_8readers", with_requests(
            m, lambda: pulled([d / f for f in self.files], READERS, BATCH, serial)))
        b.unmount(m)
        m = self.mount()
        d = m.mountpoint / DIR
        listed = sorted(os.listdir(d))  # a DataLoader builds its file list first
        sample = random.Random(len(self.res.get("tierfs/shuffled", []))).sample(listed, self.args.sample)
        drop_caches()
        row = with_requests(m, lambda: pulled([d / f for f in sample], SHUFFLE_WORKERS, 1, serial))
        row["fetched_vs_read"] = row["get_bytes"] / row["n"]
        self.put("tierfs/shuffled", row)
        b.unmount(m)

    def peer(self, p: peers.Peer) -> None:
        with peers.mount(self.b, p) as pm:
            d = pm.mountpoint / DIR
            drop_caches()
            self.put(f"{p.name}/ls1", measure(lambda: ls_l(d)))
            self.put(f"{p.name}/ls2", measure(lambda: ls_l(d)))
            drop_caches()
            self.put(f"{p.name}/cold_serial", measure(lambda: serial(d / f for f in self.files)))
        with peers.mount(self.b, p) as pm:
            d = pm.mountpoint / DIR
            os.listdir(d)
            drop_caches()
            self.put(f"{p.name}/cold_8readers", measure(
                lambda: pulled([d / f for f in self.files], READERS, BATCH, serial)))


# -- reporting ----------------------------------------------------------------------


def medians(res: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {name: {k: median([r[k] for r in rows]) for k in rows[0]} for name, rows in res.items()}


def table(med: dict[str, dict[str, float]], args: argparse.Namespace,
          others: list[str]) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """The issue's rows: (work, measured, target, met?) and the ratios behind them."""
    total = args.count * args.kib * 1024
    s = {k: v["s"] for k, v in med.items() if "s" in v}
    rate = {k: total / v / 1e6 for k, v in s.items()}
    ratios: dict[str, float] = {}
    rows: list[tuple[str, str, str, str]] = []

    def row(work: str, measured: str, target: str, ok: bool | None) -> None:
        rows.append((work, measured, target, "-" if ok is None else ("yes" if ok else "NO")))

    if "tierfs/cold_serial" in s and "boto3/8threads" in s:
        r = ratios["cold_serial_vs_boto3_8threads"] = s["tierfs/cold_serial"] / s["boto3/8threads"]
        row("cold serial read of all", f"{s['tierfs/cold_serial']:.1f}s = {r:.2f}x boto3 8 threads "
            f"({s['boto3/8threads']:.1f}s; serial {s.get('boto3/serial', float('nan')):.1f}s)",
            "<= 1.5x", r <= 1.5)
    peer_rates = {p: rate[f"{p}/cold_serial"] for p in others if f"{p}/cold_serial" in rate}
    if "tierfs/cold_8readers" in rate:
        if peer_rates:
            best = max(peer_rates, key=lambda p: peer_rates[p])
            r = ratios["cold_8readers_vs_best_peer_cold_serial"] = rate["tierfs/cold_8readers"] / peer_rates[best]
            row("cold, 8 readers", f"{rate['tierfs/cold_8readers']:.0f} MB/s = {r:.1f}x {best}'s "
                f"cold serial ({peer_rates[best]:.0f} MB/s)", ">= 3x", r >= 3)
        else:
            row("cold, 8 readers", f"{rate['tierfs/cold_8readers']:.0f} MB/s (no peers measured)",
                ">= 3x fastest peer", None)
    if "tierfs/warm_serial" in med:
        gets = med["tierfs/warm_serial"]["get"]
        row("warm after a remount: store GETs", f"{gets:.0f}", "0", gets == 0)
        if "local/serial" in s:
            r = ratios["warm_serial_vs_local"] = s["tierfs/warm_serial"] / s["local/serial"]
            row("warm after a remount, serial read of all", f"{s['tierfs/warm_serial']:.2f}s = "
                f"{r:.2f}x local ext4 ({s['local/serial']:.2f}s)", "<= 3x", r <= 3)
    if "tierfs/ls_remount" in med:
        lists = med["tierfs/ls_remount"]["list"]
        r = ratios["ls_remount_vs_ls2"] = s["tierfs/ls_remount"] / s["tierfs/ls2"]
        row("ls -l after a remount", f"{lists:.0f} LISTs, {s['tierfs/ls_remount']:.2f}s = {r:.2f}x "
            f"the second ls before ({s['tierfs/ls2']:.2f}s)", "0 LISTs, <= 2x",
            lists == 0 and r <= 2)
    if "tierfs/shuffled" in med:
        f = ratios["shuffled_fetched_vs_read"] = med["tierfs/shuffled"]["fetched_vs_read"]
        row(f"shuffled read of {args.sample} by {SHUFFLE_WORKERS} workers: store bytes",
            f"{f:.2f}x bytes read", "<= 1.3x", f <= 1.3)
    return rows, ratios


def chart(med: dict[str, dict[str, float]], others: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("read all, serial", [("local ext4", "local/serial"), ("boto3 serial", "boto3/serial"),
                              ("boto3 8 threads", "boto3/8threads"),
                              ("tierfs cold", "tierfs/cold_serial"),
                              ("tierfs warm (remount)", "tierfs/warm_serial"),
                              *((f"{p} cold", f"{p}/cold_serial") for p in others)]),
        ("read all, 8 readers", [("boto3 8 threads", "boto3/8threads"),
                                 ("tierfs cold", "tierfs/cold_8readers"),
                                 *((f"{p} cold", f"{p}/cold_8readers") for p in others)]),
        ("ls -l", [("tierfs 1st", "tierfs/ls1"), ("tierfs 2nd", "tierfs/ls2"),
                   ("tierfs after remount", "tierfs/ls_remount"),
                   *((f"{p} {n}", f"{p}/ls{i}") for p in others for i, n in ((1, "1st"), (2, "2nd")))]),
    ]
    fig, axes = plt.subplots(1, len(groups), figsize=(15, 4.8))
    for ax, (name, series) in zip(axes, groups, strict=True):
        have = [(label, med[k]["s"]) for label, k in series if k in med]
        bars = ax.bar(range(len(have)), [v for _, v in have])
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.set_xticks(range(len(have)), [label for label, _ in have], rotation=30, ha="right",
                      fontsize=7)
        ax.set_ylabel("seconds (median)")
        ax.set_title(name, fontsize=10)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------


def seed(b: Bench, local: Path, count: int, size: int) -> None:
    """Upload the objects with boto3 (16 threads) and keep a local ext4 copy."""
    local.mkdir(parents=True)

    def one(name: str) -> None:
        data = random.Random(name).randbytes(size)
        (local / name).write_bytes(data)
        b.client.put_object(Bucket=BUCKET, Key=f"{DIR}/{name}", Body=data)

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, names(count)))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 0, 3, extra_args)
    name = f"smallfiles-{args.tag}" if args.tag else "smallfiles"
    with Bench(args, name) as b:
        size = args.kib * 1024
        local = b.work / "local" / DIR
        t = time.perf_counter()
        seed(b, local, args.count, size)
        print(f"seeded {args.count} x {args.kib} KiB in {time.perf_counter() - t:.1f}s", flush=True)
        if args.tierfs_config:
            cfg = Path(args.tierfs_config).resolve()
        else:
            cfg = b.work / "tierfs.toml"
            cfg.write_text(CONFIG)
        others = peers.select(b)
        res: dict[str, list[dict[str, float]]] = {}
        loads = []
        for i in range(args.runs):
            loads.append(os.getloadavg())
            print(f"run {i}: load {loads[-1][0]:.2f}", flush=True)
            run = Run(b, args, local, cfg, res)
            if not args.skip_refs:
                run.references()
            run.tierfs()
            for p in others:
                run.peer(p)
        med = medians(res)
        rows, ratios = table(med, args, [p.name for p in others])
        foot = med.get("tier1", {})
        per_obj: dict[str, float] = {}
        if foot:
            data = args.count * size
            per_obj = {
                "object_files": foot["object_files"],
                "tier1_overhead_bytes_per_object":
                    (foot["object_bytes_allocated"] - min(data, foot["used_bytes"])) / args.count,
                "index_bytes_per_object": foot["index_bytes"] / args.count,
                "cached_share": foot["used_bytes"] / data,
            }
        head = (f"smallfiles: {args.count} x {args.kib} KiB in one directory, median of {args.runs} "
                f"runs; 1-min load at each run's start: {', '.join(f'{x[0]:.2f}' for x in loads)}")
        print(head)
        report([(w, f"{m}  [target {t}: {ok}]") for w, m, t, ok in rows])
        if per_obj:
            print("tier 1 per object: " + ", ".join(f"{k}={v:.2f}" for k, v in per_obj.items()))
        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / f"{name}.png"
        chart(med, [p.name for p in others], head, png)
        print(f"chart: {png}")
        b.result.update(count=args.count, object_bytes=size, sample=args.sample, config=cfg.read_text(),
                        loadavg_per_run=loads, medians=med, ratios=ratios, table=rows,
                        tier1_per_object=per_obj, raw=res)
        b.save()


if __name__ == "__main__":
    main()
