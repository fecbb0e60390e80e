"""Checkpoint write: how long the writer waits, and when the object is in the bucket.

  dd if=<local file> of=MNT/ckpt/step-N/model.pt bs=1M conv=fsync
    - time for dd to return               vs the same dd to a local disk file
    - time until the object is in the bucket (HEAD size matches, polled)
                                          vs raw boto3 upload_file of the same file
Same run, same file; medians of --runs.

Usage: python bench/ckptwrite.py [--size 1G] [--runs 3]
"""

from __future__ import annotations

import subprocess
import time

from common import Bench, drop_caches, mbps, median, parse_args, report, write_random_file

from tests.support.mount import run_tierfs


def dd(src: str, dst: str) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M", "conv=fsync", "status=none"],
                   check=True)
    return time.perf_counter() - t


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3)
    with Bench(args, "ckptwrite") as b:
        src = b.work / "src.pt"
        write_random_file(src, args.size)
        t: dict[str, list[float]] = {k: [] for k in (
            "local_dd", "tierfs_dd", "tierfs_in_bucket", "boto3_upload", "tierfs_flush_total")}
        m = b.mount()
        for run in range(args.runs):
            local = b.work / f"local-{run}.pt"
            drop_caches()
            t["local_dd"].append(dd(str(src), str(local)))
            local.unlink()

            drop_caches()
            key = f"ref/step-{run}/model.pt"
            start = time.perf_counter()
            b.client.upload_file(str(src), "bench", key)
            t["boto3_upload"].append(time.perf_counter() - start)

            drop_caches()
            key = f"ckpt/step-{run}/model.pt"
            (m.mountpoint / f"ckpt/step-{run}").mkdir(parents=True)
            start = time.perf_counter()
            t["tierfs_dd"].append(dd(str(src), str(m.mountpoint / key)))
            while True:  # poll the bucket like another node would
                try:
                    if b.client.head_object(Bucket="bench", Key=key)["ContentLength"] == args.size:
                        break
                except b.client.exceptions.ClientError:
                    pass
                time.sleep(0.01)
            t["tierfs_in_bucket"].append(time.perf_counter() - start)
            res = run_tierfs("flush", str(m.mountpoint), env=b.env, timeout=600)
            assert res.returncode == 0, res.stderr
            t["tierfs_flush_total"].append(time.perf_counter() - start)
        med = {k: median(v) for k, v in t.items()}
        size = args.size
        b.result.update({"seconds": t, "median_seconds": med,
                         "ratios": {"dd_return_vs_local": med["tierfs_dd"] / med["local_dd"],
                                    "in_bucket_vs_boto3": med["tierfs_in_bucket"] / med["boto3_upload"]}})
        print(f"ckptwrite: {size >> 20} MiB, {args.runs} runs (medians)")
        report([
            ("local dd conv=fsync", f"{med['local_dd']:.2f}s  {mbps(size, med['local_dd']):.0f} MB/s"),
            ("tierfs dd returns", f"{med['tierfs_dd']:.2f}s  {mbps(size, med['tierfs_dd']):.0f} MB/s"
             f"  = {med['tierfs_dd'] / med['local_dd']:.2f}x local (target <= 1.5x)"),
            ("boto3 upload_file", f"{med['boto3_upload']:.2f}s  {mbps(size, med['boto3_upload']):.0f} MB/s"),
            ("tierfs in bucket", f"{med['tierfs_in_bucket']:.2f}s after dd started"
             f"  = {med['tierfs_in_bucket'] / med['boto3_upload']:.2f}x boto3 (target <= 1.2x)"),
        ])
        b.save()


if __name__ == "__main__":
    main()
