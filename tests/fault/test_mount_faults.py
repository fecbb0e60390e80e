"""A real mount behind the fault proxy: flaky store, store blackholed, store down.

Every fault must end as a successful retry or a clean errno: never a hung
reader, a dead daemon or a lost checkpoint. The store deadline is 5-10 s here
(fault.toml) to keep the tests short; tests/fault/soak.py runs the full sizes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fault.conftest import flaky_rules, store_config
from tests.fault.proxy import FaultProxy
from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.mount import TierfsMount, drop_page_cache, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def put(s3: SeaweedServer, bucket: str, key: str, data: bytes) -> None:
    s3.client().put_object(Bucket=bucket, Key=key, Body=data)


def obj(s3: SeaweedServer, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def flush(m: TierfsMount, timeout: float = 300) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=timeout)
    assert res.returncode == 0, res.stderr


def retries(m: TierfsMount) -> dict[str, int]:
    reqs = m.status()["store"]["requests"]
    return {op: by.get("retry", 0) for op, by in reqs.items() if by.get("retry")}


def test_flaky_store_20pct_reads_and_checkpoint_are_correct(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    seq = os.urandom(128 * MiB)
    rnd = os.urandom(64 * MiB)
    put(s3_server, bucket, "data/seq.bin", seq)
    put(s3_server, bucket, "data/rnd.tar", rnd)
    proxy.set_rules(flaky_rules(0.2))  # every op: GET, HEAD, LIST, PUT, multipart
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=10)))
    mp = m.mountpoint
    # 1. sequential read
    h = hashlib.sha256()
    with open(mp / "data/seq.bin", "rb", buffering=0) as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    assert h.digest() == hashlib.sha256(seq).digest()
    # 2. random 4 KiB reads of an object never read before (.tar: dataset class, no
    # whole-object prefetch, so each read is its own small ranged GET through the faults)
    rng = random.Random(1)
    fd = os.open(mp / "data/rnd.tar", os.O_RDONLY)
    try:
        for _ in range(500):
            off = rng.randrange(0, len(rnd) - 4096)
            assert os.pread(fd, 4096, off) == rnd[off : off + 4096], off
    finally:
        os.close(fd)
    # 3. a write-back checkpoint (multipart upload through the faults)
    ckpt = os.urandom(48 * MiB)
    os.makedirs(mp / "ckpt/step-1")
    with open(mp / "ckpt/step-1/model.pt", "wb") as f:
        f.write(ckpt)
    flush(m)
    proxy.clear()
    assert obj(s3_server, bucket, "ckpt/step-1/model.pt") == ckpt
    # the faults happened, and every failed attempt is a retry in the metrics
    stats = proxy.stats()
    injected = {op: sum(v for (o, f), v in stats.items() if o == op and f in ("503", "reset", "truncate"))
                for op in ("get", "multipart", "put")}
    counted = retries(m)
    assert injected["get"] >= 3 and injected["multipart"] >= 1, stats
    if m.status()["store"]["engine"] == "crt":
        # The runtime retries its own requests (GETs, file uploads) before tierfs sees
        # them fail (awscrt 0.38 reports no retry to Python): a fault tierfs counts
        # is one the runtime's tries did not absorb.
        assert counted.get("get", 0) <= injected["get"], (counted, stats)
    else:
        assert counted.get("get", 0) >= injected["get"], (counted, stats)
        assert counted.get("multipart", 0) >= 1, counted
    assert m.status()["errors"] == {}, m.status()["errors"]


def _timed_reads(path: Path, stop: threading.Event, lat: list[float], bad: list[str],
                 passes: list[int] | None = None) -> None:
    """Re-read a cached file in 1 MiB pieces until `stop`; latency per read (for
    tests/fault/soak.py's figures), and one count in `passes` per whole pass."""
    want = hashlib.sha256(path.read_bytes()).digest()
    while not stop.is_set():
        h = hashlib.sha256()
        try:
            with open(path, "rb", buffering=0) as f:
                while True:
                    t0 = time.perf_counter()
                    chunk = f.read(MiB)
                    lat.append(time.perf_counter() - t0)
                    if not chunk:
                        break
                    h.update(chunk)
        except OSError as exc:
            bad.append(f"{exc}")
            return
        if h.digest() != want:
            bad.append("corrupt read")
            return
        if passes is not None:
            passes.append(1)
        drop_page_cache()


@needs_root  # drops the page cache: the reads are tier 1's, not the kernel's
def test_blackhole_mid_upload_cached_reads_keep_working_and_upload_lands(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    warm = os.urandom(16 * MiB)
    put(s3_server, bucket, "data/warm.bin", warm)
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=5)))
    mp = m.mountpoint
    assert (mp / "data/warm.bin").read_bytes() == warm  # now in tier 1
    ckpt = os.urandom(96 * MiB)
    os.makedirs(mp / "ckpt")
    # slow the parts down a little so the blackhole surely falls inside the upload
    from tests.fault.proxy import Rule
    proxy.set_rules([Rule("latency", ops={"multipart"}, delay=0.3)])
    with open(mp / "ckpt/model.pt", "wb") as f:
        f.write(ckpt)
    deadline = time.monotonic() + 60
    # (parts seen by the proxy: the runtime's parts are not tierfs's requests)
    while proxy.stats()[("multipart", "total")] < 3:
        assert time.monotonic() < deadline, "upload never started"  # hang guard
        time.sleep(0.05)
    proxy.blackhole_all(True)
    store_bytes = m.metric("tierfs_read_bytes_total{tier=store}")
    lat: list[float] = []
    bad: list[str] = []
    passes: list[int] = []
    stop = threading.Event()
    reader = threading.Thread(target=_timed_reads,
                              args=(mp / "data/warm.bin", stop, lat, bad, passes))
    reader.start()
    # write-back keeps accepting checkpoints while the store is away
    more = os.urandom(8 * MiB)
    with open(mp / "ckpt/optim.pt", "wb") as f:
        f.write(more)
    # Cached reads go on while the store is away: the reader finishes whole passes
    # (page cache dropped before each) before the blackhole ends. A read that waited
    # for the store would get EIO at the 5 s deadline instead (`bad`).
    deadline = time.monotonic() + 120
    seen_degraded = False
    while len(passes) < 5 or not seen_degraded:
        assert not bad, bad
        assert time.monotonic() < deadline, (len(passes), seen_degraded)  # hang guard
        st = m.status()  # the daemon answers throughout
        seen_degraded |= st["degraded"] is True
        assert st["pending"]["count"] >= 1
        time.sleep(0.2)
    stop.set()
    reader.join(30)
    assert not bad, bad
    assert m.metric("tierfs_read_bytes_total{tier=store}") == store_bytes  # all from tier 1
    # a new checkpoint dir while the store is away: the marker is journaled, and
    # mkdir asks the store nothing (it would wait for the blackhole)
    asked = len(proxy.log)
    os.mkdir(mp / "ckpt/step-2")
    assert not [e for e in proxy.log[asked:] if "step-2" in e.path], proxy.log[asked:]
    (mp / "ckpt/step-2/extra.pt").write_bytes(more)
    assert "step-2" in os.listdir(mp / "ckpt")
    assert obj_missing_or_differs(s3_server, bucket, "ckpt/model.pt", ckpt)
    proxy.clear()
    flush(m, timeout=120)
    assert obj(s3_server, bucket, "ckpt/model.pt") == ckpt
    assert obj(s3_server, bucket, "ckpt/optim.pt") == more
    assert obj(s3_server, bucket, "ckpt/step-2/extra.pt") == more
    assert obj(s3_server, bucket, "ckpt/step-2/") == b""  # the journaled marker landed
    deadline = time.monotonic() + 60  # the probe runs every 5 s
    while m.status()["degraded"]:
        assert time.monotonic() < deadline, "never left degraded mode"  # hang guard
        time.sleep(0.2)


