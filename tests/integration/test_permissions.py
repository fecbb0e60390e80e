"""POSIX permissions for other users of an --allow-other mount (the kernel checks
them: default_permissions), kept across a remount, and a mount that is always
nosuid,nodev: whoever can write the bucket writes the modes, so a setuid-root
mode in an object must never run as root. Run as root; the other users are
uid 1000 and uid 65534 (setpriv), real processes on a real mount."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.seaweed import SeaweedServer

pytestmark = needs_root


def as_user(uid: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def refused(res: subprocess.CompletedProcess[str], why: str) -> bool:
    return res.returncode != 0 and why in res.stderr


def mount_options(mountpoint: Path) -> set[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == os.path.realpath(mountpoint):
                return set(parts[3].split(","))
    raise AssertionError(f"{mountpoint} not mounted")


def test_private_file_is_private_and_stays_so_after_a_remount(
    open_dir: Path, mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", "--allow-other", cache_dir=cache,
                      mountpoint=open_dir / "mnt")
    secret = m.mountpoint / "secret.txt"
    fd = os.open(secret, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"root only")
    os.close(fd)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_uid == 0
    assert refused(as_user(65534, "cat", str(secret)), "Permission denied")
    assert refused(as_user(65534, "sh", "-c", f"echo x >> {secret}"), "Permission denied")
    m.umount()
    m = mount_factory(f"s3://{bucket}", "--allow-other", cache_dir=cache, mountpoint=m.mountpoint)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert refused(as_user(65534, "cat", str(secret)), "Permission denied")
    assert secret.read_bytes() == b"root only"


def test_private_directory_cannot_be_entered(
    open_dir: Path, mount_factory: MountFactory, bucket: str) -> None:
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=open_dir / "mnt")
    priv = m.mountpoint / "priv"
    priv.mkdir(mode=0o700)
    (priv / "f.txt").write_text("x")
    assert refused(as_user(65534, "ls", str(priv)), "Permission denied")
    assert refused(as_user(65534, "stat", str(priv / "f.txt")), "Permission denied")
    os.chmod(priv, 0o755)  # opened up again: the kernel sees the new mode at once
    assert as_user(65534, "cat", str(priv / "f.txt")).stdout == "x"


def test_sticky_directory_protects_other_users_files(
    open_dir: Path, mount_factory: MountFactory, bucket: str
) -> None:
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=open_dir / "mnt")
    shared = m.mountpoint / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert as_user(1000, "sh", "-c", f"echo mine > {shared}/a.txt").returncode == 0
    assert (shared / "a.txt").stat().st_uid == 1000
    assert refused(as_user(65534, "rm", "-f", str(shared / "a.txt")), "Operation not permitted")
    assert refused(as_user(65534, "mv", str(shared / "a.txt"), str(shared / "b.txt")),
                   "Operation not permitted")
    assert (shared / "a.txt").read_text() == "mine\n"
    # their own files they may remove; the owner removes hers
    assert as_user(65534, "sh", "-c", f"echo x > {shared}/n.txt && rm {shared}/n.txt").returncode == 0
    assert as_user(1000, "rm", str(shared / "a.txt")).returncode == 0
    assert os.listdir(shared) == []


def test_chmod_and_chown_by_others_are_refused(
    open_dir: Path, mount_factory: MountFactory, bucket: str) -> None:
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=open_dir / "mnt")
    f = m.mountpoint / "root.txt"
    f.write_text("r")
    assert refused(as_user(65534, "chmod", "777", str(f)), "Operation not permitted")
    assert refused(as_user(65534, "chown", "65534", str(f)), "Operation not permitted")
    assert stat.S_IMODE(f.stat().st_mode) == 0o644 and f.stat().st_uid == 0
    # the owner may chmod, and chgrp to a group she is in, but not give the file away
    os.chown(f, 65534, 65534)
    assert as_user(65534, "chmod", "600", str(f)).returncode == 0
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert refused(as_user(65534, "chown", "1000", str(f)), "Operation not permitted")
    assert refused(as_user(65534, "chgrp", "0", str(f)), "Operation not permitted")
    # root may do all of it
    os.chown(f, 1000, 0)
    os.chmod(f, 0o640)
    assert (f.stat().st_uid, f.stat().st_gid, stat.S_IMODE(f.stat().st_mode)) == (1000, 0, 0o640)


def test_always_nosuid_nodev_and_a_setuid_root_object_runs_as_its_caller(
    open_dir: Path, mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    # An object written by anyone with bucket access claiming setuid root.
    id_bin = Path(shutil.which("id") or "/usr/bin/id").read_bytes()
    s3_server.client().put_object(Bucket=bucket, Key="evil-id", Body=id_bin,
                                  Metadata={"mode": str(stat.S_IFREG | 0o4755), "uid": "0",
                                            "gid": "0"})
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=open_dir / "mnt")
    assert {"nosuid", "nodev", "allow_other", "default_permissions"} <= mount_options(m.mountpoint)
    mine = m.mountpoint / "my-id"
    mine.write_bytes(id_bin)
    os.chmod(mine, 0o4755)  # root's own setuid-root binary, made through the mount
    # The stored mode is learned at the first read of an object this node has no
    # attributes of (README, POSIX): read it once, then run it as another user.
    assert (m.mountpoint / "evil-id").read_bytes() == id_bin
    for exe in (mine, m.mountpoint / "evil-id"):
        st = exe.stat()
        assert st.st_mode & stat.S_ISUID and st.st_uid == 0
        res = as_user(65534, str(exe), "-u")
        assert res.returncode == 0 and res.stdout.strip() == "65534", (exe, res)
    # a device node is made (stored like a FIFO: an empty object typed by its
    # metadata, with its number), but nodev: the kernel opens none of them
    sh_ok = subprocess.run(["mknod", str(m.mountpoint / "null"), "c", "1", "3"],
                           capture_output=True, text=True, timeout=30)
    assert sh_ok.returncode == 0, sh_ok.stderr
    st = (m.mountpoint / "null").stat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    with pytest.raises(PermissionError):
        (m.mountpoint / "null").open("rb")


def test_objects_without_attributes_take_the_mount_defaults(
    open_dir: Path, mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    c = s3_server.client()
    c.put_object(Bucket=bucket, Key="plain/data.bin", Body=b"d" * 10_000)
    c.put_object(Bucket=bucket, Key="plain/sub/x.bin", Body=b"x" * 10_000)
    m = mount_factory(f"s3://{bucket}", "--allow-other", "--uid", "1234", "--gid", "5678",
                      "--file-mode", "0640", "--dir-mode", "0750", mountpoint=open_dir / "mnt")
    f, d = m.mountpoint / "plain/data.bin", m.mountpoint / "plain/sub"
    assert (f.stat().st_uid, f.stat().st_gid, stat.S_IMODE(f.stat().st_mode)) == (1234, 5678, 0o640)
    assert (d.stat().st_uid, d.stat().st_gid, stat.S_IMODE(d.stat().st_mode)) == (1234, 5678, 0o750)
    assert refused(as_user(65534, "cat", str(f)), "Permission denied")
    assert as_user(1234, "cat", str(f)).stdout == "d" * 10_000
