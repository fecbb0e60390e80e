"""pyfuse3.Operations: translates FUSE calls and errnos, holds no policy of its own.

Reads go to a handle from the read path (read/handles.py), writes to a write
session (writeback/session.py), namespace changes to tree.py. Every handler
is wrapped so that a failure becomes an errno for the caller and a log line,
never an exception escaping into pyfuse3.main (which would leave a dead mount
behind).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyfuse3

from tierfs.config import LOG_EVERY
from tierfs.fuse.fs_attrs import caller, entry_attributes, setattr_change
from tierfs.fuse.modes import Opened, OpenModes
from tierfs.fuse.passthrough import file_info
from tierfs.fuse.tree import AttrChange, TreeChanges
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace, Node
from tierfs.read.handles import ReadHandle, ReadPath
from tierfs.read.served import FileRange
from tierfs.store.base import StoreError
from tierfs.workers import Workers
from tierfs.writeback.core import WriteBack
from tierfs.writeback.session import WriteSession

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
QUIET_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY)  # not worth a log line


def fuse_errors(fn: F) -> F:
    """Map every failure of a handler to FUSEError; log the unexpected ones."""

    @functools.wraps(fn)
    async def wrapper(self: TierFS, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except StoreError as exc:
            self.metrics.error(exc.kind)
            self.log_limited(exc.kind, "%s: store error: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            if exc.errno not in QUIET_ERRNOS:
                kind = errno.errorcode.get(exc.errno or errno.EIO, "io").lower()
                self.metrics.error(kind)
                self.log_limited(kind, "%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            self.metrics.error("internal")
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def _name(name: bytes) -> str:
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise pyfuse3.FUSEError(errno.EINVAL) from None


class TierFS(pyfuse3.Operations):
    # The kernel's write-back cache unless passthrough is on (DESIGN §9). getxattr stays
    # unimplemented (ENOSYS): any answer costs each passthrough write(2) a GETXATTR.

    def __init__(self, namespace: Namespace, reads: ReadPath, writeback: WriteBack,
                 tree: TreeChanges, metrics: Metrics, workers: Workers, cache_root: Path,
                 modes: OpenModes) -> None:
        super().__init__()
        self.ns = namespace
        self.reads = reads
        self.wb = writeback
        self.tree = tree
        self.metrics = metrics
        self.workers = workers
        self.cache_root = cache_root
        self.modes = modes
        self.enable_passthrough, self.enable_writeback_cache = modes.mode.enabled, not modes.mode.enabled
        self.enable_splice_write = reads.reader.lend  # FileSlice replies (fuse/splice.py)
        self._handles: dict[int, ReadHandle | WriteSession] = {}
        self._dirs: dict[int, list[tuple[str, Node]]] = {}
        self._fhs = itertools.count(1)
        self._logged: dict[str, tuple[float, int]] = {}

    def attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        return entry_attributes(self.ns, node)

    # -- names and attributes -----------------------------------------------------------

    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self.metrics.meta_op("lookup")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        if text == ".":
            return self.attrs(self.ns.get(parent_inode))
        return self.attrs(await self.ns.lookup(parent_inode, text))

    @fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self.metrics.meta_op("getattr")
        return self.attrs(await self.ns.getattr(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.ns.forget(inode_list)

    @fuse_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.ns.getattr(inode)
        if fields.update_size:
            h = self._handles.get(fh) if fh is not None else None
            if isinstance(h, WriteSession):
                await h.truncate(attr.st_size)
            else:
                await self.tree.truncate(node, attr.st_size)
        change = setattr_change(attr, fields)
        if change != AttrChange() or not fields.update_size:  # chown(-1, -1) moves the ctime
            await self.tree.set_attrs(node, change)
        return self.attrs(self.ns.get(inode))

    # -- directories -------------------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.metrics.meta_op("readdir")
        fh = next(self._fhs)
        self._dirs[fh] = await self.ns.readdir(inode)
        return fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            if not pyfuse3.readdir_reply(token, name.encode("utf-8"), self.attrs(node), i + 1):
                return
            node.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @fuse_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.tree.mkdir(parent_inode, _name(name), mode, caller(ctx))
        self.metrics.meta_op("mkdir")
        return self.attrs(node)

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.tree.rmdir(parent_inode, _name(name))
        self.metrics.meta_op("rmdir")

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.tree.unlink(parent_inode, _name(name))
        self.metrics.meta_op("unlink")

    @fuse_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        await self.tree.rename(parent_inode_old, _name(name_old), parent_inode_new,
                               _name(name_new), flags)
        self.metrics.meta_op("rename")

    @fuse_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.tree.symlink(parent_inode, _name(name),
                                       target.decode("utf-8", "surrogateescape"), caller(ctx))
        self.metrics.meta_op("symlink")
        return self.attrs(node)

    @fuse_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        target = await self.tree.readlink(self.ns.get(inode))
        return target.encode("utf-8", "surrogateescape")

    @fuse_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)  # no plain-object form of a hard link (README)

    @fuse_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.tree.mknod(parent_inode, _name(name), mode, rdev, caller(ctx))
        self.metrics.meta_op("mknod")
        return self.attrs(node)

    # -- files -------------------------------------------------------------------------

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.ns.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        await self.ns.opening(node)
        h: ReadHandle | WriteSession
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            h, opened = await self.modes.writable(node.inode, functools.partial(
                self.wb.open, node.path, node.etag, node.size, node.mtime, flags=flags,
                inode=node.inode, attrs=node.attrs),
                writeback=node.settings.write_mode == "writeback")
        else:
            h = await self.reads.open(node.path, node.etag, node.size, node.mtime, node.settings)
            opened = self.modes.open_read(inode, h.entry, h.settings)
        self.metrics.meta_op("open")
        return self._info(h, opened)

    @fuse_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node, h = await self.tree.create(parent_inode, _name(name), flags, mode, caller(ctx))
        self.metrics.meta_op("create")
        return self._info(h, await self.modes.created(node.inode, h)), self.attrs(node)

    @fuse_errors  # pyfuse3 replies with any buffer (a view of a pooled one), not only bytes
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview | pyfuse3.FileSlice:  # type: ignore[override]
        data = await self._handles[fh].read(off, size)
        if isinstance(data, FileRange):  # lent only where libfuse takes them (fuse/splice.py)
            return pyfuse3.FileSlice(data.fd, data.offset, data.length, data.done)
        return data

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles[fh]
        if not isinstance(h, WriteSession):
            raise pyfuse3.FUSEError(errno.EBADF)
        self.metrics.meta_op("write")  # none for a file the kernel writes (passthrough)
        return await h.write(off, buf)

    @fuse_errors
    async def flush(self, fh: int) -> None:
        self.metrics.meta_op("flush")
        h = self._handles.get(fh)
        if h is not None:
            await h.flush()

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handles.get(fh)
        if h is not None:
            await h.fsync()

    @fuse_errors
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        self.modes.release(fh)
        if h is not None:
            await h.release()

    # -- filesystem ----------------------------------------------------------------------

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = await self.workers.disk(os.statvfs, self.cache_root)
        out = pyfuse3.StatvfsData()
        out.f_bsize, out.f_frsize = st.f_bsize, st.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        out.f_files, out.f_ffree, out.f_favail = st.f_files, st.f_ffree, st.f_favail
        out.f_namemax = 255
        return out

    def log_limited(self, kind: str, fmt: str, *args: object) -> None:
        """One line per error kind per LOG_EVERY seconds: an outage must not flood the log."""
        now = time.monotonic()
        last, suppressed = self._logged.get(kind, (-LOG_EVERY, 0))
        if now - last < LOG_EVERY:
            self._logged[kind] = (last, suppressed + 1)
            return
        more = f" ({suppressed} more like it suppressed)" if suppressed else ""
        log.warning(fmt + more, *args)
        self._logged[kind] = (now, 0)

    def _info(self, h: ReadHandle | WriteSession, opened: Opened) -> pyfuse3.FileInfo:
        fh = next(self._fhs)
        self._handles[fh] = h
        backing_id = self.modes.bind(fh, opened)  # passthrough wins over direct_io in the kernel
        return file_info(fh, h.keep_cache, h.direct and not backing_id, backing_id,
                         noflush=not h.flushes)