def obj_missing_or_differs(s3: SeaweedServer, bucket: str, key: str, data: bytes) -> bool:
    try:
        return obj(s3, bucket, key) != data
    except Exception:
        return True


@needs_root  # drops the page cache
def test_store_down_uncached_read_eio_within_deadline_and_killable(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    put(s3_server, bucket, "data/cold.bin", os.urandom(4 * MiB))
    put(s3_server, bucket, "data/cold2.bin", os.urandom(4 * MiB))
    warm = os.urandom(2 * MiB)
    put(s3_server, bucket, "data/warm.bin", warm)
    deadline = 5.0
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=deadline)))
    mp = m.mountpoint
    assert sorted(os.listdir(mp / "data")) == ["cold.bin", "cold2.bin", "warm.bin"]
    assert (mp / "data/warm.bin").read_bytes() == warm
    proxy.blackhole_all(True)
    # a reader stuck waiting on the store dies at once on SIGKILL (no D state)
    proc = subprocess.Popen([sys.executable, "-c",
                             f"open({str(mp / 'data/cold2.bin')!r}, 'rb').read()"])
    until = time.monotonic() + 60
    while not any(e.op == "get" and "cold2.bin" in e.path and e.fault == "blackhole"
                  for e in list(proxy.log)):  # the daemon's GET for that read is held
        # hang guard
        assert time.monotonic() < until and proc.poll() is None, "the read never reached the store"
        time.sleep(0.02)
    assert proc.poll() is None  # so the reader is waiting for the store
    timeouts = "tierfs_store_requests_total{op=get,status=timeout}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=5 * deadline)  # hang guard: a reader in D state would outlive the GET
    # ... and it died while the daemon's GET was still held: no GET has timed out yet
    assert m.metric(timeouts) == 0
    # an uncached read fails with EIO at the deadline (one attempt cut there), never hangs
    t0 = time.monotonic()
    with pytest.raises(OSError) as exc, open(mp / "data/cold.bin", "rb", buffering=0) as f:
        f.read(MiB)
    took = time.monotonic() - t0
    print(f"uncached read with the store down: {exc.value} after {took:.2f}s (deadline {deadline}s)")
    assert exc.value.errno == errno.EIO
    assert took < 10 * deadline, took  # hang guard
    assert m.metric(timeouts) >= 1
    # now known down (degraded): the next uncached read fails at once, asking the store nothing
    asked = len(proxy.log)
    with pytest.raises(OSError) as exc, open(mp / "data/cold.bin", "rb", buffering=0) as f:
        f.read(MiB)
    assert exc.value.errno == errno.EIO
    assert not [e for e in proxy.log[asked:] if "cold.bin" in e.path], proxy.log[asked:]
    # the daemon is up, answers status, says degraded, still serves tier 1
    st = m.status()
    assert st["pid"] == m.pid and st["degraded"] is True
    drop_page_cache()
    assert (mp / "data/warm.bin").read_bytes() == warm
    assert "data" in os.listdir(mp)
    proxy.clear()
    deadline_t = time.monotonic() + 60  # the probe runs every 5 s
    while True:  # the store is back: the same read now works
        try:
            assert len((mp / "data/cold.bin").read_bytes()) == 4 * MiB
            break
        except OSError:
            assert time.monotonic() < deadline_t  # hang guard
            time.sleep(0.2)


