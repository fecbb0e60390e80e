"""FUSE passthrough through the patched pyfuse3 (third_party/), on a real mount.

A minimal filesystem serves one file, `data`, from a backing file and counts
the requests it sees; it runs in a thread of this process, so every access
that holds the GIL while the kernel may call the daemon (an mmap fault) runs
in a subprocess instead. Needs root (CAP_SYS_ADMIN to register backing files),
Linux >= 6.9 and the passthrough build; skipped with the probe's reason
otherwise.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyfuse3
import pytest
import trio

from tests.support.mount import is_mounted
from tierfs.fuse import passthrough
from tierfs.fuse.passthrough import InodeBackings

MiB = 1 << 20
INODE = 2
MODE = passthrough.probe(Path(tempfile.gettempdir()))
pytestmark = pytest.mark.skipif(not MODE.enabled, reason=f"FUSE passthrough off: {MODE.reason}")


class OneFile(pyfuse3.Operations):
    """`data` (inode 2) served from `backing`; each open takes the mode in `want`:
    passthrough or daemon through InodeBackings, or `raw`: a fresh backing id
    per open, bypassing InodeBackings (to show what it prevents)."""

    enable_passthrough = True

    def __init__(self, backing: Path) -> None:
        super().__init__()
        self.backing = backing
        self.want = "passthrough"
        self.getxattr_errno = errno.ENOSYS
        self.counts: collections.Counter[str] = collections.Counter()
        self.table = InodeBackings()
        self.raw_ids: dict[int, int] = {}
        self.registered: list[int] = []

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        st = os.stat(self.backing if inode == INODE else self.backing.parent)
        a.st_mode, a.st_size, a.st_nlink = st.st_mode, st.st_size, st.st_nlink
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = st.st_mtime_ns
        a.st_ino = inode
        a.attr_timeout = a.entry_timeout = 0
        return a

    async def lookup(self, parent, name, ctx):
        if parent != pyfuse3.ROOT_INODE or name != b"data":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(INODE)

    async def getattr(self, inode, ctx):
        return self._attr(inode)

    async def getxattr(self, inode, name, ctx):
        self.counts["getxattr"] += 1
        raise pyfuse3.FUSEError(self.getxattr_errno)

    async def open(self, inode, flags, ctx):
        self.counts["open"] += 1
        fd = os.open(self.backing, os.O_RDWR | os.O_CLOEXEC)
        try:
            if self.want == "raw":
                backing_id = self.raw_ids[fd] = passthrough.register(fd)
            else:
                backing_id = self.table.acquire(inode, fd if self.want == "passthrough" else None)
        except OSError as exc:
            os.close(fd)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        self.registered.append(backing_id)
        return pyfuse3.FileInfo(fh=fd, backing_id=backing_id)  # keep_cache: default

    async def read(self, fh, off, size):
        self.counts["read"] += 1
        return os.pread(fh, size, off)

    async def write(self, fh, off, buf):
        self.counts["write"] += 1
        return os.pwrite(fh, buf, off)

    async def flush(self, fh):
        self.counts["flush"] += 1

    async def fsync(self, fh, datasync):
        self.counts["fsync"] += 1
        os.fsync(fh)  # passthrough writes went to the backing file: the daemon syncs it

    async def release(self, fh):
        self.counts["release"] += 1
        if fh in self.raw_ids:
            passthrough.unregister(self.raw_ids.pop(fh))
        else:
            self.table.release(INODE)
        os.close(fh)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:  # hang guard
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Served:
    """`ops` mounted at `mnt`, its pyfuse3 main loop on a thread."""

    def __init__(self, ops: OneFile, mnt: Path) -> None:
        self.ops, self.mnt, self.file = ops, mnt, mnt / "data"
        pyfuse3.init(ops, str(mnt), {"fsname=tierfs-passthrough-test", "default_permissions"})
        self.thread = threading.Thread(target=self._run, name="fuse", daemon=True)
        self.thread.start()
        os.stat(mnt)  # answered once INIT is done

    def _run(self) -> None:
        try:
            trio.run(pyfuse3.main)
        finally:
            pyfuse3.close(unmount=False)

    def unmount(self) -> None:
        for args in (["fusermount3", "-u"], ["fusermount3", "-uz"]):
            if not is_mounted(self.mnt):
                break
            subprocess.run([*args, str(self.mnt)], capture_output=True, timeout=30, check=False)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "pyfuse3.main did not end after the unmount"

    def released(self) -> None:
        """Wait until every handle's RELEASE (sent after close(2) returns) was served."""
        wait_for(lambda: self.ops.counts["release"] >= self.ops.counts["open"], "RELEASE")


@pytest.fixture
def content() -> bytes:
    return random.Random(19).randbytes(8 * MiB + 4321)


@pytest.fixture
def served(tmp_path: Path, content: bytes) -> Iterator[Served]:
    backing = tmp_path / "cache" / "backing"
    backing.parent.mkdir()
    backing.write_bytes(content)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    s = Served(OneFile(backing), mnt)
    try:
        yield s
    finally:
        s.unmount()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mmap_sha(path: Path) -> str:
    """sha256 of the file read through mmap, in a subprocess (an in-process
    fault served by this process's daemon thread would wait for the GIL)."""
    code = ("import hashlib, mmap, sys\n"
            "with open(sys.argv[1], 'rb') as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:\n"
            "    print(hashlib.sha256(m).hexdigest())\n")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         timeout=120, check=True)
    return res.stdout.strip()


