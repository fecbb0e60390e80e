"""Minimal pyfuse3 passthrough of a local directory: the warm-read and write reference.

Usage: passthrough.py [--rw] SRC MOUNTPOINT   (unmount with fusermount3 -u)
Same kernel settings as tierfs (1 MiB reads via bdi read_ahead_kb, keep_cache;
with --rw the kernel's write-back cache, as tierfs), reads and writes served with
os.pread/os.pwrite on the trio loop: the ceiling of a Python FUSE daemon.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pyfuse3
import trio

from tierfs.kernel import set_kernel_readahead


class Passthrough(pyfuse3.Operations):
    def __init__(self, src: str, rw: bool) -> None:
        super().__init__()
        self.paths = {pyfuse3.ROOT_INODE: src}
        self.fds: dict[int, int] = {}
        self.enable_writeback_cache = rw

    def _attr(self, path: str) -> pyfuse3.EntryAttributes:
        st = os.lstat(path)
        a = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                     "st_mtime_ns", "st_ctime_ns"):
            setattr(a, name, getattr(st, name))
        a.st_ino = st.st_ino
        self.paths[st.st_ino] = path
        a.st_blksize, a.st_blocks = 1 << 20, st.st_blocks
        a.attr_timeout = a.entry_timeout = 300
        return a

    async def lookup(self, parent, name, ctx):
        try:
            return self._attr(os.path.join(self.paths[parent], os.fsdecode(name)))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    async def getattr(self, inode, ctx):
        a = self._attr(self.paths[inode])
        if inode == pyfuse3.ROOT_INODE:
            a.st_ino = inode
        return a

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        names = sorted(os.listdir(self.paths[fh]))
        for i, name in enumerate(names[start_id:], start_id):
            attr = self._attr(os.path.join(self.paths[fh], name))
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, i + 1):
                break

    async def open(self, inode, flags, ctx):
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
        fd = os.open(self.paths[inode], (os.O_RDWR | (flags & os.O_TRUNC)) if writing else os.O_RDONLY)
        self.fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    async def read(self, fh, off, size):
        return os.pread(fh, size, off)

    async def create(self, parent, name, mode, flags, ctx):
        path = os.path.join(self.paths[parent], os.fsdecode(name))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode & 0o777)
        attr = self._attr(path)
        self.fds[fd] = attr.st_ino
        return pyfuse3.FileInfo(fh=fd, keep_cache=True), attr

    async def write(self, fh, off, buf):
        return os.pwrite(fh, buf, off)

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        os.fsync(fh)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self.paths[inode]
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_mtime:
            os.utime(path, ns=(attr.st_mtime_ns, attr.st_mtime_ns))
        return await self.getattr(inode, ctx)

    async def release(self, fh):
        self.fds.pop(fh, None)
        os.close(fh)


def main() -> None:
    rw = sys.argv[1] == "--rw"
    src, mp = sys.argv[1 + rw], sys.argv[2 + rw]
    options = {"fsname=passthrough", "default_permissions"} | (set() if rw else {"ro"})
    pyfuse3.init(Passthrough(os.path.abspath(src), rw), mp, options)

    async def run() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(pyfuse3.main)
            # Its stat of the mountpoint is answered by pyfuse3.main, hence a thread.
            await trio.to_thread.run_sync(set_kernel_readahead, Path(mp), 1024)

    try:
        trio.run(run)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