def run_crash_trials(m: TierfsMount, remount, s3: SeaweedServer, bucket: str, log: Path,
                     trials: int, seed: int, max_size: int = 6 << 20) -> tuple[TierfsMount, dict]:
    """`trials` times: a mixed workload, kill -9 of the daemon at a random moment,
    remount on the same cache, flush; then every acknowledged file must be in the
    bucket intact and read back intact through the mount."""
    from tests.fault.crash_workload import expected

    rng = random.Random(seed)
    figures = {"trials": 0, "files_checked": 0, "corrupt_reads": 0, "lost": 0, "bad_in_bucket": 0}
    client = s3.client()
    for trial in range(trials):
        work = subprocess.Popen(
            [sys.executable, "-m", "tests.fault.crash_workload", str(m.mountpoint),
             f"t{trial}", str(log), str(seed * 1000 + trial), str(max_size)],
            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.5))
        m.kill9()
        try:
            work.wait(timeout=10)
        except subprocess.TimeoutExpired:
            work.kill()
            work.wait()
        m = remount(m)
        flush(m)
        ok, corrupt = expected(log)
        figures["trials"] += 1
        figures["corrupt_reads"] = len(corrupt)
        for key, shas in ok.items():
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except client.exceptions.NoSuchKey:
                figures["lost"] += 1
                continue
            if hashlib.sha256(body).hexdigest() not in shas:
                figures["bad_in_bucket"] += 1
            if hashlib.sha256((m.mountpoint / key).read_bytes()).hexdigest() not in shas:
                figures["corrupt_reads"] += 1
        figures["files_checked"] = len(ok)
    return m, figures


def test_kill9_at_random_moments_loses_nothing_acknowledged(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    cache = tmp_path / "cache-crash"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)

    def remount(old: TierfsMount) -> TierfsMount:
        return mount_factory(f"s3://{bucket}", cache_dir=cache, mountpoint=old.mountpoint)

    m, figures = run_crash_trials(m, remount, s3_server, bucket, tmp_path / "work.log",
                                  trials=8, seed=3, max_size=4 << 20)
    print(f"kill -9 trials: {figures}")
    assert figures["files_checked"] >= 8
    assert figures["lost"] == 0 and figures["bad_in_bucket"] == 0 and figures["corrupt_reads"] == 0
    assert m.status()["pid"] == m.pid
