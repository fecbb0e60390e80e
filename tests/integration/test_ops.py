"""Operating a mount on a fleet (DESIGN §7): systemd readiness and unit,
mount(8)/umount(8), the metrics endpoint vs `tierfs status`, warmup then a
dead store, cache and policy commands. Real mounts, real SeaweedFS."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def wait_dead(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# -- systemd -----------------------------------------------------------------------


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd')")
    unit = (REPO / "systemd" / "tierfs@.service").read_text()
    assert "Type=notify" in unit and "/dev/fuse" in unit
    for hiding in ("ProtectSystem=", "PrivateTmp=", "PrivateDevices=", "ProtectHome=",
                   "ReadWritePaths=", "PrivateMounts="):
        assert f"\n{hiding}" not in unit, f"{hiding} would hide the FUSE mount from the node"
    # The template as installed by `make install`, pointing at this venv's tierfs.
    inst = tmp_path / "tierfs@data.service"
    inst.write_text(unit.replace("/usr/local/bin/tierfs", str(VENV_BIN / "tierfs")))
    res = subprocess.run([analyze, "verify", str(inst)], capture_output=True, text=True, timeout=60)
    print(f"$ systemd-analyze verify {inst.name}\n{res.stdout}{res.stderr}(exit {res.returncode})")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "" and res.stdout.strip() == ""


def test_ready_notification_only_once_the_mount_answers(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="a.txt", Body=b"hello")
    m = mount_factory(f"s3://{bucket}", start=False)  # for its teardown
    m.mountpoint.mkdir()
    nsock = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(nsock))
    srv.settimeout(30)
    env = {**m.env, "NOTIFY_SOCKET": str(nsock)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierfs", "mount", m.source, str(m.mountpoint), "--foreground",
         "--cache-dir", str(m.cache_dir)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    m.pid = proc.pid
    try:
        msg = srv.recv(4096).decode()
        # Checked the instant READY arrives: the mount must already answer.
        st = os.stat(m.mountpoint)
        assert st.st_ino == 1
        assert is_mounted(m.mountpoint)
        fields = dict(line.split("=", 1) for line in msg.splitlines())
        assert fields["READY"] == "1"
        assert fields["MAINPID"] == str(proc.pid)
        assert (m.mountpoint / "a.txt").read_bytes() == b"hello"
        proc.send_signal(signal.SIGTERM)
        assert srv.recv(4096) == b"STOPPING=1"
        assert proc.wait(timeout=30) == 0
        assert not is_mounted(m.mountpoint)
        err = proc.stderr.read().decode() if proc.stderr else ""
        lines = [ln for ln in err.splitlines() if ln]
        assert lines and all(re.match(r"^ts=\S+ level=\w+ logger=\S+ msg=", ln) for ln in lines), err
        assert "tierfssecret" not in err
    finally:
        srv.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- mount(8) / umount(8) ------------------------------------------------------------


@pytest.fixture
def mount_helper_installed() -> Iterator[Path]:
    """/sbin/mount.tierfs -> this venv's helper, for the test only (root in CI)."""
    if os.geteuid() != 0:
        pytest.skip("mount -t tierfs needs root")
    link = Path("/sbin/mount.tierfs")
    target = VENV_BIN / "mount.tierfs"
    created = False
    if link.is_symlink() or link.exists():
        if not (link.is_symlink() and os.readlink(link) == str(target)):
            pytest.skip(f"{link} exists and is not this checkout's helper; not touching it")
    else:
        link.symlink_to(target)
        created = True
    try:
        yield link
    finally:
        if created:
            link.unlink()


