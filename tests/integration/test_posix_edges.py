"""POSIX calls the rest of the suite did not reach: renameat2 flags, O_DIRECT
reads, mtimes set through the mount, and writes through a file:// mount.
Real mounts, real SeaweedFS (or a real directory for file://)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: Path, new: Path, flags: int) -> None:
    """rename(2) with flags (Python has no renameat2)."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(new))


def flush(m) -> None:  # type: ignore[no-untyped-def]
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)
    assert res.returncode == 0, res.stderr


def obj(s3: SeaweedServer, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def test_rename_noreplace_and_exchange(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    (mp / "a.txt").write_bytes(b"a")
    (mp / "b.txt").write_bytes(b"b")
    with pytest.raises(OSError) as exc:
        renameat2(mp / "a.txt", mp / "b.txt", RENAME_NOREPLACE)
    assert exc.value.errno == errno.EEXIST
    assert (mp / "a.txt").read_bytes() == b"a" and (mp / "b.txt").read_bytes() == b"b"
    renameat2(mp / "a.txt", mp / "c.txt", RENAME_NOREPLACE)  # a free name: an ordinary rename
    assert sorted(os.listdir(mp)) == ["b.txt", "c.txt"]
    # An atomic swap cannot be made of S3 copies: refused, both files untouched.
    with pytest.raises(OSError) as exc:
        renameat2(mp / "b.txt", mp / "c.txt", RENAME_EXCHANGE)
    assert exc.value.errno == errno.EINVAL
    assert (mp / "b.txt").read_bytes() == b"b" and (mp / "c.txt").read_bytes() == b"a"
    flush(m)
    assert obj(s3_server, bucket, "c.txt") == b"a" and obj(s3_server, bucket, "b.txt") == b"b"


def test_o_direct_reads_of_cold_and_cached_bytes(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """Fast loaders (and GDS compat mode) read with O_DIRECT and 4 KiB-aligned I/O."""
    data = os.urandom(8 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="shards/x.tar", Body=data)
    m = mount_factory(f"s3://{bucket}")
    buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
    for _ in range(2):  # first from the store, then from tier 1
        fd = os.open(m.mountpoint / "shards/x.tar", os.O_RDONLY | os.O_DIRECT)
        try:
            h = hashlib.sha256()
            for off in (0, 4096, 3 * MiB + 8192, 7 * MiB):
                n = os.preadv(fd, [buf], off)
                assert n == min(MiB, len(data) - off)
                assert buf[:n] == data[off : off + n]
            while (n := os.readv(fd, [buf])) > 0:  # sequential (preadv moved no offset)
                h.update(buf[:n])
        finally:
            os.close(fd)
        assert h.digest() == hashlib.sha256(data).digest()
    assert m.metric("tierfs_store_bytes_total{op=get}") <= 1.1 * len(data)


def test_mtime_set_through_the_mount_is_stored_with_the_object(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    path = m.mountpoint / "ckpt/model.pt"
    path.parent.mkdir()
    when = 1_600_000_000.25
    with open(path, "wb") as f:
        f.write(b"w" * 4096)
        f.flush()  # the write first (a write after it would set the mtime again)
        os.utime(f.fileno(), (when, when))  # then the mtime, before the close that uploads it
    assert os.stat(path).st_mtime == pytest.approx(when, abs=1e-3)
    flush(m)
    head = s3_server.client().head_object(Bucket=bucket, Key="ckpt/model.pt")
    assert float(head["Metadata"]["mtime"]) == pytest.approx(when, abs=1e-6)  # s3fs's name


def test_writes_through_a_file_source(mount_factory: MountFactory, tmp_path: Path) -> None:
    """A shared directory as the store: write-back, write-through and publishing
    all land as plain files, renames and deletes too."""
    root = tmp_path / "shared"
    root.mkdir()
    (root / "old.txt").write_bytes(b"old")
    m = mount_factory(f"file://{root}")
    mp = m.mountpoint
    ckpt = os.urandom(3 * MiB + 17)
    (mp / "run/step-1").mkdir(parents=True)
    (mp / "run/step-1/model.pt").write_bytes(ckpt)  # write-back
    (mp / "notes.txt").write_bytes(b"notes")  # write-through
    (mp / "run/step-1/latest.tmp").write_bytes(b"step-1")
    os.replace(mp / "run/step-1/latest.tmp", mp / "run/latest")  # published after its barrier
    os.rename(mp / "old.txt", mp / "renamed.txt")
    os.unlink(mp / "notes.txt")
    flush(m)
    assert (root / "run/step-1/model.pt").read_bytes() == ckpt
    assert (root / "run/latest").read_bytes() == b"step-1"
    assert (root / "renamed.txt").read_bytes() == b"old"
    assert not (root / "old.txt").exists() and not (root / "notes.txt").exists()
    assert not (root / "run/step-1/latest.tmp").exists()
    with open(mp / "renamed.txt", "r+b") as f:  # rewrite in place
        f.seek(1)
        f.write(b"X")
    flush(m)
    assert (root / "renamed.txt").read_bytes() == b"oXd"


def test_fstat_after_unlink_shows_no_links(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    cfg = tmp_path / "ttl0.toml"  # every fstat asks the daemon, not the kernel's cache
    cfg.write_text("[classes.default]\nattr_ttl = 0\n")
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    for name, flush_first in (("pending.bin", False), ("stored.bin", True)):
        p = m.mountpoint / name
        p.write_bytes(b"x" * 100)
        if flush_first:
            assert run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120).returncode == 0
        with open(p, "rb") as f:
            assert os.fstat(f.fileno()).st_nlink == 1
            os.unlink(p)
            assert os.fstat(f.fileno()).st_nlink == 0
            assert f.read() == b"x" * 100


def test_a_directory_renamed_unlooked_keeps_its_files_times_across_a_remount(
    mount_factory: MountFactory, bucket: str
) -> None:
    """A directory rename copies every object below it; the files this mount never
    looked up since its start keep the times stored with them (a listing shows a
    small plain object with the defaults: the store's time of the copy)."""
    m = mount_factory(f"s3://{bucket}")
    (m.mountpoint / "x/y").mkdir(parents=True)
    f = m.mountpoint / "x/y/f"
    f.write_bytes(b"small")
    os.utime(f, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    flush(m)
    m.umount()
    m = mount_factory(f"s3://{bucket}", cache_dir=m.cache_dir)
    os.rename(m.mountpoint / "x", m.mountpoint / "z")  # y and f: never looked up here
    flush(m)
    m.umount()
    m = mount_factory(f"s3://{bucket}", cache_dir=m.cache_dir)
    st = os.stat(m.mountpoint / "z/y/f")
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_600_000_000_123_456_789, 1_500_000_000_987_654_321)
    assert (m.mountpoint / "z/y/f").read_bytes() == b"small"


def test_another_node_learns_an_empty_files_times_at_its_first_open(
    mount_factory: MountFactory, bucket: str
) -> None:
    """Another node learns a plain file's attributes from its first GET's headers;
    an empty file's read fetches nothing, so its first open asks by HEAD."""
    writer = mount_factory(f"s3://{bucket}")
    f = writer.mountpoint / "empty"
    f.touch()
    os.utime(f, ns=(1_600_000_000_000_000_001, 1_500_000_000_000_000_001))
    flush(writer)
    reader = mount_factory(f"s3://{bucket}")  # an empty cache of its own
    assert os.stat(reader.mountpoint / "empty").st_size == 0
    assert (reader.mountpoint / "empty").read_bytes() == b""
    st = os.stat(reader.mountpoint / "empty")
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_600_000_000_000_000_001, 1_500_000_000_000_000_001)


def _errno(call: Callable[..., object], *args: object) -> int | None:
    try:
        call(*args)
    except OSError as e:
        return e.errno
    return None


def _create(path: Path, flags: int = 0) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | flags))


def make_one_of_each(root: Path) -> dict[str, Path]:
    """Each kind of node, alone in a directory of its own."""
    made = {}
    for kind in ("file", "fifo", "symlink", "chr", "blk", "dir"):
        (root / f"holds-{kind}").mkdir(parents=True)
        p = made[kind] = root / f"holds-{kind}" / kind
        if kind == "file":
            p.write_bytes(b"f")
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "symlink":
            os.symlink("../holds-file/file", p)
        elif kind == "dir":
            p.mkdir()
        else:
            os.mknod(p, (stat.S_IFCHR if kind == "chr" else stat.S_IFBLK) | 0o600,
                     os.makedev(1, 3))
    return made


def errnos_of_existing_names(made: dict[str, Path]) -> dict[str, list[int | None]]:
    """What pjdfstest asks of an existing name: a path below it, O_CREAT|O_EXCL,
    symlink and mkdir onto it, rmdir of its directory."""
    out = {}
    for kind, p in made.items():
        below = [] if kind == "dir" else [
            _errno(_create, p / "x"), _errno(os.mkdir, p / "x"),
            _errno(os.symlink, "t", p / "x"), _errno(os.mkfifo, p / "x")]
        out[kind] = [*below, _errno(_create, p, os.O_EXCL), _errno(os.symlink, "t", p),
                     _errno(os.mkdir, p), _errno(os.rmdir, p.parent)]
    return out


@needs_root  # mknod of devices
def test_errnos_on_existing_names_of_every_kind_here_and_on_a_new_node(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    """The errno cases pjdfstest found wrong (issue 36: cascades of a refused
    mknod b/c): below a non-directory ENOTDIR, O_CREAT|O_EXCL, symlink and mkdir
    onto an existing name EEXIST, rmdir of a directory holding it ENOTEMPTY; for
    each kind of node, on the mount that made it and on a new node. A refused
    link(2) leaves nothing behind: its name is free, on either node."""
    m = mount_factory(f"s3://{bucket}")
    made = make_one_of_each(m.mountpoint / "t")
    with pytest.raises(PermissionError):
        os.link(made["file"], m.mountpoint / "t/hard")
    assert _errno(os.lstat, m.mountpoint / "t/hard") == errno.ENOENT
    assert os.lstat(made["file"]).st_nlink == 1
    below = [errno.ENOTDIR] * 4
    want = {kind: [*([] if kind == "dir" else below), errno.EEXIST, errno.EEXIST,
                   errno.EEXIST, errno.ENOTEMPTY] for kind in made}
    assert errnos_of_existing_names(made) == want
    assert m.umount().returncode == 0
    fresh = mount_factory(f"s3://{bucket}", cache_dir=tmp_path / "new-node")
    made = {kind: fresh.mountpoint / p.relative_to(m.mountpoint) for kind, p in made.items()}
    assert {k: stat.S_IFMT(os.lstat(p).st_mode) for k, p in made.items()} == {
        "file": stat.S_IFREG, "fifo": stat.S_IFIFO, "symlink": stat.S_IFLNK,
        "chr": stat.S_IFCHR, "blk": stat.S_IFBLK, "dir": stat.S_IFDIR}
    assert errnos_of_existing_names(made) == want
    assert _errno(os.lstat, fresh.mountpoint / "t/hard") == errno.ENOENT
    (fresh.mountpoint / "t/hard").write_bytes(b"a name of its own")
    assert (fresh.mountpoint / "t/hard").read_bytes() == b"a name of its own"
