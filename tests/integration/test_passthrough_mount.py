"""FUSE passthrough in tierfs (DESIGN §3.8), on a real mount of a real bucket.

A file whose tier-1 copy is complete and verified is served by the kernel
from its cache file: reads, preads and mmap reach no daemon READ handler
(`tierfs_read_latency_seconds_count` stays put). Everything else keeps the
daemon path, and the two modes never mix on one inode (the kernel would fail
the open with EIO). Needs root and the passthrough build (tierfs.fuse.passthrough's
probe says why not); the `--no-passthrough` checks run anywhere.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.mount import PASSTHROUGH_OFF, TierfsMount, drop_page_cache
from tests.support.seaweed import SeaweedServer
from tierfs.fuse import passthrough, splice

MiB = 1 << 20
MODE = passthrough.probe(Path(tempfile.gettempdir()))
needs_passthrough = pytest.mark.skipif(
    not MODE.enabled or PASSTHROUGH_OFF,
    reason=f"FUSE passthrough off: {MODE.reason}" if not MODE.enabled
    else "TIERFS_TEST_PASSTHROUGH=0")
READS = "tierfs_read_latency_seconds_count"  # FUSE READ requests the daemon served
FLUSHES = "tierfs_metadata_ops_total{op=flush}"  # FUSE FLUSH requests (one per close(2))


def sha(data: bytes | mmap.mmap) -> str:
    return hashlib.sha256(data).hexdigest()


def read_all(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:  # hang guard
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def all_released(m: TierfsMount) -> None:
    """Wait until every handle's RELEASE (sent after close(2) returned) and every
    background task let go of tier 1: the next open starts the inode afresh."""
    wait_for(lambda: m.status()["cache"]["open_objects"] == 0, "every cache entry released")


def opens(m: TierfsMount) -> dict[str, dict[str, int]]:
    return m.status()["passthrough"]["opens"]


def passthrough_opens(m: TierfsMount) -> int:
    return sum(opens(m).get("passthrough", {}).values())


@pytest.fixture
def obj(s3_server: SeaweedServer, bucket: str) -> bytes:
    data = random.Random(19).randbytes(12 * MiB + 4321)
    s3_server.client().put_object(Bucket=bucket, Key="data/shard.tar", Body=data)
    return data


@needs_passthrough
def test_a_complete_verified_file_is_served_by_the_kernel(
    mount_factory: MountFactory, bucket: str, obj: bytes
) -> None:
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "data/shard.tar"
    st = m.status()["passthrough"]
    assert st["enabled"], st["reason"]
    assert read_all(path) == obj  # cold: the daemon fetches, stores and verifies
    all_released(m)
    assert passthrough_opens(m) == 0 and opens(m)["daemon"]["partial"] == 1
    reads = m.metric(READS)
    assert reads > 0

    with open(path, "rb", buffering=0) as f:
        assert sha(f.read()) == sha(obj)
        rng = random.Random(1)
        for _ in range(300):
            off = rng.randrange(len(obj))
            assert os.pread(f.fileno(), 4096, off) == obj[off:off + 4096]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            assert sha(mm) == sha(obj)
        assert m.status()["passthrough"]["open_inodes"] == 1
    assert m.metric(READS) == reads, "the daemon served READs of a passthrough file"
    assert passthrough_opens(m) == 1
    all_released(m)
    assert m.status()["passthrough"]["open_inodes"] == 0


@needs_passthrough
def test_closing_a_read_only_descriptor_sends_no_flush(
    mount_factory: MountFactory, bucket: str, obj: bytes
) -> None:
    """Read-only opens are answered with FOPEN_NOFLUSH (their flush does nothing):
    close(2) sends no FLUSH, a request fewer per file of a walk. A descriptor
    open for writing still sends it: its close seals what it wrote."""
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "data/shard.tar"
    for _ in range(3):  # a daemon-served open (cold), then passthrough ones
        assert read_all(path) == obj
    fd = os.open(path, os.O_RDONLY)
    os.close(os.dup(fd))  # each close(2) of a descriptor would send one
    os.close(fd)
    all_released(m)
    assert passthrough_opens(m) >= 1
    assert m.metric(FLUSHES) == 0
    (m.mountpoint / "data/new.bin").write_bytes(b"x" * 1000)
    assert m.metric(FLUSHES) >= 1
    assert read_all(m.mountpoint / "data/new.bin") == b"x" * 1000


@needs_passthrough
def test_after_a_restart_the_file_is_verified_in_the_background_first(
    mount_factory: MountFactory, bucket: str, obj: bytes, tmp_path: Path
) -> None:
    """Chunks on disk are not trusted after a restart until checked: the first open
    is served by the daemon and starts the check; a corrupt chunk is dropped
    (and fetched again), never handed to the kernel."""
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    path = m.mountpoint / "data/shard.tar"
    assert read_all(path) == obj
    m.umount()
    files = [p for p in (cache / "objects").iterdir() if p.stat().st_size == len(obj)]
    assert len(files) == 1
    with open(files[0], "r+b") as f:  # a torn write in chunk 5
        f.seek(5 * MiB + 100)
        f.write(b"\xff" * 64)

    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    path = m.mountpoint / "data/shard.tar"
    os.close(os.open(path, os.O_RDONLY))  # opened, nothing read: verification starts
    wait_for(lambda: m.status()["cache"]["corrupt_chunks"] == 1, "the corrupt chunk dropped")
    all_released(m)
    assert passthrough_opens(m) == 0 and opens(m)["daemon"]["unverified"] == 1
    # Not complete any more: the daemon path, which fetches the chunk again.
    assert read_all(path) == obj
    assert m.metric("tierfs_store_bytes_total{op=get}") >= MiB
    all_released(m)
    reads = m.metric(READS)
    assert read_all(path) == obj
    assert passthrough_opens(m) == 1 and m.metric(READS) == reads


@needs_passthrough
def test_a_clean_copy_is_verified_without_being_read(
    mount_factory: MountFactory, bucket: str, obj: bytes, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    assert read_all(m.mountpoint / "data/shard.tar") == obj
    m.umount()
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    path = m.mountpoint / "data/shard.tar"
    with open(path, "rb") as f:
        assert f.read(10) == obj[:10]  # the daemon path serves meanwhile
    all_released(m)  # the background check holds the object until done
    reads = m.metric(READS)
    assert read_all(path) == obj
    assert passthrough_opens(m) == 1 and m.metric(READS) == reads
    assert m.metric("tierfs_store_bytes_total{op=get}") == 0


@needs_passthrough
def test_a_writer_joins_passthrough_readers_of_the_same_file(
    mount_factory: MountFactory, bucket: str, obj: bytes, s3_server: SeaweedServer
) -> None:
    """A writable open of an object complete and verified in tier 1 makes it a
    local write and joins the passthrough readers on the same backing file (the
    kernel fails mixed modes with EIO): they see its writes, as on a local disk,
    and the daemon sees no WRITE. Opened for writing and closed unwritten, the
    object stays as it was: no upload."""
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "data/shard.tar"
    assert read_all(path) == obj
    all_released(m)
    etag = s3_server.client().head_object(Bucket=bucket, Key="data/shard.tar")["ETag"]
    with open(path, "r+b", buffering=0) as f:  # opened for writing, nothing written
        assert f.read(4096) == obj[:4096]
    all_released(m)
    flush(m)
    assert s3_server.client().head_object(Bucket=bucket, Key="data/shard.tar")["ETag"] == etag
    patch = b"written by the kernel"
    writes = m.metric(WRITES)
    with open(path, "rb", buffering=0) as reader:
        assert reader.read(4096) == obj[:4096]
        with open(path, "r+b", buffering=0) as writer:
            writer.seek(3 * MiB)
            assert writer.write(patch) == len(patch)
            assert os.pread(reader.fileno(), len(patch), 3 * MiB) == patch
    assert m.metric(WRITES) == writes
    assert opens(m)["passthrough"]["writable"] == 2 and "refused" not in opens(m)
    want = obj[:3 * MiB] + patch + obj[3 * MiB + len(patch):]
    assert m.umount().returncode == 0
    got = s3_server.client().get_object(Bucket=bucket, Key="data/shard.tar")["Body"].read()
    assert sha(got) == sha(want)


@needs_passthrough
def test_a_new_etag_gets_a_new_cache_file_and_backing_id(
    mount_factory: MountFactory, bucket: str, obj: bytes, s3_server: SeaweedServer,
    tmp_path: Path
) -> None:
    """An object replaced in the store gets a new inode (namespace.py), so opens
    of the new version never have to share the old version's mode: they read
    it at once, beside handles still reading the old one through passthrough,
    and once it is complete in tier 1 it goes passthrough from its own file."""
    conf = tmp_path / "ttl.toml"
    conf.write_text("[classes.dataset]\nattr_ttl = 0\nlist_ttl = 0\n"
                    "[classes.default]\nattr_ttl = 0\nlist_ttl = 0\n")
    m = mount_factory(f"s3://{bucket}", "--config", str(conf))
    path = m.mountpoint / "data/shard.tar"
    assert read_all(path) == obj
    all_released(m)
    new = random.Random(20).randbytes(5 * MiB)
    with open(path, "rb", buffering=0) as old_reader:
        assert old_reader.read(4096) == obj[:4096]
        assert passthrough_opens(m) == 1
        s3_server.client().put_object(Bucket=bucket, Key="data/shard.tar", Body=new)
        assert read_all(path) == new
        assert os.pread(old_reader.fileno(), 4096, 4096) == obj[4096:8192]
    assert opens(m)["daemon"]["partial"] == 2  # the first read of each version
    all_released(m)
    reads = m.metric(READS)
    with open(path, "rb", buffering=0) as f:
        assert f.read() == new
    assert passthrough_opens(m) == 2 and m.metric(READS) == reads


@needs_passthrough
def test_eviction_never_punches_a_file_the_kernel_reads(
    mount_factory: MountFactory, bucket: str, obj: bytes, s3_server: SeaweedServer
) -> None:
    """An open object's chunks may be shed under pressure on the daemon path (its
    reads check them); the kernel would read the holes as zeros."""
    other = random.Random(21).randbytes(40 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="data/other.tar", Body=other)
    m = mount_factory(f"s3://{bucket}", "--cache-size", "16M")
    path = m.mountpoint / "data/shard.tar"
    assert read_all(path) == obj
    all_released(m)
    with open(path, "rb", buffering=0) as f:
        assert passthrough_opens(m) == 1
        assert sha(read_all(m.mountpoint / "data/other.tar")) == sha(other)
        assert m.status()["cache"]["evictions"] > 0
        f.seek(0)
        assert sha(f.read()) == sha(obj)


@needs_passthrough
def test_getxattr_answers_enosys(mount_factory: MountFactory, bucket: str, obj: bytes) -> None:
    """Any other answer makes each write(2) on a passthrough file cost a
    GETXATTR(security.capability) round trip; the kernel maps ENOSYS to EOPNOTSUPP."""
    m = mount_factory(f"s3://{bucket}")
    for _ in range(2):
        with pytest.raises(OSError) as exc:
            os.getxattr(m.mountpoint / "data/shard.tar", "security.capability")
        assert exc.value.errno == errno.EOPNOTSUPP


def test_no_passthrough_serves_every_open_on_the_daemon_path(
    mount_factory: MountFactory, bucket: str, obj: bytes
) -> None:
    m = mount_factory(f"s3://{bucket}", "--no-passthrough")
    st = m.status()["passthrough"]
    assert not st["enabled"]
    assert st["reason"] == "turned off: --no-passthrough or [read] passthrough = false"
    path = m.mountpoint / "data/shard.tar"
    for _ in range(2):
        assert read_all(path) == obj
        all_released(m)
    assert passthrough_opens(m) == 0 and opens(m)["daemon"]["off"] == 2
    said = [line for line in (m.cache_dir / "tierfs.log").read_text().splitlines()
            if "FUSE passthrough" in line]
    assert len(said) == 1 and f"FUSE passthrough: off ({st['reason']})" in said[0]


@needs_root  # drops the page cache
@pytest.mark.skipif(not splice.FILE_SLICES, reason="stock pyfuse3: no FileSlice (third_party/build.sh)")
@pytest.mark.parametrize("mode", ["on", "off"])
def test_without_passthrough_checked_bytes_are_answered_from_the_tier1_file(
    mount_factory: MountFactory, bucket: str, obj: bytes, tmp_path: Path, mode: str
) -> None:
    """`[read] splice`: with it on, a read of tier-1 bytes this daemon checked is
    handed to libfuse as a range of the file (fuse/splice.py); the reader gets
    the same bytes either way. "on" lends whether or not this machine lets
    libfuse splice (it copies where it cannot), so both paths run here."""
    conf = tmp_path / "splice.toml"
    conf.write_text(f'[read]\nsplice = "{mode}"\n')
    m = mount_factory(f"s3://{bucket}", "--no-passthrough", "--config", str(conf))
    path = m.mountpoint / "data/shard.tar"
    assert read_all(path) == obj  # cold: from the parts as they landed in memory
    all_released(m)
    drop_page_cache()  # the next reads reach the daemon
    # Only pages in the page cache are lent (Serving.lend): read the tier-1 file in.
    tier1 = [p for p in m.cache_dir.rglob("*") if p.is_file() and p.stat().st_size == len(obj)]
    assert len(tier1) == 1
    assert tier1[0].read_bytes() == obj
    assert read_all(path) == obj  # from tier 1, checked when fetched
    st = m.status()["passthrough"]
    assert st["splice"] is (mode == "on")
    if mode == "on":
        assert st["spliced_reads"] >= len(obj) // MiB  # every big read: at most 1 MiB each
    else:
        assert st["spliced_reads"] == 0


# -- writes served by the kernel ----------------------------------------------------------

WRITES = "tierfs_metadata_ops_total{op=write}"  # FUSE WRITE requests the daemon served


def stored(s3_server: SeaweedServer, bucket: str, key: str) -> bytes:
    body: bytes = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def flush(m: TierfsMount) -> None:
    from tests.support.mount import run_tierfs

    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)
    assert res.returncode == 0, res.stderr


@needs_passthrough
def test_a_new_file_is_written_by_the_kernel_and_uploaded_whole(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """O_CREAT of a new file opens in passthrough on its tier-1 file: no WRITE
    reaches the daemon, stat shows the size while it is open, and after close
    the bucket holds exactly what was written."""
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "out/new.bin"
    path.parent.mkdir()
    data = random.Random(30).randbytes(9 * MiB + 77)
    writes = m.metric(WRITES)
    with open(path, "wb", buffering=0) as f:
        assert opens(m)["passthrough"]["writable"] == 1
        for off in range(0, len(data), 1 << 16):
            f.write(data[off:off + (1 << 16)])
            if off == 4 * MiB:
                assert os.fstat(f.fileno()).st_size == off + (1 << 16)
                assert path.stat().st_size == off + (1 << 16)
        assert os.stat(path).st_size == len(data)
    assert m.metric(WRITES) == writes
    assert path.stat().st_size == len(data) and read_all(path) == data
    flush(m)
    assert sha(stored(s3_server, bucket, "out/new.bin")) == sha(data)


@needs_passthrough
def test_o_trunc_torch_style_save_and_replace_land_whole(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """O_TRUNC of an existing file, write + fsync + os.replace before close (the
    savers' pattern), a write after fsync, ftruncate and pwrite past the end:
    each is taken in at flush, fsync or release, and the bucket ends equal to
    the local file."""
    m = mount_factory(f"s3://{bucket}")
    d = m.mountpoint / "ckpt"
    d.mkdir()
    (d / "model.pt").write_bytes(b"old" * 1000)
    flush(m)
    all_released(m)
    data = random.Random(31).randbytes(3 * MiB + 5)
    with open(d / "model.pt", "r+b", buffering=0) as f:  # existing, clean, verified
        f.write(b"x")
    flush(m)
    all_released(m)
    with open(d / "model.pt", "wb", buffering=0) as f:  # O_TRUNC: passthrough
        f.write(data)
        os.fsync(f.fileno())
        f.write(b"tail after fsync")
        os.ftruncate(f.fileno(), len(data) + 10)
        os.pwrite(f.fileno(), b"END", len(data) + 20)
    want = data + b"tail after" + b"\0" * 10 + b"END"
    assert read_all(d / "model.pt") == want
    flush(m)
    assert sha(stored(s3_server, bucket, "ckpt/model.pt")) == sha(want)
    # torch.save to a temp name, fsync, os.replace while still open
    tmp = d / "model.pt.tmp"
    data2 = random.Random(32).randbytes(2 * MiB)
    with open(tmp, "wb", buffering=0) as f:
        f.write(data2[:MiB])
        os.replace(tmp, d / "model.pt")
        f.write(data2[MiB:])
        os.fsync(f.fileno())
    assert read_all(d / "model.pt") == data2
    flush(m)
    assert sha(stored(s3_server, bucket, "ckpt/model.pt")) == sha(data2)
    assert "ckpt/model.pt.tmp" not in [
        o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert m.umount().returncode == 0
    other = mount_factory(f"s3://{bucket}")
    assert read_all(other.mountpoint / "ckpt/model.pt") == data2


@needs_passthrough
def test_a_reader_opening_during_the_write_sees_what_was_written(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """Opens beside a passthrough writer share its backing file (the kernel's rule:
    one mode per inode): a reader sees every byte written so far, a second writer
    writes the same file, and an mmap sees the writes."""
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "shared.bin"
    part = random.Random(33).randbytes(MiB)
    with open(path, "wb", buffering=0) as w:
        w.write(part)
        with open(path, "rb", buffering=0) as r:
            assert r.read() == part
            w.write(part[::-1])
            assert os.pread(r.fileno(), MiB, MiB) == part[::-1]
            with open(path, "r+b", buffering=0) as w2:
                os.pwrite(w2.fileno(), b"second", 0)
            assert os.pread(r.fileno(), 6, 0) == b"second"
            with mmap.mmap(r.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[MiB:2 * MiB] == part[::-1]
        assert opens(m)["passthrough"]["writable"] == 2
    want = b"second" + part[6:] + part[::-1]
    flush(m)
    assert sha(stored(s3_server, bucket, "shared.bin")) == sha(want)
    all_released(m)
    with open(path, "rb", buffering=0) as r:  # uploaded: complete, verified at its seal
        assert r.read() == want


@needs_passthrough
def test_an_unlinked_passthrough_file_is_never_uploaded(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "scratch.bin"
    with open(path, "wb", buffering=0) as f:
        f.write(b"y" * 5000)
        os.unlink(path)
        f.write(b"z" * 5000)
        st = os.fstat(f.fileno())
        assert st.st_nlink == 0
        f.seek(0)
    flush(m)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "scratch.bin" not in keys