def test_the_probe_confirms_after_init(served: Served) -> None:
    assert pyfuse3.passthrough_granted()
    mode = passthrough.confirm(MODE, served.ops.backing.parent)
    assert mode.enabled, mode.reason


def test_kernel_serves_reads_and_mmap_without_the_daemon(served: Served, content: bytes) -> None:
    with open(served.file, "rb", buffering=0) as f:
        assert sha(f.read()) == sha(content)
        rng = random.Random(1)
        for _ in range(200):
            off = rng.randrange(len(content))
            assert os.pread(f.fileno(), 4096, off) == content[off:off + 4096]
    assert mmap_sha(served.file) == sha(content)
    served.released()
    c = served.ops.counts
    assert c["open"] == 2 and all(i > 0 for i in served.ops.registered)
    assert c["read"] == 0, f"the daemon saw {c['read']} READ requests"
    assert served.ops.table.mode(INODE) is None  # the last release dropped the id


def test_the_daemon_path_does_see_reads(served: Served, content: bytes) -> None:
    """The control for the test above: the same reads without passthrough reach the daemon."""
    served.ops.want = "daemon"
    with open(served.file, "rb", buffering=0) as f:
        assert sha(f.read()) == sha(content)
    assert served.ops.counts["read"] > 0 and served.ops.registered == [0]


def test_writes_land_in_the_backing_file(served: Served, content: bytes) -> None:
    patch = random.Random(2).randbytes(3 * MiB)
    fd = os.open(served.file, os.O_RDWR)
    try:
        assert os.pwrite(fd, patch, 1 * MiB) == len(patch)
        assert os.pwrite(fd, b"tail", len(content)) == 4  # grows the file
        os.fsync(fd)
        assert os.fstat(fd).st_size == len(content) + 4
    finally:
        os.close(fd)
    served.released()
    want = content[:MiB] + patch + content[4 * MiB:] + b"tail"
    assert sha(served.ops.backing.read_bytes()) == sha(want)
    assert served.ops.counts["write"] == 0 and served.ops.counts["fsync"] == 1


@pytest.mark.parametrize("answer", [errno.ENOSYS, errno.ENODATA])
def test_getxattr_enosys_keeps_writes_off_the_daemon(served: Served, answer: int) -> None:
    """A getxattr answer other than ENOSYS costs a GETXATTR(security.capability)
    per write(2): the kernel asks before every write whether to drop privileges."""
    served.ops.getxattr_errno = answer
    fd = os.open(served.file, os.O_WRONLY)
    try:
        for i in range(100):
            os.pwrite(fd, b"x" * 4096, i * 4096)
    finally:
        os.close(fd)
    served.released()
    seen = served.ops.counts["getxattr"]
    if answer == errno.ENOSYS:
        assert seen <= 1, f"{seen} GETXATTR requests for 100 writes"
    else:
        assert seen >= 100, f"expected one GETXATTR per write, saw {seen}"
    assert served.ops.counts["write"] == 0


def test_mixed_modes_fail_with_eio_unless_the_inode_keeps_its_mode(
    served: Served, content: bytes
) -> None:
    ops = served.ops
    ops.want = "daemon"
    first = os.open(served.file, os.O_RDONLY)
    try:
        # What InodeBackings prevents: a passthrough open beside a daemon-path one.
        ops.want = "raw"
        with pytest.raises(OSError) as exc:
            os.open(served.file, os.O_RDONLY)
        assert exc.value.errno == errno.EIO
        # Through InodeBackings the passthrough request joins the inode's mode.
        ops.want = "passthrough"
        second = os.open(served.file, os.O_RDONLY)
        try:
            assert os.pread(second, 4096, 0) == content[:4096]
        finally:
            os.close(second)
    finally:
        os.close(first)
    assert ops.registered[-1] == 0  # the joined open was served on the daemon path
    served.released()
    # Once every handle is released the inode may switch: two concurrent
    # passthrough opens now share one backing id.
    ops.registered.clear()
    a, b = os.open(served.file, os.O_RDONLY), os.open(served.file, os.O_RDONLY)
    try:
        assert os.pread(b, 4096, 4096) == content[4096:8192]
    finally:
        os.close(a)
        os.close(b)
    assert len(ops.registered) == 2 and ops.registered[0] == ops.registered[1] > 0


def test_the_probe_refuses_a_cache_dir_on_overlayfs(served: Served, tmp_path: Path) -> None:
    """A backing file on a stacked filesystem is refused by the kernel (ELOOP):
    the probe says so before mounting, and confirm() after."""
    dirs = {n: tmp_path / n for n in ("lower", "upper", "work", "ovl")}
    for d in dirs.values():
        d.mkdir()
    opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    res = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["ovl"])],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount overlayfs here: {res.stderr.strip()}")
    try:
        mode = passthrough.probe(dirs["ovl"])
        assert not mode.enabled and "overlay" in mode.reason
        # The kernel's own verdict, asked on the live connection.
        confirmed = passthrough.confirm(passthrough.Mode(True, "static checks passed"), dirs["ovl"])
        assert not confirmed.enabled and "stacked" in confirmed.reason
    finally:
        subprocess.run(["umount", str(dirs["ovl"])], check=False)
