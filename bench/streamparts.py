"""stream_parts on vs off, same run, alternating: a 1 GiB `dd conv=fsync` into a mount
(the checkpoint pause), the time until the object is in the bucket, and the daemon's
CPU seconds. Medians, with the load average beside each run. Root (drops the page cache).

Usage: bench/streamparts.py [--runs N] [--size 1G]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.mount import TierfsMount, drop_page_cache, run_tierfs  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", default="1G", help="bytes, with K/M/G")
    args = ap.parse_args()
    size = int(args.size[:-1]) << {"K": 10, "M": 20, "G": 30}[args.size[-1].upper()] \
        if args.size[-1].isalpha() else int(args.size)
    work = Path(tempfile.mkdtemp(prefix="tierfs-bench-streamparts-"))
    src = work / "src.bin"
    with open(src, "wb") as f:
        for off in range(0, size, 16 << 20):
            f.write(os.urandom(min(16 << 20, size - off)))
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with SeaweedServer(data_dir=work / "seaweed") as srv:
        client = srv.client()
        client.create_bucket(Bucket="bench")
        env = {**os.environ, **srv.env()}
        for run in range(args.runs):
            for mode in ("off", "on"):
                cfg = work / f"{mode}.toml"
                cfg.write_text("".join(f"[classes.{c}]\nstream_parts = {str(mode == 'on').lower()}\n"
                                       for c in ("default", "checkpoint", "dataset")))
                m = TierfsMount("s3://bench", work / f"mnt-{mode}-{run}",
                                work / f"cache-{mode}-{run}", env, ["--config", str(cfg)]).start()
                try:
                    assert m.pid is not None
                    drop_page_cache()
                    key = f"{mode}-{run}.pt"
                    cpu0, t0 = cpu_seconds(m.pid), time.perf_counter()
                    subprocess.run(["dd", f"if={src}", f"of={m.mountpoint / key}", "bs=1M",
                                    "conv=fsync", "status=none"], check=True)
                    dd_s = time.perf_counter() - t0
                    while True:
                        try:
                            if client.head_object(Bucket="bench", Key=key)["ContentLength"] == size:
                                break
                        except client.exceptions.ClientError:
                            pass
                        time.sleep(0.01)
                    in_bucket = time.perf_counter() - t0
                    run_tierfs("flush", str(m.mountpoint), env=env, check=True)
                    row = {"dd_s": dd_s, "in_bucket_s": in_bucket,
                           "daemon_cpu_s": cpu_seconds(m.pid) - cpu0, "load": os.getloadavg()[0]}
                    rows[mode].append(row)
                    print(f"{mode:3} run {run}: dd {dd_s:.2f}s  in bucket {in_bucket:.2f}s  "
                          f"daemon CPU {row['daemon_cpu_s']:.2f}s  load {row['load']:.1f}", flush=True)
                finally:
                    m.cleanup()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rows.items()}
    for mode, v in med.items():
        print(f"stream_parts {mode:3}: dd {v['dd_s']:.2f}s  in bucket {v['in_bucket_s']:.2f}s  "
              f"daemon CPU {v['daemon_cpu_s']:.2f}s  (medians of {args.runs}, load {v['load']:.1f})")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "streamparts.json"
    out.write_text(json.dumps({"size": size, "runs": rows, "medians": med}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
