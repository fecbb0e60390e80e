"""Reads of a file complete in tier 1: tierfs with FUSE passthrough vs the daemon path vs a local file.

Per run, in a rotating order, on one 1 GiB object warmed into tier 1 by a full
read (then its handles released):
  warm  dd bs=1M-style sequential read, page cache dropped
  hot   the same read again, page cache kept
  4k    --reads random 4 KiB preads (POSIX_FADV_RANDOM), page cache dropped
for: the local file (the object's bytes on the same disk, the reference),
tierfs with passthrough (the default mount) and tierfs --no-passthrough (the
daemon path, with the kernel write-back cache, as before). Also the daemon's
CPU seconds during the warm sequential read, the FUSE READs it served then
(tierfs_read_latency_seconds_count), how the opens were served (tierfs status),
and the load average before and after. Medians of --runs; JSON in
bench/results/warmread.json.

Usage: python bench/warmread.py [--size 1G] [--runs 3] [--reads 4000]
"""

from __future__ import annotations

import os
import random
import time

from common import (
    Bench,
    drop_caches,
    mbps,
    median,
    parse_args,
    proc_cpu_seconds,
    read_seq,
    report,
    write_random_file,
)
from randread import IO, preads

from tests.support.mount import TierfsMount

KEY = "warm/shard-000.tar"
READS = "tierfs_read_latency_seconds_count"


def released(m: TierfsMount, timeout: float = 30) -> None:
    """Every handle's RELEASE served: the next open starts the inode afresh."""
    deadline = time.monotonic() + timeout
    while m.status()["cache"]["open_objects"]:
        if time.monotonic() > deadline:
            raise RuntimeError("handles not released")
        time.sleep(0.05)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3, lambda p: p.add_argument(
        "--reads", type=int, default=4000, help="random 4 KiB preads per measurement"))
    size = args.size
    with Bench(args, "warmread") as b:
        local = b.work / "local.tar"
        write_random_file(local, size)
        b.seed(KEY, local)
        mounts = {"passthrough": b.mount(), "daemon": b.mount(None, "--no-passthrough")}
        for m in mounts.values():  # warm tier 1: one full read, handles released
            assert read_seq(m.mountpoint / KEY)[1] == size
            released(m)
        paths = {"local": local, **{n: m.mountpoint / KEY for n, m in mounts.items()}}
        rng = random.Random(0)
        t: dict[str, list[float]] = {f"{n}_{s}": [] for n in paths for s in ("warm", "hot", "4k")}
        cpu: dict[str, list[float]] = {n: [] for n in mounts}
        reads: dict[str, list[float]] = {n: [] for n in mounts}
        load = [os.getloadavg()[0]]
        order = list(paths)
        for run in range(args.runs):
            offsets = [rng.randrange(0, size - IO) // IO * IO for _ in range(args.reads)]
            for name in order:
                path, m = paths[name], mounts.get(name)
                drop_caches()
                before = (proc_cpu_seconds(m.pid), m.metric(READS)) if m and m.pid else None
                secs, n = read_seq(path)
                assert n == size, (name, n)
                if m is not None and before is not None:
                    assert m.pid is not None
                    cpu[name].append(proc_cpu_seconds(m.pid) - before[0])
                    reads[name].append(m.metric(READS) - before[1])
                t[f"{name}_warm"].append(secs)
                t[f"{name}_hot"].append(read_seq(path)[0])
                if m is not None:
                    released(m)
                drop_caches()
                t[f"{name}_4k"].append(preads(path, offsets, fadvise=True))
                if m is not None:
                    released(m)
            load.append(os.getloadavg()[0])
            print(f"run {run} ({' '.join(order)}): " + ", ".join(
                f"{k}={v[-1]:.3f}s" for k, v in t.items()) + f"; load {load[-1]:.2f}")
            order = order[1:] + order[:1]
        med = {k: median(v) for k, v in t.items()}
        r = args.reads
        ratios = {
            "warm_seq_vs_local": med["local_warm"] / med["passthrough_warm"],
            "hot_seq_vs_local": med["local_hot"] / med["passthrough_hot"],
            "warm_4k_vs_local": med["local_4k"] / med["passthrough_4k"],
            "daemon_path_warm_seq_vs_local": med["local_warm"] / med["daemon_warm"],
            "daemon_path_hot_seq_vs_local": med["local_hot"] / med["daemon_hot"],
            "daemon_path_warm_4k_vs_local": med["local_4k"] / med["daemon_4k"],
        }
        opens = {n: m.status()["passthrough"] for n, m in mounts.items()}
        b.result.update({"seconds": t, "median_seconds": med, "ratios": ratios,
                         "daemon_cpu_s_warm_seq": cpu, "daemon_reads_warm_seq": reads,
                         "passthrough": opens, "loadavg_1m": load, "reads": r})
        print(f"warmread: {size >> 20} MiB, {args.runs} runs (medians), load {load}")
        rows = []
        for n in paths:
            rows.append((n, f"warm {mbps(size, med[f'{n}_warm']):.0f} MB/s, hot "
                            f"{mbps(size, med[f'{n}_hot']):.0f} MB/s, 4k {r / med[f'{n}_4k']:.0f} reads/s"
                         + (f"; daemon CPU warm {median(cpu[n]):.3f} s, READs {median(reads[n]):.0f}"
                            if n in cpu else "")))
        rows += [(k, f"{v:.2f}x") for k, v in ratios.items()]
        rows.append(("opens", "; ".join(f"{n}: {o['opens']}" for n, o in opens.items())))
        report(rows)
        b.save()


if __name__ == "__main__":
    main()