def test_mount_t_tierfs_and_umount(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
    mount_helper_installed: Path,
) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="d/x.bin", Body=b"x" * 3000)
    m = mount_factory(f"s3://{bucket}", start=False)
    m.mountpoint.mkdir()
    opts = (f"_netdev,nofail,defaults,x-systemd.mount-timeout=30,cache_dir={m.cache_dir},"
            "cache_size=1G")
    res = subprocess.run(["mount", "-t", "tierfs", "-o", opts, m.source, str(m.mountpoint)],
                         env=m.env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert is_mounted(m.mountpoint)
    m.pid = int(m.status()["pid"])
    with open("/proc/self/mounts") as f:
        line = next(ln for ln in f if ln.split()[1] == str(m.mountpoint))
    assert line.split()[2] == "fuse.tierfs" and line.split()[0] == f"tierfs:{m.source}"
    assert (m.mountpoint / "d/x.bin").read_bytes() == b"x" * 3000
    assert m.status()["cache"]["capacity_bytes"] == 1 << 30
    pid = m.pid
    res = subprocess.run(["umount", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.mountpoint)
    assert wait_dead(pid), "daemon outlived umount(8)"
    m.pid = None
    # an unknown option fails mount(8) with the helper's one-line reason
    res = subprocess.run(["mount", "-t", "tierfs", "-o", "colour=red", m.source, str(m.mountpoint)],
                         env=m.env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "unknown mount option 'colour'" in res.stderr
    assert not is_mounted(m.mountpoint)


# -- metrics endpoint vs status ---------------------------------------------------------


def test_metrics_move_during_a_read_and_status_agrees(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    size = 48 * MiB
    data = os.urandom(size)
    s3_server.client().put_object(Bucket=bucket, Key="data/shard-0.tar", Body=data)
    refused = run_tierfs("mount", f"s3://{bucket}", str(tmp_path), "--metrics-addr",
                         "0.0.0.0:9464", env={**os.environ, **s3_server.env()})
    assert refused.returncode == 1 and "not loopback" in refused.stderr
    port = free_port()
    m = mount_factory(f"s3://{bucket}", "--metrics-addr", f"127.0.0.1:{port}")
    key = "tierfs_read_bytes_total{tier=store}"
    seen: list[float] = []
    done = threading.Event()

    def read_slowly() -> None:
        try:
            with open(m.mountpoint / "data/shard-0.tar", "rb", buffering=0) as f:
                while f.read(MiB):
                    time.sleep(0.02)
        finally:
            done.set()

    t = threading.Thread(target=read_slowly)
    t.start()
    while not done.is_set():
        got = scrape(port)
        seen.append(got.get(key, 0.0) + got.get("tierfs_read_bytes_total{tier=cache}", 0.0))
        time.sleep(0.1)
    t.join()
    moving = sorted(set(v for v in seen if 0 < v < size))
    assert len(moving) >= 2, f"counters did not move during the read: {seen}"
    assert seen == sorted(seen)

    prom = scrape(port)
    st = m.status()
    assert prom["tierfs_store_bytes_total{op=get}"] == st["metrics"]["tierfs_store_bytes_total{op=get}"]
    assert st["store"]["get_bytes"] == prom["tierfs_store_bytes_total{op=get}"] >= size
    read_total = prom[key] + prom.get("tierfs_read_bytes_total{tier=cache}", 0.0)
    # At least every byte once; the kernel may ask again for pages it dropped
    # under memory pressure, and tierfs counts what it was asked.
    assert read_total == st["reads"]["total_bytes"] and size <= read_total <= 2 * size
    assert st["store"]["requests"]["get"]["ok"] == prom["tierfs_store_requests_total{op=get,status=ok}"]
    assert st["read_latency"]["count"] == prom["tierfs_read_latency_seconds_count"] > 0
    assert 0 < st["read_latency"]["p50"] <= st["read_latency"]["p95"] <= st["read_latency"]["p99"]
    assert st["cache"]["used_bytes"] == prom["tierfs_cache_bytes"] >= size
    assert prom["tierfs_cache_objects"] == st["cache"]["objects"] == 1
    assert prom["tierfs_pending_upload_bytes"] == st["pending"]["bytes"] == 0
    assert "tierfs_evictions_total" in prom
    assert st["metrics_addr"] == f"http://127.0.0.1:{port}/metrics"
    assert st["classes"]["manifest"]["revalidate_on_open"] is True
    assert st["classes"]["dataset"]["list_ttl"] == 300.0

    # Bytes readahead had fetched before the read asked count as tier-1 hits.
    r = st["reads"]
    assert r["hit_ratio"] == pytest.approx(r["cache_bytes"] / r["total_bytes"])
    assert sha(m.mountpoint / "data/shard-0.tar") == hashlib.sha256(data).hexdigest()
    table = run_tierfs("status", str(m.mountpoint), env=m.env, check=True).stdout
    print(table)
    for word in ("source", "tier 1", "hit ratio", "p50", "p99", "pending uploads",
                 "quarantined", "requests:", "get ", "manifest", "*.tar"):
        assert word in table, word
    # Into a pipe (a log): name: value lines within 80 columns, nothing cut.
    assert all(len(line) <= 80 for line in table.splitlines()) and "…" not in table, table
    for name in st["classes"]:
        assert f"\n  {name}: attr ttl " in table, name


# -- warmup, then the store goes away ----------------------------------------------------


@pytest.mark.timeout(240)
def test_warmup_then_read_with_the_store_down(own_server: SeaweedServer, tmp_path: Path) -> None:
    size = 256 * MiB
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for _ in range(size // (16 * MiB)):
            f.write(os.urandom(16 * MiB))
    want = sha(src)
    c = own_server.client()
    own_server.make_bucket("warm")
    c.upload_file(str(src), "warm", "models/big.bin")
    src.unlink()
    small = {f"models/tok/{i}.json": os.urandom(1000 + i) for i in range(5)}
    for k, v in small.items():
        c.put_object(Bucket="warm", Key=k, Body=v)

    env = {**os.environ, **own_server.env()}
    m = TierfsMount("s3://warm", tmp_path / "mnt", tmp_path / "cache", env)
    try:
        m.start()
        mp = m.mountpoint
        # Non-terminal output: one plain progress line a second, then a summary.
        res = run_tierfs("warmup", str(mp / "models/big.bin"), "--parallel", "4", env=env,
                         timeout=180)
        print(res.stdout, res.stderr)
        assert res.returncode == 0, res.stderr
        assert res.stderr.startswith("warmup: 1 file(s), 256.0 MiB\n")
        prog = [ln for ln in res.stderr.splitlines() if re.match(
            r"^warmup: [\d.]+ \w+ / 256\.0 MiB +[\d.]+% [\d.]+ \w+/s eta \S+ files \d/1$", ln)]
        assert prog and prog[-1].startswith("warmup: 256.0 MiB / 256.0 MiB 100.0%"), res.stderr
        assert re.search(r"^warmed 1/1 file\(s\), 256\.0 MiB \(256\.0 MiB fetched from the store\)",
                         res.stdout, re.M), res.stdout
        st = m.status()
        assert st["cache"]["used_bytes"] >= size
        assert st["reads"]["total_bytes"] == 0  # warmup is not a read

        # A rich bar when forced (what a terminal shows), directories with -r,
        # and failures listed with a non-zero exit.
        res = run_tierfs("warmup", "-r", str(mp / "models"), str(mp / "models/nope.bin"),
                         str(mp / "models/tok"), env={**env, "TIERFS_PROGRESS": "1"}, timeout=120)
        print(res.stdout, res.stderr)
        assert res.returncode == 1
        assert "warmup" in res.stderr and "256.0" in res.stderr and "\x1b[" in res.stderr
        assert f"tierfs: warmup failed: {mp / 'models/nope.bin'}: No such file or directory" in res.stderr
        assert re.search(r"warmed 6/6 file\(s\), 256\.0 MiB \(\d+\.\d KiB fetched", res.stdout)

        ls = json.loads(run_tierfs("cache", "ls", str(mp), "--json", env=env, check=True).stdout)
        by_key = {o["key"]: o for o in ls}
        assert by_key["models/big.bin"]["cached_bytes"] == size
        assert all(by_key[k]["cached_bytes"] == len(v) for k, v in small.items())
        assert {o["state"] for o in ls} == {"clean"}

        m.umount()
        own_server.stop()
        # With the store gone every listing waits out the store deadline before
        # falling back to the tier-1 index: keep it short (a config file's job).
        cfg = tmp_path / "down.toml"
        cfg.write_text("[store]\nconnect_timeout = 1\nread_timeout = 2\ndeadline = 2\n")
        m = TierfsMount("s3://warm", tmp_path / "mnt", tmp_path / "cache", env,
                        extra=["--config", str(cfg)])
        m.start()
        assert m.status()["degraded"] is True
        assert sha(mp / "models/big.bin") == want
        assert (mp / "models/tok/3.json").read_bytes() == small["models/tok/3.json"]
        assert m.metric("tierfs_store_bytes_total{op=get}") == 0
        st = m.status()
        assert st["reads"]["hit_ratio"] == 1.0
    finally:
        m.cleanup()


# -- cache and policy commands -------------------------------------------------------------


def test_cache_commands_and_policy(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    c = s3_server.client()
    blobs = {"ck/step-5/model.safetensors": os.urandom(3 * MiB + 7), "ck/step-5/.metadata": b"{}",
             "data/a.tar": os.urandom(2 * MiB)}
    for k, v in blobs.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    env = m.env
    for k in blobs:
        (mp / k).read_bytes()

    out = run_tierfs("cache", "ls", str(mp), env=env, check=True).stdout
    assert "ck/step-5/model.safetensors" in out and "clean" in out
    stats = json.loads(run_tierfs("cache", "stats", str(mp), "--json", env=env, check=True).stdout)
    assert stats["stats"]["objects"] == 3

    res = run_tierfs("cache", "evict", str(mp / "ck"), env=env)
    assert res.returncode == 0, res.stderr
    assert "evicted ck/step-5/model.safetensors (3.0 MiB)" in res.stdout
    ls = json.loads(run_tierfs("cache", "ls", str(mp), "--json", env=env, check=True).stdout)
    cached = {o["key"]: o["cached_bytes"] for o in ls}
    assert cached.get("ck/step-5/model.safetensors", 0) == 0 and cached["data/a.tar"] == 2 * MiB
    st = m.status()
    assert st["cache"]["evictions"] >= 2
    res = run_tierfs("cache", "evict", str(mp / "nothing-here"), env=env)
    assert res.returncode == 1 and "nothing of it is in tier 1" in res.stderr

    # Corrupt one chunk of the cached shard on disk: verify finds and drops it.
    objs = [p for p in (m.cache_dir / "objects").iterdir() if p.stat().st_blocks > 0]
    assert len(objs) == 1
    with open(objs[0], "r+b") as f:
        f.seek(MiB + 10)
        f.write(b"garbage!")
    res = run_tierfs("cache", "verify", str(mp), env=env, check=True)
    assert "bad chunk(s) [1] in data/a.tar" in res.stdout, res.stdout
    assert "1 bad chunk(s) dropped" in res.stdout
    assert (mp / "data/a.tar").read_bytes() == blobs["data/a.tar"]  # refetched, never served bad

    res = run_tierfs("policy", str(mp), "ck/step-5/.metadata", env=env, check=True)
    assert res.stdout.startswith("ck/step-5/.metadata: class manifest (rule '.metadata')")
    pol = json.loads(run_tierfs("policy", str(mp), str(mp / "data/a.tar"), "--json", env=env,
                                check=True).stdout)
    assert (pol["class"], pol["rule"], pol["settings"]["keep_cache"]) == ("dataset", "*.tar", True)
    res = run_tierfs("policy", str(mp), "notes.txt", env=env, check=True)
    assert "class default (no rule matched" in res.stdout


def test_config_file_drives_a_mount(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="x/notes.txt", Body=b"n")
    cfg = tmp_path / "m.toml"
    mp = tmp_path / "cfgmnt"
    cfg.write_text(f'source = "s3://{bucket}"\nmountpoint = "{mp}"\n[cache]\nsize = "300M"\n'
                   '[classes.hot]\nattr_ttl = 1\n[[rules]]\nglob = "x/**"\nclass = "hot"\n'
                   '[logging]\nlevel = "debug"\n')
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg), mountpoint=mp)
    st = m.status()
    assert st["config_file"] == str(cfg)
    assert st["cache"]["capacity_bytes"] == 300 * MiB
    assert st["rules"][0] == {"glob": "x/**", "class": "hot"}
    res = run_tierfs("policy", str(mp), "x/notes.txt", env=m.env, check=True)
    assert "class hot (rule 'x/**')" in res.stdout
    # `tierfs umount --config` (systemd's ExecStop) finds the mountpoint in the file
    pid = m.pid
    res = run_tierfs("umount", "--config", str(cfg), env=m.env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mp)
    assert pid is not None and wait_dead(pid)
    m.pid = None
    assert "level=debug" in (m.cache_dir / "tierfs.log").read_text()  # [logging] level
