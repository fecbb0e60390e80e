"""Checkpoint write: how long the writer waits, and when the object is in the bucket.

  dd if=<local file> of=MNT/ckpt/step-N/model.pt bs=1M conv=fsync
    - time for dd to return               vs the same dd to a local disk file, and
                                             into bench/passthrough.py --rw (the
                                             ceiling of a pyfuse3 daemon's writes)
    - time until the object is in the bucket (HEAD size matches, polled)
                                          vs raw boto3 upload_file of the same file
Same run, same file; medians of --runs. With --peers, the same dd into each
installed peer (bench/peers.py, one mount for all runs like tierfs's) and the same
HEAD poll of the bucket. With --small-writes, also dd bs=64K and bs=8K: local,
tierfs (direct writes, the checkpoint class default) and tierfs through the
kernel page cache (a second mount with direct_writes = false): the price of
direct writes for small writers. With --stream, the same dd into a second mount
whose checkpoint class has `stream_parts = true` (parts go up while dd writes).
With --store-rate RATE (tc syntax, e.g. 800mbit), bytes sent to the store are
limited to RATE for the whole run (bench/common.py shaped_uploads): a store
behind a network link, as a remote S3 is, instead of one that takes both of
this machine's cores during an upload (boto3's own upload_file leaves ~2% idle).

Usage: python bench/ckptwrite.py [--size 1G] [--runs 3] [--peers] [--small-writes]
                                 [--stream] [--store-rate 800mbit]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import time
from pathlib import Path

import peers
from common import (
    Bench,
    drop_caches,
    mbps,
    median,
    parse_args,
    report,
    shaped_uploads,
    write_random_file,
)

from tests.support.mount import run_tierfs

SMALL = ("64K", "8K")


def dd(src: str, dst: str, bs: str = "1M") -> float:
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={dst}", f"bs={bs}", "conv=fsync", "status=none"],
                   check=True)
    return time.perf_counter() - t


def wait_in_bucket(b: Bench, key: str, size: int, timeout: float = 600) -> None:
    """Poll HEAD like another node would, until the whole object is there."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if b.client.head_object(Bucket="bench", Key=key)["ContentLength"] == size:
                return
        except b.client.exceptions.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{key} not in the bucket after {timeout:.0f}s")
        time.sleep(0.01)


def dd_until_in_bucket(b: Bench, src: Path, mnt: Path, key: str, size: int) -> tuple[float, float]:
    """dd `src` into mnt/key (its directory made first, page cache dropped), then
    HEAD polled: seconds until dd returned, and until the object was in the bucket."""
    drop_caches()
    (mnt / key).parent.mkdir(parents=True)
    start = time.perf_counter()
    took = dd(str(src), str(mnt / key))
    wait_in_bucket(b, key, size)
    return took, time.perf_counter() - start


