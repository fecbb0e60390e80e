"""A small or full cache disk: no egress storm, no hang, no dead daemon, no bare directory.

Found by real workloads (issue 15 §6): a 200 MiB file read through a 32 MiB
cache fetched 1.8 GiB; on a 64 MiB tmpfs cache disk the defaults (256 MiB
cache, 1 GiB floor) turned one read into 200+ GiB of GETs and a reader stuck
in D state; on a 4 MiB tmpfs the daemon died of an LMDB ENOSPC and the next
write landed in the bare directory under the mountpoint.

Store traffic is measured with the daemon's own byte counters
(tierfs_store_bytes_total{op=get}). The tmpfs cases need root (mount -t tmpfs).
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
SIZE = 200 * MiB
GET_BYTES = "tierfs_store_bytes_total{op=get}"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


def pattern(n: int) -> bytes:
    """`n` bytes that differ from MiB to MiB (a chunk served for another reads wrong)."""
    block = hashlib.sha256(b"tierfs").digest() * (MiB // 32)
    return b"".join(i.to_bytes(8, "big") + block[8:] for i in range(n // MiB))


@pytest.fixture(scope="module")
def big_bucket(s3_server: SeaweedServer) -> Iterator[tuple[str, str]]:
    """One 200 MiB object (and its sha256), uploaded once for the module's tests."""
    name = s3_server.make_bucket(f"small-cache-{os.getpid()}")
    data = pattern(SIZE)
    s3_server.client().put_object(Bucket=name, Key="data/big.dat", Body=data)
    s3_server.client().put_object(Bucket=name, Key="data/model.safetensors", Body=data)
    yield name, hashlib.sha256(data).hexdigest()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Make tmpfs mounts of a given size. List it before mount_factory in a test's
    arguments: fixtures are torn down in reverse, so the tierfs mounts go first."""
    made: list[Path] = []

    def make(size: str) -> Path:
        path = tmp_path / f"tmpfs{len(made)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       check=True)
        made.append(path)
        return path

    yield make
    for path in made:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def read_all(path: Path, block: int = MiB, limit: float = 120) -> str:
    """sha256 of `path` read with `block`-sized reads, in a child process that is
    killed (and the test failed) if it takes longer than `limit` seconds."""
    code = ("import hashlib,sys\nh=hashlib.sha256()\nf=open(sys.argv[1],'rb',buffering=0)\n"
            f"while (b:=f.read({block})): h.update(b)\nprint(h.hexdigest())")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, timeout=limit)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_file_larger_than_cache_is_fetched_once(
    mount_factory: MountFactory, big_bucket: tuple[str, str]
) -> None:
    bucket, want = big_bucket
    m = mount_factory(f"s3://{bucket}", "--cache-size", "32M")
    assert read_all(m.mountpoint / "data/big.dat") == want
    fetched = m.metric(GET_BYTES)
    print(f"200 MiB through a 32 MiB cache: fetched {fetched / MiB:.0f} MiB")
    assert fetched <= 1.1 * SIZE, fetched / SIZE
    st = m.status()
    assert st["cache"]["used_bytes"] <= 32 * MiB + 2 * MiB
    assert st["errors"] == {}


def test_concurrent_readers_never_evict_each_others_chunks(
    mount_factory: MountFactory, big_bucket: tuple[str, str]
) -> None:
    """Two sequential readers of different halves share a 16 MiB cache: neither
    evicts what the other waits for, every byte is fetched about once."""
    bucket, _ = big_bucket
    m = mount_factory(f"s3://{bucket}", "--cache-size", "16M")
    path = m.mountpoint / "data/big.dat"
    code = ("import sys,hashlib\nf=open(sys.argv[1],'rb',buffering=0)\na,n,bs=map(int,sys.argv[2:])\n"
            "f.seek(a);h=hashlib.sha256()\n"
            "while n>0:\n b=f.read(min(bs,n)); h.update(b); n-=len(b)\nprint(h.hexdigest())")
    half = SIZE // 2
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(a), str(half), str(bs)],
                              stdout=subprocess.PIPE, text=True)
             for a, bs in ((0, MiB), (half, MiB))]
    data = pattern(SIZE)
    for p, a in zip(procs, (0, half), strict=True):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        assert out.strip() == hashlib.sha256(data[a : a + half]).hexdigest()
    fetched = m.metric(GET_BYTES)
    print(f"two readers through a 16 MiB cache: fetched {fetched / MiB:.0f} MiB")
    assert fetched <= 1.1 * SIZE, fetched / SIZE


@pytest.mark.parametrize("name", ["data/big.dat", "data/model.safetensors"])
def test_readahead_stops_when_the_reader_is_gone(
    mount_factory: MountFactory, big_bucket: tuple[str, str], name: str
) -> None:
    """A reader reads 16 MiB of a 200 MiB file and closes it: the fetching stops
    (readahead, and the whole-object fetch of a model file that cannot fit)."""
    bucket, _ = big_bucket
    m = mount_factory(f"s3://{bucket}", "--cache-size", "64M")
    with open(m.mountpoint / name, "rb", buffering=0) as f:
        for _ in range(16):
            assert len(f.read(MiB)) == MiB
    deadline = time.monotonic() + 30
    last = -1.0
    while (now := m.metric(GET_BYTES)) != last:  # settled: nothing fetched for 1 s
        # hang guard
        assert time.monotonic() < deadline, "still fetching 30 s after the reader left"
        last = now
        time.sleep(1.0)
    print(f"read 16 MiB of {name}, then closed: fetched {last / MiB:.0f} MiB")
    assert last <= 16 * MiB + 64 * MiB, last / MiB  # what was in flight, at most the cache


@needs_root
def test_64mib_cache_disk_neither_hangs_nor_storms(
    tmpfs, mount_factory: MountFactory, big_bucket: tuple[str, str]
) -> None:
    bucket, want = big_bucket
    disk = tmpfs("64M")
    m = mount_factory(f"s3://{bucket}", cache_dir=disk / "cache")
    st = m.status()
    assert st["cache"]["capacity_bytes"] <= int(0.8 * 64 * MiB), st["cache"]
    assert read_all(m.mountpoint / "data/big.dat", limit=120) == want
    fetched = m.metric(GET_BYTES)
    print(f"200 MiB read with the cache on a 64 MiB tmpfs: fetched {fetched / MiB:.0f} MiB")
    assert fetched <= 1.1 * SIZE, fetched / SIZE
    assert m.status()["pid"] == m.pid


@needs_root
def test_4mib_cache_disk_gives_enospc_and_keeps_the_mount(
    tmpfs, mount_factory: MountFactory, big_bucket: tuple[str, str]
) -> None:
    bucket, want = big_bucket
    disk = tmpfs("4M")
    m = mount_factory(f"s3://{bucket}", cache_dir=disk / "cache")
    mp = m.mountpoint
    # A 10 MiB write cannot be staged on a 4 MiB disk: the writer hears it.
    res = subprocess.run(["dd", "if=/dev/zero", f"of={mp}/w10.bin", "bs=1M", "count=10",
                          "conv=fsync"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "No space left on device" in res.stderr or "Input/output error" in res.stderr, res.stderr
    # Fill what is left of the disk from outside, as another tenant would.
    subprocess.run(["dd", "if=/dev/zero", f"of={disk}/filler", "bs=64K"], capture_output=True)
    # Reads still work (through memory), other calls answer with an errno.
    assert read_all(mp / "data/big.dat", limit=120) == want
    for _ in range(3):
        try:
            (mp / "small.txt").write_bytes(b"x" * (1 << 20))
        except OSError as exc:
            assert exc.errno in (errno.ENOSPC, errno.EIO), exc
        os.listdir(mp)
    # The daemon lives and the mountpoint is still the mount, never a bare directory.
    assert m.status()["pid"] == m.pid
    assert is_mounted(mp)
    with open("/proc/self/mounts") as f:
        assert any(line.split()[1] == str(mp) and "tierfs" in line.split()[2] for line in f)
    (disk / "filler").unlink()
    m.umount()
    assert not is_mounted(mp)
    assert not any(mp.iterdir()), "something was written into the bare directory"


@needs_root
def test_cache_sizes_checked_against_the_disk_at_mount(
    tmpfs, mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    disk = tmpfs("64M")
    # More than the disk: shrunk, with one warning line.
    m = mount_factory(f"s3://{bucket}", "--cache-size", "1G", cache_dir=disk / "c1")
    warnings = [ln for ln in m.stderr.splitlines() if ln.startswith("tierfs: warning:")]
    assert len(warnings) == 1 and "1.0 GiB" in warnings[0], m.stderr
    assert m.status()["cache"]["capacity_bytes"] <= 64 * MiB
    m.umount()
    # The default is 80% of the free space (a fresh disk: all of it, less the index).
    m = mount_factory(f"s3://{bucket}", cache_dir=tmpfs("64M") / "c2", mountpoint=m.mountpoint)
    cap = m.status()["cache"]["capacity_bytes"]
    assert 0.7 * 64 * MiB <= cap <= 0.8 * 64 * MiB, cap / MiB
    m.umount()
    # Below the minimum, or a floor the disk cannot keep: one clear line, no mount.
    mp = tmp_path / "refused"
    mp.mkdir()
    mount_factory(f"s3://{bucket}", mountpoint=mp, start=False)  # tears down what gets mounted
    for args, expect in (
        (["--cache-size", "1M"], "below the minimum"),
        (["--config", str(_config(tmp_path, 'min_free = "64M"'))], "min_free"),
        (["--config", str(_config(tmp_path, 'min_free = "63M"'))], "minimum tier 1"),
    ):
        res = run_tierfs("mount", f"s3://{bucket}", str(mp), "--cache-dir", str(disk / "c3"),
                         *args, env=m.env)
        err = res.stderr.strip()
        assert res.returncode != 0 and len(err.splitlines()) == 1 and expect in err, err
        assert "Traceback" not in err and not is_mounted(mp)


def _config(tmp_path: Path, line: str) -> Path:
    path = tmp_path / f"cache{abs(hash(line))}.toml"
    path.write_text(f"[cache]\n{line}\n")
    return path


@pytest.mark.timeout(120)
def test_internal_error_leaves_a_dead_mount_not_a_bare_directory(
    bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """A daemon that dies of a bug after mounting must leave the mount answering
    ENOTCONN (so writes fail) rather than unmount itself; `tierfs mount` repairs it.

    The failure is injected (a background task replaced by one that raises): an
    internal error is a bug, and no real component produces one on demand."""
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    env = {**os.environ, **s3_server.env()}
    code = (
        "import os, sys, trio\n"
        "import tierfs.health as health\n"
        "async def boom(self, probe):\n"
        # (mountinfo, not a stat of the mountpoint: a stat from the daemon's own
        # loop waits for that loop to answer it: a deadlock, seen under load)
        f"    while ' {mp} ' not in open('/proc/self/mountinfo').read():\n"
        "        await trio.sleep(0.05)\n"
        "    await trio.sleep(0.5)\n"
        "    raise RuntimeError('injected internal error')\n"
        "health.StoreHealth.watch = boom\n"
        "from tierfs.cli import main\n"
        f"sys.exit(main(['mount', 's3://{bucket}', {str(mp)!r}, '--foreground', "
        f"'--cache-dir', {str(cache)!r}]))\n"
    )
    daemon = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                              text=True)
    m = TierfsMount(f"s3://{bucket}", mp, cache, env)
    try:
        _, err = daemon.communicate(timeout=60)
        assert daemon.returncode != 0
        assert "injected internal error" in err and "ENOTCONN" in err, err
        assert is_mounted(mp), "the daemon unmounted itself: writes would go to the bare dir"
        with pytest.raises(OSError) as exc:
            (mp / "lost.bin").write_bytes(b"x")
        assert exc.value.errno == errno.ENOTCONN
        m.start()  # repairs the dead mount
        assert m.status()["pid"] == m.pid
        (mp / "kept.bin").write_bytes(b"y")
        m.umount()
        assert not any(mp.iterdir())
    finally:
        if daemon.poll() is None:
            daemon.kill()
        m.cleanup()
