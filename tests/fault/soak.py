"""Full-size fault runs, by hand, for the closing note: prints figures.

    .venv/bin/python -m tests.fault.soak [--only flaky,blackhole,down,kill9] [--trials 50]
        [--size-mib 1024] [--blackhole-s 60]

Starts its own SeaweedFS and fault proxy on loopback, mounts through the CLI
(like the tests), and always cleans up. The pytest versions of these runs are
in tests/fault/test_mount_faults.py (smaller sizes, shorter outages).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.fault.conftest import flaky_rules, store_config
from tests.fault.proxy import FaultProxy, Rule
from tests.fault.test_mount_faults import _timed_reads, drop_page_cache, flush, run_crash_trials
from tests.support.mount import TierfsMount, is_mounted
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


class Rig:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.s3 = SeaweedServer(data_dir=work / "seaweed").start()
        self.proxy = FaultProxy(upstream=self.s3.endpoint, seed=11).start()
        self.mounts: list[TierfsMount] = []
        self.n = 0

    def bucket(self, name: str) -> str:
        return self.s3.make_bucket(name)

    def mount(self, bucket: str, *extra: str, cache: Path | None = None,
              mountpoint: Path | None = None) -> TierfsMount:
        self.n += 1
        m = TierfsMount(f"s3://{bucket}", mountpoint or self.work / f"mnt{self.n}",
                        cache or self.work / f"cache{self.n}", {**os.environ, **self.s3.env()},
                        list(extra))
        self.mounts.append(m)
        return m.start()

    def put_random(self, bucket: str, key: str, size: int) -> str:
        """A random object of `size` bytes, uploaded straight (not via the proxy); its sha256."""
        path = self.work / "upload.tmp"
        h = hashlib.sha256()
        with open(path, "wb") as f:
            for _ in range(0, size, 64 * MiB):
                block = os.urandom(min(64 * MiB, size - f.tell()))
                h.update(block)
                f.write(block)
        self.s3.client().upload_file(str(path), bucket, key)
        path.unlink()
        return h.hexdigest()

    def close(self) -> None:
        for m in self.mounts:
            m.cleanup()
        self.proxy.stop()
        self.s3.stop()


def sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def store_sha(rig: Rig, bucket: str, key: str) -> str:
    body = rig.s3.client().get_object(Bucket=bucket, Key=key)["Body"]
    h = hashlib.sha256()
    while chunk := body.read(4 * MiB):
        h.update(chunk)
    return h.hexdigest()


def run_flaky(rig: Rig, size: int) -> dict:
    b = rig.bucket("soak-flaky")
    seq_sha = rig.put_random(b, "data/seq.bin", size)
    rnd_size = 256 * MiB
    rig.put_random(b, "data/rnd.tar", rnd_size)
    rig.proxy.set_rules(flaky_rules(0.2))
    m = rig.mount(b, "--endpoint-url", rig.proxy.endpoint,
                  "--config", str(store_config(rig.work, deadline=30, read_timeout=10)))
    out: dict = {}
    t0 = time.monotonic()
    assert sha_file(m.mountpoint / "data/seq.bin") == seq_sha, "sequential read corrupt"
    out["seq_read_s"] = round(time.monotonic() - t0, 1)
    out["seq_read_MiBps"] = round(size / MiB / (time.monotonic() - t0), 1)
    rig.proxy.clear()
    want = rig.s3.client().get_object(Bucket=b, Key="data/rnd.tar")["Body"].read()
    rig.proxy.set_rules(flaky_rules(0.2))
    rng = random.Random(2)
    fd = os.open(m.mountpoint / "data/rnd.tar", os.O_RDONLY)
    lat = []
    for _ in range(2000):
        off = rng.randrange(0, rnd_size - 4096)
        t = time.perf_counter()
        got = os.pread(fd, 4096, off)
        lat.append(time.perf_counter() - t)
        assert got == want[off : off + 4096], f"random read corrupt at {off}"
    os.close(fd)
    del want
    out["random_reads"] = 2000
    out["random_p50_ms"] = round(statistics.median(lat) * 1e3, 2)
    out["random_p99_ms"] = round(sorted(lat)[1980] * 1e3, 2)
    ckpt = rig.work / "ckpt.src"
    with open(ckpt, "wb") as f:
        for _ in range(size // (64 * MiB)):
            f.write(os.urandom(64 * MiB))
    ck_sha = sha_file(ckpt)
    os.makedirs(m.mountpoint / "ckpt", exist_ok=True)
    t0 = time.monotonic()
    shutil.copyfile(ckpt, m.mountpoint / "ckpt/model.pt")
    out["ckpt_close_s"] = round(time.monotonic() - t0, 1)
    flush(m, timeout=1800)
    out["ckpt_landed_s"] = round(time.monotonic() - t0, 1)
    ckpt.unlink()
    rig.proxy.clear()
    assert store_sha(rig, b, "ckpt/model.pt") == ck_sha, "checkpoint in the bucket differs"
    stats = rig.proxy.stats()
    out["proxy_requests"] = sum(v for (_, f), v in stats.items() if f == "total")
    out["proxy_injected"] = {f: sum(v for (_, ff), v in stats.items() if ff == f)
                             for f in ("503", "reset", "truncate")}
    out["retries_in_metrics"] = {op: by.get("retry", 0) for op, by in m.status()["store"]["requests"].items()}
    out["errors_returned"] = m.status()["errors"]
    return out


def run_blackhole(rig: Rig, seconds: float) -> dict:
    b = rig.bucket("soak-bh")
    rig.put_random(b, "data/warm.bin", 64 * MiB)
    m = rig.mount(b, "--endpoint-url", rig.proxy.endpoint,
                  "--config", str(store_config(rig.work, deadline=30, read_timeout=10)))
    warm = m.mountpoint / "data/warm.bin"
    sha_file(warm)
    data_path = rig.work / "bh.src"
    with open(data_path, "wb") as f:
        for _ in range(8):
            f.write(os.urandom(64 * MiB))
    want = sha_file(data_path)
    os.makedirs(m.mountpoint / "ckpt", exist_ok=True)
    rig.proxy.set_rules([Rule("latency", ops={"multipart"}, delay=0.2)])
    shutil.copyfile(data_path, m.mountpoint / "ckpt/model.pt")
    while m.metric("tierfs_store_requests_total{op=multipart,status=ok}") < 3:
        time.sleep(0.05)
    rig.proxy.blackhole_all(True)
    lat: list[float] = []
    bad: list[str] = []
    stop = threading.Event()
    reader = threading.Thread(target=_timed_reads, args=(warm, stop, lat, bad))
    reader.start()
    t_end = time.monotonic() + seconds
    degraded_seen = False
    while time.monotonic() < t_end:
        degraded_seen |= bool(m.status()["degraded"])
        time.sleep(1)
    stop.set()
    reader.join()
    rig.proxy.clear()
    t0 = time.monotonic()
    flush(m, timeout=1800)
    landed = time.monotonic() - t0
    ok = store_sha(rig, b, "ckpt/model.pt") == want
    data_path.unlink()
    lat.sort()
    return {"blackhole_s": seconds, "cached_reads": len(lat), "read_errors": bad,
            "cached_p50_ms": round(lat[len(lat) // 2] * 1e3, 2),
            "cached_p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 2),
            "cached_max_ms": round(lat[-1] * 1e3, 1), "status_showed_degraded": degraded_seen,
            "landed_after_return_s": round(landed, 1), "bucket_object_identical": ok}


def run_down(rig: Rig) -> dict:
    b = rig.bucket("soak-down")
    rig.put_random(b, "data/cold.bin", 16 * MiB)
    m = rig.mount(b, "--endpoint-url", rig.proxy.endpoint)  # default deadline (30 s)
    os.listdir(m.mountpoint / "data")
    rig.proxy.blackhole_all(True)
    t0 = time.monotonic()
    try:
        (m.mountpoint / "data/cold.bin").read_bytes()
        result = "read succeeded?!"
    except OSError as exc:
        result = errno.errorcode.get(exc.errno or 0, str(exc))
    took = time.monotonic() - t0
    st = m.status()
    rig.proxy.clear()
    return {"default_deadline_s": 30, "uncached_read": result, "took_s": round(took, 2),
            "daemon_up": st["pid"] == m.pid, "degraded": st["degraded"]}


def run_kill9(rig: Rig, trials: int) -> dict:
    b = rig.bucket("soak-kill")
    cache = rig.work / "cache-kill"
    m = rig.mount(b, cache=cache)

    def remount(old: TierfsMount) -> TierfsMount:
        return rig.mount(b, cache=cache, mountpoint=old.mountpoint)

    t0 = time.monotonic()
    _, figures = run_crash_trials(m, remount, rig.s3, b, rig.work / "kill.log", trials=trials,
                                  seed=5, max_size=32 << 20)
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="flaky,blackhole,down,kill9")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--blackhole-s", type=float, default=60)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tierfs-soak-"))
    rig = Rig(work)
    results: dict = {}
    try:
        for name in args.only.split(","):
            t0 = time.monotonic()
            if name == "flaky":
                results[name] = run_flaky(rig, args.size_mib * MiB)
            elif name == "blackhole":
                results[name] = run_blackhole(rig, args.blackhole_s)
            elif name == "down":
                results[name] = run_down(rig)
            elif name == "kill9":
                results[name] = run_kill9(rig, args.trials)
            results[name]["total_s"] = round(time.monotonic() - t0, 1)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
            drop_page_cache()
    except BaseException:
        rig.close()
        print(f"failed: cache dirs and logs kept in {work}", file=sys.stderr)
        raise
    rig.close()
    if not any(is_mounted(m.mountpoint) for m in rig.mounts):
        subprocess.run(["rm", "-rf", str(work)], check=False)
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