def flush(b: Bench, mnt: Path) -> float:
    start = time.perf_counter()
    res = run_tierfs("flush", str(mnt), env=b.env, timeout=600)
    assert res.returncode == 0, res.stderr
    return time.perf_counter() - start


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--small-writes", action="store_true",
                       help="also dd bs=64K and 8K (direct vs page cache)")
        p.add_argument("--stream", action="store_true",
                       help="also a mount with stream_parts = true for checkpoints")
        p.add_argument("--store-rate", default=None,
                       help="limit bytes sent to the store to this rate (tc syntax, e.g. 800mbit)")

    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3, extra)
    with Bench(args, "ckptwrite") as b, contextlib.ExitStack() as stack:
        src = b.work / "src.pt"
        write_random_file(src, args.size)
        others = peers.select(b)
        t: dict[str, list[float]] = {k: [] for k in (
            "local_dd", "passthrough_dd", "tierfs_dd", "tierfs_in_bucket", "boto3_upload",
            "tierfs_flush_total",
            *(("tierfs_stream_dd", "tierfs_stream_in_bucket") if args.stream else ()),
            *(f"{p.name}_{s}" for p in others for s in ("dd", "in_bucket")),
            *(f"{w}_dd_{bs}" for bs in SMALL if args.small_writes
              for w in ("local", "tierfs", "tierfs_pagecache")))}
        pt_dir = b.work / "passthrough-src"
        pt_dir.mkdir()
        pt = stack.enter_context(b.passthrough(pt_dir, rw=True))
        m = b.mount()
        pc = None
        if args.small_writes:
            conf = b.work / "pagecache.toml"
            conf.write_text("[classes.checkpoint]\ndirect_writes = false\n")
            pc = b.mount(None, "--config", str(conf))
        st = None
        if args.stream:
            conf = b.work / "stream.toml"
            conf.write_text("[classes.checkpoint]\nstream_parts = true\n")
            st = b.mount(None, "--config", str(conf))
        pms = [stack.enter_context(peers.mount(b, p)) for p in others]
        if args.store_rate:
            stack.enter_context(shaped_uploads(b.server.s3_port, args.store_rate))
        b.result["store_rate"] = args.store_rate
        for run in range(args.runs):
            local = b.work / f"local-{run}.pt"
            drop_caches()
            t["local_dd"].append(dd(str(src), str(local)))
            local.unlink()

            drop_caches()
            t["passthrough_dd"].append(dd(str(src), str(pt / f"pt-{run}.pt")))
            (pt_dir / f"pt-{run}.pt").unlink()

            drop_caches()
            key = f"ref/step-{run}/model.pt"
            start = time.perf_counter()
            b.client.upload_file(str(src), "bench", key)
            t["boto3_upload"].append(time.perf_counter() - start)

            took, landed = dd_until_in_bucket(b, src, m.mountpoint, f"ckpt/step-{run}/model.pt",
                                              args.size)
            t["tierfs_dd"].append(took)
            t["tierfs_in_bucket"].append(landed)
            t["tierfs_flush_total"].append(landed + flush(b, m.mountpoint))

            if st is not None:
                took, landed = dd_until_in_bucket(
                    b, src, st.mountpoint, f"ckpt/stream-{run}/model.pt", args.size)
                t["tierfs_stream_dd"].append(took)
                t["tierfs_stream_in_bucket"].append(landed)
                flush(b, st.mountpoint)

            for bs in SMALL if pc is not None else ():
                drop_caches()
                t[f"local_dd_{bs}"].append(dd(str(src), str(local), bs))
                local.unlink()
                for name, mnt in (("tierfs", m), ("tierfs_pagecache", pc)):
                    drop_caches()
                    dst = mnt.mountpoint / f"ckpt/small-{bs}-{run}.pt"
                    t[f"{name}_dd_{bs}"].append(dd(str(src), str(dst), bs))
                    flush(b, mnt.mountpoint)

            for pm in pms:
                took, landed = dd_until_in_bucket(
                    b, src, pm.mountpoint, f"{pm.name}/step-{run}/model.pt", args.size)
                t[f"{pm.name}_dd"].append(took)
                t[f"{pm.name}_in_bucket"].append(landed)
        med = {k: median(v) for k, v in t.items()}
        size = args.size
        ratios = {"dd_return_vs_local": med["tierfs_dd"] / med["local_dd"],
                  "dd_return_vs_passthrough": med["tierfs_dd"] / med["passthrough_dd"],
                  "in_bucket_vs_boto3": med["tierfs_in_bucket"] / med["boto3_upload"]}
        if st is not None:
            ratios["stream_dd_vs_local"] = med["tierfs_stream_dd"] / med["local_dd"]
            ratios["stream_in_bucket_vs_boto3"] = (med["tierfs_stream_in_bucket"]
                                                   / med["boto3_upload"])
        for p in others:
            ratios[f"dd_return_vs_{p.name}"] = med["tierfs_dd"] / med[f"{p.name}_dd"]
            ratios[f"in_bucket_vs_{p.name}"] = med["tierfs_in_bucket"] / med[f"{p.name}_in_bucket"]
        b.result.update({"seconds": t, "median_seconds": med, "ratios": ratios})
        print(f"ckptwrite: {size >> 20} MiB, {args.runs} runs (medians)"
              + (f", uploads limited to {args.store_rate}" if args.store_rate else ""))
        peer_rows = []  # time ratios: below 1, tierfs is faster
        for p in others:
            dd_s, in_s = med[f"{p.name}_dd"], med[f"{p.name}_in_bucket"]
            peer_rows += [
                (f"{p.name} dd returns", f"{dd_s:.2f}s  {mbps(size, dd_s):.0f} MB/s"
                 f"  tierfs = {ratios[f'dd_return_vs_{p.name}']:.2f}x {p.name}"),
                (f"{p.name} in bucket", f"{in_s:.2f}s after dd started"
                 f"  tierfs = {ratios[f'in_bucket_vs_{p.name}']:.2f}x {p.name}"),
            ]
        report([
            ("local dd conv=fsync", f"{med['local_dd']:.2f}s  {mbps(size, med['local_dd']):.0f} MB/s"),
            ("pyfuse3 passthrough dd", f"{med['passthrough_dd']:.2f}s  "
             f"{mbps(size, med['passthrough_dd']):.0f} MB/s  (bench/passthrough.py --rw)"),
            ("tierfs dd returns", f"{med['tierfs_dd']:.2f}s  {mbps(size, med['tierfs_dd']):.0f} MB/s"
             f"  = {med['tierfs_dd'] / med['local_dd']:.2f}x local (target <= 1.5x),"
             f" {ratios['dd_return_vs_passthrough']:.2f}x passthrough"),
            ("boto3 upload_file", f"{med['boto3_upload']:.2f}s  {mbps(size, med['boto3_upload']):.0f} MB/s"),
            ("tierfs in bucket", f"{med['tierfs_in_bucket']:.2f}s after dd started"
             f"  = {med['tierfs_in_bucket'] / med['boto3_upload']:.2f}x boto3 (target <= 1.1x)"),
            *((("tierfs stream_parts dd", f"{med['tierfs_stream_dd']:.2f}s"
                f"  = {ratios['stream_dd_vs_local']:.2f}x local"),
               ("tierfs stream_parts in bucket", f"{med['tierfs_stream_in_bucket']:.2f}s"
                f"  = {ratios['stream_in_bucket_vs_boto3']:.2f}x boto3")) if st is not None else ()),
            *peer_rows,
            *((f"dd bs={bs}", f"local {med[f'local_dd_{bs}']:.2f}s, tierfs {med[f'tierfs_dd_{bs}']:.2f}s "
               f"({med[f'tierfs_dd_{bs}'] / med[f'local_dd_{bs}']:.2f}x), through the page cache "
               f"{med[f'tierfs_pagecache_dd_{bs}']:.2f}s") for bs in SMALL if pc is not None),
        ])
        b.save()


if __name__ == "__main__":
    main()
