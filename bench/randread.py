"""Random 4 KiB preads of one big object: reads/s and bytes fetched vs requested.

  cold: empty tier 1, page cache dropped   warm: tier 1 kept, page cache dropped
  reference: raw boto3 ranged GETs of the same 4 KiB ranges (same count, one thread);
  warm also vs bench/passthrough.py over the local file (page cache dropped): the
  same reads through a minimal pyfuse3 filesystem, i.e. what pyfuse3 itself costs

The reader calls posix_fadvise(POSIX_FADV_RANDOM), as random-access loaders do,
so the kernel sends each 4 KiB pread as it is instead of widening it.

With --peers, each installed peer (bench/peers.py) too, same offsets and reader:
reads/s cold (fresh mount, empty disk cache) and warm (disk cache kept), and the
bytes its disk cache holds afterwards vs requested (what it fetched and kept).

Usage: python bench/randread.py [--size 2G] [--runs 3] [--reads 2000] [--peers]
"""

from __future__ import annotations

import os
import random
import time

import peers
from common import Bench, MiB, drop_caches, median, parse_args, report, write_random_file

KEY = "rand/records-000.tar"
IO = 4096


def preads(path, offsets: list[int], fadvise: bool) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        if fadvise:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t = time.perf_counter()
        for off in offsets:
            if len(os.pread(fd, IO, off)) != IO:
                raise RuntimeError(f"short read at {off}")
        return time.perf_counter() - t
    finally:
        os.close(fd)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 2 << 30, 3,
                      lambda p: p.add_argument("--reads", type=int, default=2000))
    with Bench(args, "randread") as b:
        local = b.work / "local.tar"
        write_random_file(local, args.size)
        b.seed(KEY, local)
        requested = args.reads * IO
        others = peers.select(b)
        res: dict[str, list[float]] = {k: [] for k in (
            "tierfs_cold_rps", "tierfs_warm_rps", "boto3_rps", "local_cold_rps", "passthrough_warm_rps",
            "cold_fetched_vs_requested", "warm_fetched_bytes", "nofadvise_fetched_vs_requested",
            *(f"{p.name}_{s}" for p in others
              for s in ("cold_rps", "warm_rps", "cached_vs_requested")))}
        for run in range(args.runs):
            rng = random.Random(run)
            offsets = [rng.randrange(0, args.size // IO) * IO for _ in range(args.reads)]
            drop_caches()
            res["local_cold_rps"].append(args.reads / preads(local, offsets, True))
            t = time.perf_counter()
            for off in offsets:
                b.client.get_object(Bucket="bench", Key=KEY, Range=f"bytes={off}-{off + IO - 1}")["Body"].read()
            res["boto3_rps"].append(args.reads / (time.perf_counter() - t))
            m = b.mount()
            path = m.mountpoint / KEY
            drop_caches()
            res["tierfs_cold_rps"].append(args.reads / preads(path, offsets, True))
            cold = b.store_get_bytes(m)
            res["cold_fetched_vs_requested"].append(cold / requested)
            drop_caches()
            res["tierfs_warm_rps"].append(args.reads / preads(path, offsets, True))
            res["warm_fetched_bytes"].append(b.store_get_bytes(m) - cold)
            b.unmount(m)
            with b.passthrough(local.parent) as pt:
                drop_caches()
                res["passthrough_warm_rps"].append(args.reads / preads(pt / local.name, offsets, True))
            # Without the fadvise: what the kernel's own readahead widens a 4 KiB read to.
            m = b.mount()
            drop_caches()
            preads(m.mountpoint / KEY, offsets[:500], False)
            res["nofadvise_fetched_vs_requested"].append(b.store_get_bytes(m) / (500 * IO))
            b.unmount(m)
            for p in others:
                with peers.mount(b, p) as pm:
                    drop_caches()
                    res[f"{p.name}_cold_rps"].append(args.reads / preads(pm.mountpoint / KEY, offsets, True))
                    drop_caches()
                    res[f"{p.name}_warm_rps"].append(args.reads / preads(pm.mountpoint / KEY, offsets, True))
                    pm.stop()  # let background downloads end before counting the cache
                    res[f"{p.name}_cached_vs_requested"].append(pm.cached_bytes() / requested)
            print(f"run {run}: " + ", ".join(f"{k}={v[-1]:.1f}" for k, v in res.items()))
        med = {k: median(v) for k, v in res.items()}
        ratios = {
            "cold_rps_vs_boto3": med["tierfs_cold_rps"] / med["boto3_rps"],
            "warm_rps_vs_local_cold": med["tierfs_warm_rps"] / med["local_cold_rps"],
            "warm_rps_vs_passthrough": med["tierfs_warm_rps"] / med["passthrough_warm_rps"],
            "cold_fetched_vs_requested": med["cold_fetched_vs_requested"],
        }
        for p in others:
            ratios[f"cold_rps_vs_{p.name}"] = med["tierfs_cold_rps"] / med[f"{p.name}_cold_rps"]
            ratios[f"warm_rps_vs_{p.name}"] = med["tierfs_warm_rps"] / med[f"{p.name}_warm_rps"]
        b.result.update(reads=args.reads, io_size=IO, medians=med, raw=res, ratios=ratios)
        print(f"randread {args.reads} x 4 KiB over {args.size / MiB:.0f} MiB, median of {args.runs} runs:")
        report([(k, f"{v:10.1f}") for k, v in med.items()])
        print("ratios (target: cold fetched <= ~2x requested):")
        report([(k, f"{v:6.2f}") for k, v in ratios.items()])
        b.save()


if __name__ == "__main__":
    main()
