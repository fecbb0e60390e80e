"""Memory: the daemon's peak RSS while 4 uploads and a cold read run together.

Four write-back files of --size are written through the mount (their uploads
start as each one closes; 4 may run at once here) and, while they upload, one
cold object of --size is read through it (dd bs=1M). The daemon's VmRSS is
sampled every 50 ms. Every byte it holds in flight comes from one memory
budget (`[memory] budget`, --budget here), so the target is: peak RSS <= the
budget + 64 MiB (the idle daemon, Python and its libraries, is ~60 MiB of it).
Also recorded: the idle RSS, the budget's own peak (status "memory"), and the
peak during the phase the uploads and the read overlap.

Usage: python bench/memory.py [--size 1G] [--runs 1] [--budget 256M]
"""

from __future__ import annotations

import os
import threading
import time

from common import (
    Bench,
    MiB,
    RssSampler,
    drop_caches,
    median,
    parse_args,
    read_seq,
    report,
    rss_bytes,
    write_random_file,
)

KEY = "mem/cold.tar"
UPLOADS = 4


def write_file(src: str, dst: str) -> None:
    buf = bytearray(MiB)
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as out:
        while n := f.readinto(buf):
            out.write(memoryview(buf)[:n])


def main() -> None:
    def extra(p):  # type: ignore[no-untyped-def]
        p.add_argument("--budget", default="256M", help="the mount's [memory] budget")

    args = parse_args(__doc__.splitlines()[0], 1 << 30, 1, extra)
    budget = int(float(args.budget.rstrip("MmGg")) * (1 << 30 if args.budget[-1] in "Gg" else MiB))
    with Bench(args, "memory") as b:
        local = b.work / "local.bin"
        write_random_file(local, args.size)
        b.seed(KEY, local)
        cfg = b.work / "memory.toml"
        cfg.write_text(f'[memory]\nbudget = "{args.budget}"\n'
                       f"[store]\nmax_parallel_uploads = {UPLOADS}\n")
        figures: dict[str, list[float]] = {k: [] for k in (
            "idle_rss_mib", "peak_rss_mib", "overlap_peak_rss_mib", "budget_peak_mib",
            "read_mbps", "uploads_s")}
        for run in range(args.runs):
            drop_caches()
            m = b.mount(None, "--config", str(cfg))
            assert m.pid is not None
            idle = rss_bytes(m.pid)
            os.makedirs(m.mountpoint / "ckpt", exist_ok=True)
            t0 = time.perf_counter()
            with RssSampler(m.pid) as whole:
                writers = [threading.Thread(target=write_file,
                                            args=(str(local), str(m.mountpoint / f"ckpt/u{i}.pt")))
                           for i in range(UPLOADS)]
                for w in writers:
                    w.start()
                for w in writers:
                    w.join()
                with RssSampler(m.pid) as overlap:
                    secs, n = read_seq(m.mountpoint / KEY)
                    assert n == args.size
                    pending = m.status()["pending"]["count"]
                b.flush(m)
                uploads_s = time.perf_counter() - t0
            mem = m.status()["memory"]
            b.unmount(m)
            figures["idle_rss_mib"].append(idle / MiB)
            figures["peak_rss_mib"].append(whole.peak / MiB)
            figures["overlap_peak_rss_mib"].append(overlap.peak / MiB)
            figures["budget_peak_mib"].append(mem["peak"] / MiB)
            figures["read_mbps"].append(n / secs / 1e6)
            figures["uploads_s"].append(uploads_s)
            print(f"run {run}: idle {idle / MiB:.0f} MiB, peak {whole.peak / MiB:.0f} MiB "
                  f"(while {pending} upload(s) and the read ran: {overlap.peak / MiB:.0f} MiB), "
                  f"budget {budget / MiB:.0f} MiB (its peak {mem['peak'] / MiB:.0f}), "
                  f"read {n / secs / 1e6:.0f} MB/s, all uploaded after {uploads_s:.1f}s",
                  flush=True)
        res = {k: median(v) for k, v in figures.items()}
        res["budget_mib"] = budget / MiB
        res["peak_minus_budget_mib"] = res["peak_rss_mib"] - budget / MiB
        b.result.update(res)
        report([(k, f"{v:.1f}") for k, v in res.items()])
        verdict = "met" if res["peak_minus_budget_mib"] <= 64 else "MISSED"
        print(f"target peak RSS <= budget + 64 MiB: {verdict} "
              f"({res['peak_rss_mib']:.0f} MiB vs {budget / MiB + 64:.0f} MiB)")
        print(f"results: {b.save()}")


if __name__ == "__main__":
    main()
