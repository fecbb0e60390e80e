"""Writes through the page cache: dd conv=fsync into the mount, passthrough on vs off.

  dd if=<local file> of=MNT/out/<name> bs={8K,1M} conv=fsync   (default class:
  writes go through the kernel page cache, no direct writes)
for: a local file on the same disk (the reference), tierfs with passthrough
(the default mount: no kernel write-back cache; a new file's writes are served
by the kernel from its tier-1 file) and tierfs --no-passthrough (the daemon
path with the kernel write-back cache). Time for dd to return (the file is
sealed in tier 1 by its fsync; the upload follows), the daemon's CPU seconds
during it, and the load average before and after. The order of the three
rotates each run; medians of --runs. JSON in bench/results/ddwrite.json.

Usage: python bench/ddwrite.py [--size 1G] [--runs 3] [--bs 8K,1M]
"""

from __future__ import annotations

import os
import subprocess
import time

from common import (
    Bench,
    drop_caches,
    mbps,
    median,
    parse_args,
    proc_cpu_seconds,
    report,
    write_random_file,
)

from tests.support.mount import run_tierfs


def dd(src: str, dst: str, bs: str) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={dst}", f"bs={bs}", "conv=fsync", "status=none"],
                   check=True)
    return time.perf_counter() - t


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3, lambda p: p.add_argument(
        "--bs", default="8K,1M", help="dd block sizes, comma-separated"))
    sizes = args.bs.split(",")
    with Bench(args, "ddwrite") as b:
        src = b.work / "src.bin"
        write_random_file(src, args.size)
        mounts = {"passthrough": b.mount(), "no_passthrough": b.mount(None, "--no-passthrough")}
        for w, m in mounts.items():  # one bucket: a directory each
            (m.mountpoint / w).mkdir()
        t: dict[str, list[float]] = {f"{w}_{bs}": [] for bs in sizes
                                     for w in ("local", *mounts)}
        cpu: dict[str, list[float]] = {f"{w}_{bs}": [] for bs in sizes for w in mounts}
        load_before = os.getloadavg()
        for run in range(args.runs):
            for bs in sizes:
                order = ["local", *mounts]
                order = order[run % 3:] + order[:run % 3]
                for w in order:
                    drop_caches()
                    if w == "local":
                        dst = b.work / f"local-{bs}-{run}.bin"
                        t[f"{w}_{bs}"].append(dd(str(src), str(dst), bs))
                        dst.unlink()
                        continue
                    m = mounts[w]
                    assert m.pid is not None
                    pid = m.pid
                    c0 = proc_cpu_seconds(pid)
                    t[f"{w}_{bs}"].append(dd(str(src), str(m.mountpoint / f"{w}/{bs}-{run}.bin"), bs))
                    cpu[f"{w}_{bs}"].append(proc_cpu_seconds(pid) - c0)
                    res = run_tierfs("flush", str(m.mountpoint), env=b.env, timeout=1800)
                    assert res.returncode == 0, res.stderr
                    (m.mountpoint / f"{w}/{bs}-{run}.bin").unlink()
        load_after = os.getloadavg()
        med = {k: median(v) for k, v in t.items()}
        b.result.update({"seconds": t, "median_seconds": med, "daemon_cpu_seconds": cpu,
                         "load_before": load_before, "load_after": load_after})
        print(f"ddwrite: {args.size >> 20} MiB, {args.runs} runs (medians); load "
              f"{load_before[0]:.2f} -> {load_after[0]:.2f}")
        rows = []
        for k, s in med.items():
            w, _, bs = k.rpartition("_")
            extra = f"  {s / med[f'local_{bs}']:.2f}x local" if w != "local" else ""
            if k in cpu:
                extra += f"  daemon CPU {median(cpu[k]):.2f} s"
            rows.append((k, f"{s:.2f}s  {mbps(args.size, s):.0f} MB/s{extra}"))
        report(rows)
        b.save()


if __name__ == "__main__":
    main()
