"""pyfuse3.Operations: translates FUSE calls, holds no policy of its own.

Every handler is wrapped so that a failure becomes an errno for the caller
and a log line, never an exception escaping into pyfuse3.main (which would
leave a dead mount behind).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio

from tierfs.cache import Cache, Entry
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace, Node
from tierfs.policy import glob_to_regex
from tierfs.reader import Reader, ReadState
from tierfs.store.base import StoreError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
CONTROL_XATTR = b"user.tierfs.control"


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
            log.info("%s: store error: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EROFS):
                self.metrics.error(errno.errorcode.get(exc.errno or errno.EIO, "io").lower())
                log.info("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            self.metrics.error("internal")
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


@dataclass
class Handle:
    node: Node
    entry: Entry
    state: ReadState = field(default_factory=ReadState)


class TierFS(pyfuse3.Operations):
    def __init__(
        self,
        namespace: Namespace,
        reader: Reader,
        cache: Cache,
        metrics: Metrics,
        *,
        control_path: str,
        prefetch_globs: tuple[str, ...],
        prefetch_min_size: int,
    ) -> None:
        super().__init__()
        self.ns = namespace
        self.reader = reader
        self.cache = cache
        self.metrics = metrics
        self.control_path = control_path
        self._prefetch = [glob_to_regex(g) for g in prefetch_globs]
        self._prefetch_min = prefetch_min_size
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._dirs: dict[int, list[tuple[str, Node]]] = {}
        self._kernel_generation: dict[int, int] = {}
        self.uid, self.gid = os.getuid(), os.getgid()

    # -- attributes ------------------------------------------------------------

    def attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.st_mode = self.ns.mode(node)
        a.st_nlink = 2 if node.is_dir else 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = node.size
        a.st_blksize = 1 << 20
        a.st_blocks = (node.size + 511) // 512
        ns = int(node.mtime * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        ttl = node.settings.attr_ttl
        if self.ns.degraded:
            ttl = min(ttl, 5.0)
        a.attr_timeout = a.entry_timeout = min(ttl, 1e6)
        return a

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

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        self.ns.forget(inode_list)

    # -- directories -----------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.metrics.meta_op("readdir")
        fh = self._new_fh()
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

    # -- files -----------------------------------------------------------------

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.ns.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if node.settings.revalidate_on_open:
            await self.ns.revalidate(node)
        entry = await self.ns.workers.disk(self.cache.open, node.path, node.etag, node.size, node.mtime)
        fh = self._new_fh()
        self._handles[fh] = Handle(node, entry)
        keep = node.settings.keep_cache and self._kernel_generation.get(inode) == node.generation
        self._kernel_generation[inode] = node.generation
        if self._wants_prefetch(node):
            self.reader.prefetch(entry, 0, entry.size)
        self.metrics.meta_op("open")
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=False)

    def _wants_prefetch(self, node: Node) -> bool:
        if node.size < self._prefetch_min:
            return False
        base = node.path.rsplit("/", 1)[-1]
        return any(rx.match(base) for rx in self._prefetch)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles[fh]
        started = time.perf_counter()
        data = await self.reader.read(h.entry, h.state, off, size, h.node.settings.readahead_max)
        self.metrics.read_latency(time.perf_counter() - started)
        return data

    @fuse_errors
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is not None:
            await self.ns.workers.disk(self.cache.release, h.entry)

    # -- filesystem ------------------------------------------------------------

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = await trio.to_thread.run_sync(os.statvfs, str(self.cache.root))
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.f_bsize
        out.f_frsize = st.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        out.f_files, out.f_ffree, out.f_favail = st.f_files, st.f_ffree, st.f_favail
        out.f_namemax = 255
        return out

    @fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == CONTROL_XATTR:
            return self.control_path.encode()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @fuse_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return [CONTROL_XATTR] if inode == pyfuse3.ROOT_INODE else []

    def invalidate(self, inode: int) -> None:
        """Called by the namespace when an object's ETag changed: drop kernel pages."""
        self._kernel_generation.pop(inode, None)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh
