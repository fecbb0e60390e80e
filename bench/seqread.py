"""Sequential read of one big object (dd bs=1M style): cold, warm, hot vs references.

  cold: empty tier 1, page cache dropped      vs raw boto3 (1 stream, 8 parallel ranged GETs)
  warm: tier 1 kept, page cache dropped       vs a pyfuse3 passthrough of a local dir (same state)
  hot:  page cache kept (keep_cache)          vs the local file from the page cache

Also recorded: CPU seconds per GiB of the server, the daemon and the reader during
the cold read and boto3's (`cpu_use`), and the share of the hot read's page cache
held in large folios (`large_folio_share`): what bounds the cold and hot ratios.

With --peers, each installed peer (bench/peers.py) too: cold (fresh mount, empty
disk cache, page cache dropped) and warm (its disk cache kept, page cache dropped).

Usage: python bench/seqread.py [--size 2G] [--runs 3] [--profile] [--peers]
"""

from __future__ import annotations

import os

import peers
from common import (
    Bench,
    MiB,
    cpu_use,
    drop_caches,
    large_folio_share,
    mbps,
    median,
    parse_args,
    py_spy,
    read_seq,
    report,
    write_random_file,
)

KEY = "seq/shard-000.tar"  # dataset class: keep_cache, 256 MiB readahead, no whole-object prefetch


def kernel_read_size(b: Bench, m, nbytes: int) -> float:
    count = m.metric("tierfs_read_latency_seconds_count")
    return nbytes / count if count else 0.0


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 2 << 30, 3)
    with Bench(args, "seqread") as b:
        local = b.work / "local" / "shard-000.tar"
        local.parent.mkdir()
        write_random_file(local, args.size)
        b.seed(KEY, local)
        size = args.size
        others = peers.select(b)
        t: dict[str, list[float]] = {k: [] for k in (
            "local_cold", "local_hot", "boto3_1", "boto3_8", "tierfs_cold", "tierfs_warm",
            "tierfs_hot", "passthrough_warm", "passthrough_hot",
            *(f"{p.name}_{s}" for p in others for s in ("cold", "warm")))}
        store_bytes: list[float] = []
        req_sizes: list[float] = []
        cpu: dict[str, list[dict[str, float]]] = {"boto3_1": [], "tierfs_cold": []}
        folios: dict[str, list[float | None]] = {"local": [], "tierfs": []}
        for run in range(args.runs):
            drop_caches()
            t["local_cold"].append(read_seq(local)[0])
            t["local_hot"].append(read_seq(local)[0])
            folios["local"].append(large_folio_share(local))
            with cpu_use(size, server=b.server_pid) as use:
                t["boto3_1"].append(b.boto_one_stream(KEY)[0])
            cpu["boto3_1"].append(use)
            t["boto3_8"].append(b.boto_parallel(KEY, size)[0])
            m = b.mount()
            path = m.mountpoint / KEY
            drop_caches()
            with py_spy(m.pid, b.work.parent / f"seqread-cold-{os.getpid()}-{run}.speedscope.json",
                        args.profile and run == 0), cpu_use(size, server=b.server_pid, daemon=m.pid) as use:
                secs, n = read_seq(path)
            cpu["tierfs_cold"].append(use)
            assert n == size, (n, size)
            t["tierfs_cold"].append(secs)
            store_bytes.append(b.store_get_bytes(m))
            req_sizes.append(kernel_read_size(b, m, size))
            drop_caches()
            t["tierfs_warm"].append(read_seq(path)[0])
            t["tierfs_hot"].append(read_seq(path)[0])
            folios["tierfs"].append(large_folio_share(path))
            b.unmount(m)
            with b.passthrough(local.parent) as pt:
                drop_caches()
                t["passthrough_warm"].append(read_seq(pt / local.name)[0])
                t["passthrough_hot"].append(read_seq(pt / local.name)[0])
            for p in others:
                with peers.mount(b, p) as pm:
                    drop_caches()
                    secs, n = read_seq(pm.mountpoint / KEY)
                    assert n == size, (p.name, n, size)
                    t[f"{p.name}_cold"].append(secs)
                    drop_caches()
                    t[f"{p.name}_warm"].append(read_seq(pm.mountpoint / KEY)[0])
            print(f"run {run}: " + ", ".join(f"{k}={mbps(size, v[-1]):.0f}" for k, v in t.items()) + " MB/s")
        med = {k: mbps(size, median(v)) for k, v in t.items()}
        ratios = {
            "cold_vs_boto3_8": med["tierfs_cold"] / med["boto3_8"],
            "cold_vs_boto3_1": med["tierfs_cold"] / med["boto3_1"],
            "warm_vs_passthrough": med["tierfs_warm"] / med["passthrough_warm"],
            "hot_vs_local_page_cache": med["tierfs_hot"] / med["local_hot"],
            "hot_vs_passthrough_hot": med["tierfs_hot"] / med["passthrough_hot"],
            "store_bytes_vs_size": median(store_bytes) / size,
        }
        for p in others:
            for s in ("cold", "warm"):
                ratios[f"tierfs_{s}_vs_{p.name}_{s}"] = med[f"tierfs_{s}"] / med[f"{p.name}_{s}"]
        cpu_med = {k: {n: median([u[n] for u in v]) for n in v[0]} for k, v in cpu.items()}
        folio_med = {k: median([x for x in v if x is not None]) for k, v in folios.items()}
        b.result.update(mb_per_s_median=med, seconds=t, ratios=ratios,
                        store_get_bytes=store_bytes, avg_fuse_read_bytes=median(req_sizes),
                        cpu_s_per_gib_median=cpu_med, cpu_s_per_gib=cpu,
                        large_folio_share_median=folio_med)
        print(f"seqread {size / MiB:.0f} MiB, median of {args.runs} runs (MB/s):")
        report([(k, f"{v:8.0f}") for k, v in med.items()])
        print("ratios (targets: cold>=0.9 x boto3, warm>=0.9 x passthrough, hot>=0.8 x local):")
        report([(k, f"{v:6.2f}") for k, v in ratios.items()])
        print(f"  avg FUSE read request: {median(req_sizes) / 1024:.0f} KiB")
        print("CPU seconds per GiB, cold (server = SeaweedFS on the same cores):")
        report([(k, ", ".join(f"{n} {x:.2f}" for n, x in v.items())) for k, v in cpu_med.items()])
        print("page cache held in large folios after the hot read (a hot read is a copy out of them):")
        report([(k, f"{v:6.2f}") for k, v in folio_med.items()])
        b.save()


if __name__ == "__main__":
    main()
