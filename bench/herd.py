"""Thundering herd: N processes read the same cold object at once.

Reports wall time of the herd vs one reader (each on a fresh mount with an empty
tier 1, page cache dropped), bytes fetched from the store vs the object size
(single-flight), and the daemon's peak RSS sampled every 50 ms. Reference: the
same herd and one reader on a local file, page cache dropped (what the machine's
cores and page cache allow N readers at all).

With --peers, each installed peer (bench/peers.py) too: the same one reader and
herd, each on a fresh mount with an empty disk cache, and the peer's peak RSS.

Usage: python bench/herd.py [--size 2G] [--runs 3] [--procs 8] [--peers]
"""

from __future__ import annotations

import multiprocessing as mp
import time

import peers
from common import (
    Bench,
    MiB,
    RssSampler,
    drop_caches,
    median,
    parse_args,
    read_seq,
    report,
    write_random_file,
)

KEY = "herd/shard-000.tar"


def _reader(path: str, start: mp.Event, out: mp.Queue) -> None:
    start.wait()
    secs, n = read_seq(path)
    out.put((secs, n))


def herd(path: str, procs: int) -> tuple[float, list[int]]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_reader, args=(path, start, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.2)
    t = time.perf_counter()
    start.set()
    got = [out.get() for _ in ps]
    wall = time.perf_counter() - t
    for p in ps:
        p.join()
    return wall, [n for _, n in got]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 2 << 30, 3,
                      lambda p: p.add_argument("--procs", type=int, default=8))
    with Bench(args, "herd") as b:
        local = b.work / "local.tar"
        write_random_file(local, args.size)
        b.seed(KEY, local)
        others = peers.select(b)
        res: dict[str, list[float]] = {k: [] for k in (
            "one_reader_s", "herd_s", "herd_vs_one", "one_store_bytes_vs_size",
            "herd_store_bytes_vs_size", "herd_peak_rss_mib", "one_peak_rss_mib",
            "local_one_reader_s", "local_herd_s", "local_herd_vs_one",
            *(f"{p.name}_{s}" for p in others
              for s in ("one_reader_s", "herd_s", "herd_vs_one", "one_reader_peak_rss_mib",
                        "herd_peak_rss_mib")))}
        for run in range(args.runs):
            for label, procs in (("one_reader", 1), ("herd", args.procs)):
                drop_caches()
                res[f"local_{label}_s"].append(herd(str(local), procs)[0])
            res["local_herd_vs_one"].append(res["local_herd_s"][-1] / res["local_one_reader_s"][-1])
            for label, procs in (("one", 1), ("herd", args.procs)):
                m = b.mount()
                path = str(m.mountpoint / KEY)
                drop_caches()
                with RssSampler(m.pid) as rss:
                    wall, sizes = herd(path, procs)
                assert all(n == args.size for n in sizes), sizes
                res[f"{label}_reader_s" if label == "one" else "herd_s"].append(wall)
                res[f"{label}_store_bytes_vs_size"].append(b.store_get_bytes(m) / args.size)
                res[f"{label}_peak_rss_mib"].append(rss.peak / MiB)
                b.unmount(m)
            res["herd_vs_one"].append(res["herd_s"][-1] / res["one_reader_s"][-1])
            for p in others:
                for label, procs in (("one_reader", 1), ("herd", args.procs)):
                    with peers.mount(b, p) as pm:
                        drop_caches()
                        with RssSampler(pm.pid) as rss:
                            wall, sizes = herd(str(pm.mountpoint / KEY), procs)
                        assert all(n == args.size for n in sizes), (p.name, sizes)
                        res[f"{p.name}_{label}_s"].append(wall)
                        res[f"{p.name}_{label}_peak_rss_mib"].append(rss.peak / MiB)
                res[f"{p.name}_herd_vs_one"].append(res[f"{p.name}_herd_s"][-1]
                                                     / res[f"{p.name}_one_reader_s"][-1])
            print(f"run {run}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in res.items()))
        med = {k: median(v) for k, v in res.items()}
        b.result.update(procs=args.procs, medians=med, raw=res)
        print(f"herd: {args.procs} readers of one cold {args.size / MiB:.0f} MiB object, "
              f"median of {args.runs} runs:")
        report([(k, f"{v:8.2f}") for k, v in med.items()])
        print("targets: herd_vs_one <= 1.3, herd_store_bytes_vs_size <= 1.05, peak RSS <= 256 MiB; "
              "local_herd_vs_one is the same herd on local disk")
        b.save()


if __name__ == "__main__":
    main()
