"""pyfuse3.Operations: translates FUSE calls, holds no policy of its own.

Every handler is wrapped so that a failure becomes an errno for the caller
and a log line, never an exception escaping into pyfuse3.main (which would
leave a dead mount behind).
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio

from tierfs.cache import Cache, Entry
from tierfs.config import QUEUED_WRITES
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace, Node
from tierfs.policy import glob_to_regex
from tierfs.queued_writes import QueuedWrites, WriteQueue
from tierfs.reader import Reader, ReadState
from tierfs.store.base import ObjectInfo, StoreError
from tierfs.writeback import WriteBack

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
LOG_EVERY = 10.0  # seconds between log lines of one error kind


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
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
                kind = errno.errorcode.get(exc.errno or errno.EIO, "io").lower()
                self.metrics.error(kind)
                self.log_limited(kind, "%s: %s", fn.__name__, exc)
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
    dirty: bool = False  # written since the last seal
    writable: bool = False  # counted in the write-back writer count until released
    base_etag: str | None = None  # the store version this handle read (manifest If-Match)
    direct: bool = False  # writes bypass the kernel page cache (ClassSettings.direct_writes)
    queue: WriteQueue | None = None  # a direct handle's acknowledged, unapplied writes


class TierFS(pyfuse3.Operations):
    # The kernel coalesces small writes into large requests and keeps written
    # pages (DESIGN §9). Write-only opens of a direct_writes class (checkpoints)
    # bypass it: for 1 MiB writes the page cache's write-back is the slower path.
    enable_writeback_cache = True

    def __init__(
        self,
        namespace: Namespace,
        reader: Reader,
        cache: Cache,
        metrics: Metrics,
        *,
        writeback: WriteBack,
        prefetch_globs: tuple[str, ...],
        prefetch_min_size: int,
    ) -> None:
        super().__init__()
        self.wb = writeback
        self.ns = namespace
        self.reader = reader
        self.cache = cache
        self.metrics = metrics
        self.queued = QueuedWrites(reader.nursery, self._apply_write, QUEUED_WRITES)
        self._prefetch = [glob_to_regex(g) for g in prefetch_globs]
        self._prefetch_min = prefetch_min_size
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._dirs: dict[int, list[tuple[str, Node]]] = {}
        self.uid, self.gid = os.getuid(), os.getgid()
        self._logged: dict[str, tuple[float, int]] = {}

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
        node = self.ns.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC))
        if node.settings.revalidate_on_open:
            await self.ns.revalidate(node)
        entry = await self.ns.workers.disk(self.cache.open, node.path, node.etag, node.size, node.mtime)
        fh = self._new_fh()
        h = self._handles[fh] = Handle(node, entry, writable=writing, base_etag=node.etag or None,
                                       direct=self._direct(node, flags))
        if writing:
            self.wb.writer_opened(node.path, entry.size)
            await self.wb.prepare_write(node.path)
        if flags & os.O_TRUNC and entry.size:
            await self._truncate(h, 0)
        # A changed object comes back as a new inode (namespace._apply_info), so
        # pages kept for an inode always belong to the version it names.
        keep = node.settings.keep_cache
        if not writing and self._wants_prefetch(node) and not self.reader.prefetching(entry):
            await self._prefetch_object(node, entry)
        self.metrics.meta_op("open")
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=h.direct)

    @staticmethod
    def _direct(node: Node, flags: int) -> bool:
        """Write-only opens of a direct-writes class skip the kernel page cache
        (a write-only fd cannot be mmapped, so nothing needs its pages)."""
        return node.settings.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY

    async def _prefetch_object(self, node: Node, entry: Entry) -> None:
        """Model-like file (DESIGN §3.6): fetch it whole into tier 1 in the background,
        holding a reference of its own so a close before the end does not stop it."""
        if entry.state != "clean" or not entry.missing(0, entry.size):
            return
        held = await self.ns.workers.disk(self.cache.open, node.path, node.etag, node.size, node.mtime)
        if held is not entry:  # replaced meanwhile: leave it to the next open
            await self.ns.workers.disk(self.cache.release, held)
            return

        async def done() -> None:
            await self.ns.workers.disk(self.cache.release, held)

        self.reader.prefetch_object(held, done)

    def _wants_prefetch(self, node: Node) -> bool:
        if node.size < self._prefetch_min:
            return False
        base = node.path.rsplit("/", 1)[-1]
        return any(rx.match(base) for rx in self._prefetch)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self._handles[fh]
        await self.queued.drain_entry(h.entry)
        started = time.perf_counter()
        if self.ns.degraded and h.entry.state == "clean" and h.entry.missing_pages(off, off + size):
            # The store is known down: bytes tier 1 lacks fail at once, not after
            # another store deadline (the kernel retries a failed readahead with
            # a second read, which would double the caller's wait).
            raise StoreError("store unreachable (degraded mode)", kind="unreachable")
        data = await self.reader.read(h.entry, h.state, off, size, h.node.settings.readahead_max)
        self.metrics.read_latency(time.perf_counter() - started)
        return data

    @fuse_errors
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        try:
            if h.dirty:  # flush normally sealed it; a failed flush leaves it to us
                await self._seal(h)
        finally:
            if h.writable:
                self.wb.writer_closed(h.node.path, h.entry)
            if h.queue is not None:  # a direct handle that wrote
                # Pages other opens cached may predate these writes. Newer kernels
                # drop them in the direct write itself (6.18 does); older ones don't.
                self.invalidate(h.node.inode)
            await self.ns.workers.disk(self.cache.release, h.entry)

    # -- writes ----------------------------------------------------------------

    @fuse_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        text = self._name(name)
        self.ns.check_new(parent_inode, text, is_dir=False)
        parent = self.ns.get(parent_inode)
        path = f"{parent.path}/{text}" if parent.path else text
        await self.wb.prepare_write(path)
        entry = await self.ns.workers.disk(self.cache.open, path, "", 0, time.time())
        try:
            await self._local_write(entry, entry.truncate, 0)
            node = self.ns.add(parent_inode, text, is_dir=False)
        except BaseException:
            await self.ns.workers.disk(self.cache.release, entry)
            raise
        self.wb.writer_opened(path, 0)
        self.wb.note_dirty(path, 0)
        fh = self._new_fh()
        h = self._handles[fh] = Handle(node, entry, dirty=True, writable=True,
                                       direct=self._direct(node, flags))
        self.metrics.meta_op("create")
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=h.direct), self.attrs(node)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles[fh]
        if not h.dirty:
            await self._begin_write(h)
        await self.queued.drain_entry(h.entry, but=h.queue)  # other handles' writes first
        if h.direct:  # acknowledged now, applied in order in the background
            if h.queue is None:
                h.queue = WriteQueue(h.entry)
            await self.queued.submit(h.queue, h.entry, off, buf)
            h.node.size = max(h.node.size, off + len(buf))
        else:
            await self._apply_write(h.entry, off, buf)
            h.node.size = h.entry.size
        self.wb.note_dirty(h.node.path, h.node.size)
        return len(buf)

    async def _apply_write(self, entry: Entry, off: int, buf: bytes) -> None:
        await self._local_write(entry, entry.write, off, buf)

    async def _begin_write(self, h: Handle) -> None:
        """First write through a handle: the whole object must be local, and no
        upload may be reading the file while it changes."""
        await self.wb.prepare_write(h.node.path)
        await self._make_local(h, h.entry.size)
        h.dirty = True

    async def _make_local(self, h: Handle, size: int) -> None:
        """Fetch the first `size` bytes of a clean entry into tier 1. If the object
        changed in the store since this handle opened it (ESTALE), write onto the
        store's current version instead."""
        if h.entry.state != "clean" or not size:
            return
        try:
            await self.reader.ensure(h.entry, 0, size, whole_parts=True)
            return
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
        await self.ns.revalidate(h.node)
        old, n = h.entry, h.node
        h.entry = await self.ns.workers.disk(self.cache.open, n.path, n.etag, n.size, n.mtime)
        await self.ns.workers.disk(self.cache.release, old)
        await self.reader.ensure(h.entry, 0, min(size, h.entry.size), whole_parts=True)

    async def _settle(self, h: Handle) -> None:
        """Wait for the file's queued writes; raise this handle's failed one."""
        if h.queue is not None:
            await self.queued.drain(h.queue)
        await self.queued.drain_entry(h.entry)

    async def _truncate(self, h: Handle, size: int) -> None:
        await self._settle(h)
        await self.wb.prepare_write(h.node.path)
        await self._make_local(h, min(size, h.entry.size))
        await self._local_write(h.entry, h.entry.truncate, size)
        h.dirty = True
        h.node.size = size
        self.wb.note_dirty(h.node.path, size)

    async def _local_write(self, entry: Entry, fn: Callable[..., Any], *args: Any) -> Any:
        """A tier-1 write; on a full disk, evict clean data once and retry, else ENOSPC."""
        try:
            return await self.ns.workers.disk(fn, *args)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await self.ns.workers.disk(self.cache.reclaim)
            return await self.ns.workers.disk(fn, *args)

    async def _seal(self, h: Handle) -> None:
        await self._settle(h)  # a file with a failed write is never sealed
        h.dirty = False
        mode = h.node.settings.write_mode
        try:
            if mode == "publish":
                info = await self.wb.publish(h.entry, if_match=h.base_etag)
                h.base_etag = info.etag
            else:
                await self.wb.seal(h.entry, write_through=mode != "writeback")
        except BaseException:
            h.dirty = h.entry.state == "dirty"
            raise
        h.node.size = h.entry.size

    @fuse_errors
    async def flush(self, fh: int) -> None:
        h = self._handles.get(fh)
        if h is not None and h.dirty:
            await self._seal(h)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handles.get(fh)
        if h is not None and h.dirty:
            await self._seal(h)

    @fuse_errors
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        node = await self.ns.getattr(inode)
        if fields.update_mode and stat.S_IMODE(attr.st_mode) != stat.S_IMODE(self.ns.mode(node)):
            raise pyfuse3.FUSEError(errno.EPERM)  # modes are not stored (README)
        if (fields.update_uid and attr.st_uid != self.uid) or (
            fields.update_gid and attr.st_gid != self.gid
        ):
            raise pyfuse3.FUSEError(errno.EPERM)
        if fields.update_size:
            if node.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            h = self._handles.get(fh) if fh is not None else None
            if h is not None:
                await self._truncate(h, attr.st_size)
            else:  # truncate(2) by path: a write and a close in one
                await self.wb.prepare_write(node.path)
                entry = await self.ns.workers.disk(
                    self.cache.open, node.path, node.etag, node.size, node.mtime
                )
                tmp = Handle(node, entry, writable=True)
                self.wb.writer_opened(node.path, entry.size)
                try:
                    await self._truncate(tmp, attr.st_size)
                    await self._seal(tmp)
                finally:
                    self.wb.writer_closed(node.path, entry)
                    await self.ns.workers.disk(self.cache.release, entry)
        if fields.update_mtime:
            node.mtime = attr.st_mtime_ns / 1e9
            lf = self.wb.local.get(node.path)
            if lf is not None:
                lf.mtime = node.mtime
        return self.attrs(node)

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        text = self._name(name)
        node = await self.ns.lookup(parent_inode, text)
        node.lookups -= 1
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        await self.queued.drain_all()
        await self.wb.delete(node.path)
        self.ns.remove(parent_inode, text)
        self.metrics.meta_op("unlink")

    @fuse_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        text = self._name(name)
        self.ns.check_new(parent_inode, text, is_dir=True)
        if await self._exists(parent_inode, text):
            raise pyfuse3.FUSEError(errno.EEXIST)
        parent = self.ns.get(parent_inode)
        await self.wb.make_dir(f"{parent.key}{text}/", store_down=self.ns.degraded)
        self.metrics.meta_op("mkdir")
        return self.attrs(self.ns.add(parent_inode, text, is_dir=True))

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        text = self._name(name)
        node = await self.ns.lookup(parent_inode, text)
        node.lookups -= 1
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        node.children_expire = -math.inf  # emptiness is the store's word, not a stale listing
        if await self.ns.readdir(node.inode):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        await self.wb.remove_dir(node.key)
        self.ns.remove(parent_inode, text)
        self.metrics.meta_op("rmdir")

    @fuse_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        await self.queued.drain_all()  # files move with the bytes they were written
        old, new = self._name(name_old), self._name(name_new)
        src = await self.ns.lookup(parent_inode_old, old)
        src.lookups -= 1
        self.ns.check_new(parent_inode_new, new, is_dir=src.is_dir)
        dst = await self._lookup_or_none(parent_inode_new, new)
        if dst is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise pyfuse3.FUSEError(errno.EEXIST)
            if dst.is_dir and not src.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if src.is_dir and not dst.is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if dst.is_dir:
                dst.children_expire = -math.inf
                if await self.ns.readdir(dst.inode):
                    raise pyfuse3.FUSEError(errno.ENOTEMPTY)
                await self.wb.remove_dir(dst.key)
        new_parent = self.ns.get(parent_inode_new)
        target = f"{new_parent.key}{new}"
        if not src.is_dir and self.ns.policy.settings(target).write_mode == "publish":
            info = await self._publish_rename(src, target, dst)
            self.ns.move(parent_inode_old, old, parent_inode_new, new)
            self.ns.uploaded(target, info)
            self.metrics.meta_op("rename")
            return
        if src.is_dir:
            copied = await self.wb.rename_tree(src.key, f"{new_parent.key}{new}/")
        else:
            copied = await self.wb.rename_file(src.path, f"{new_parent.key}{new}")
        self.ns.move(parent_inode_old, old, parent_inode_new, new)
        for info in copied:
            self.ns.uploaded(info.key, info)
        self.metrics.meta_op("rename")

    async def _publish_rename(self, src: Node, target: str, dst: Node | None) -> ObjectInfo:
        """os.replace(tmp, manifest) is the commit point of a checkpoint: publish it
        like a manifest close (barrier + conditional PUT), then drop the source."""
        entry = await self.ns.workers.disk(self.cache.open, src.path, src.etag, src.size, src.mtime)
        try:
            if entry.state == "clean":
                await self.reader.ensure(entry, 0, entry.size, whole_parts=True)
            info = await self.wb.publish_rename(entry, target, if_match=dst.etag if dst else None)
        finally:
            await self.ns.workers.disk(self.cache.release, entry)
        await self.wb.delete(src.path)
        return info

    @fuse_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)  # objects have no link type (README)

    @fuse_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    @fuse_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    async def _exists(self, parent_inode: int, name: str) -> bool:
        return await self._lookup_or_none(parent_inode, name) is not None

    async def _lookup_or_none(self, parent_inode: int, name: str) -> Node | None:
        try:
            node = await self.ns.lookup(parent_inode, name)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        node.lookups -= 1
        return node

    @staticmethod
    def _name(name: bytes) -> str:
        try:
            return name.decode("utf-8")
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None

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

    def invalidate(self, inode: int) -> None:
        """Called by the namespace when an object's ETag changed: drop the kernel's
        pages of the old inode, from a worker thread (the kernel may need this loop
        meanwhile)."""
        self.reader.nursery.start_soon(self._drop_kernel_pages, inode)

    async def _drop_kernel_pages(self, inode: int) -> None:
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, False)
        except OSError as exc:  # ENOENT: the kernel holds no such inode (nothing cached)
            log.debug("invalidate_inode(%d): %s", inode, exc)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh
