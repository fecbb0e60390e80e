"""A mount's parts driven in-process, without a kernel: what the model harness
(test_model_harness.py) and the write path's unit tests run against.

`harness_mount` builds every part of a mount as mount.py does (`build`), on a
file:// store, and `Kernel` plays the kernel's part for the calls a process
makes (path lookups, open/create, FLUSH then RELEASE at close, the offset of
an append), calling the real TierFS operations (fuse/fs.py). No FUSE session
exists: kernel notifications are queued and never sent.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyfuse3
import trio

from tierfs.config import MountConfig, build_config, load_config_file
from tierfs.daemon import Daemon
from tierfs.mount import Parts, Prepared, build
from tierfs.store.base import Store

ROOT_INODE = pyfuse3.ROOT_INODE


@dataclass
class Fields:
    """setattr's fields (pyfuse3.SetattrFields cannot be made outside a request)."""

    update_size: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False


def config(store_dir: Path, cache_dir: Path, mountpoint: Path, toml: str = "") -> MountConfig:
    cfg_file = cache_dir.parent / f"{cache_dir.name}.toml"
    cfg_file.write_text(toml)
    mountpoint.mkdir(exist_ok=True)
    return build_config(load_config_file(cfg_file), f"file://{store_dir}", mountpoint,
                        cache_dir=cache_dir, passthrough=False)


@contextlib.asynccontextmanager
async def harness_mount(cfg: MountConfig, store_hook: Callable[[Store], None] | None = None,
                        ) -> AsyncIterator[Parts]:
    """The parts of a mount of `cfg` (prepared as the daemon does), until the
    block ends; then every background task stops and the cache closes.
    `store_hook` sees the store before anything uses it."""
    daemon = Daemon(cfg)
    daemon.prepare()
    assert daemon.store is not None and daemon.cache is not None
    if store_hook is not None:
        store_hook(daemon.store)
    prepared = Prepared(cfg, daemon.store, daemon.cache, daemon.metrics, daemon.health,
                        daemon.warnings, not daemon.unsafe_manifests, None)
    try:
        async with trio.open_nursery() as nursery:
            parts = await build(prepared, nursery, trio.Event())
            try:
                yield parts
            finally:
                nursery.cancel_scope.cancel()
    finally:
        daemon.cache.close()


def _errno(exc: BaseException) -> int:
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    assert isinstance(exc, OSError)
    return exc.errno or errno.EIO


class Kernel:
    """The kernel's side of the calls the model makes, on TierFS's operations.
    Failures come out as OSError with the errno a process would see."""

    def __init__(self, parts: Parts) -> None:
        self.ops = parts.ops
        self.ns = parts.ns
        self.ctx = pyfuse3.RequestContext()
        self.inodes: dict[int, int] = {}  # fh -> its inode (what an fd's setattr names)

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await fn(*args)
        except pyfuse3.FUSEError as exc:
            raise OSError(_errno(exc), os.strerror(_errno(exc))) from None

    async def lookup(self, path: str) -> int:
        inode = ROOT_INODE
        for name in [p for p in path.split("/") if p]:
            attrs = await self._call(self.ops.lookup, inode, name.encode(), self.ctx)
            inode = attrs.st_ino
        return inode

    async def _parent(self, path: str, *, make: bool = False) -> tuple[int, str]:
        head, _, name = path.rpartition("/")
        inode = ROOT_INODE
        for part in [p for p in head.split("/") if p]:
            try:
                attrs = await self._call(self.ops.lookup, inode, part.encode(), self.ctx)
            except OSError as exc:
                if exc.errno != errno.ENOENT or not make:
                    raise
                attrs = await self._call(self.ops.mkdir, inode, part.encode(), 0o755, self.ctx)
            inode = attrs.st_ino
        return inode, name

    async def open(self, path: str, flags: int, *, mkdirs: bool = False) -> int:
        parent, name = await self._parent(path, make=mkdirs)
        try:
            attrs = await self._call(self.ops.lookup, parent, name.encode(), self.ctx)
        except OSError as exc:
            if exc.errno != errno.ENOENT or not flags & os.O_CREAT:
                raise
            info, attrs = await self._call(self.ops.create, parent, name.encode(), 0o644,
                                           flags & ~os.O_CREAT, self.ctx)
        else:
            info = await self._call(self.ops.open, attrs.st_ino, flags & ~os.O_CREAT, self.ctx)
        self.inodes[info.fh] = attrs.st_ino
        return cast(int, info.fh)

    async def close(self, fh: int) -> None:
        """close(2) of the last descriptor: FLUSH (its errno is close's), then RELEASE."""
        try:
            await self._call(self.ops.flush, fh)
        finally:
            await self.ops.release(fh)
            del self.inodes[fh]

    async def fsync(self, fh: int) -> None:
        await self._call(self.ops.fsync, fh, False)

    async def pwrite(self, fh: int, data: bytes, off: int) -> None:
        assert await self._call(self.ops.write, fh, off, data) == len(data)

    async def size(self, path: str) -> int:
        attrs = await self._call(self.ops.getattr, await self.lookup(path), self.ctx)
        return cast(int, attrs.st_size)

    async def read_all(self, path: str) -> bytes:
        fh = await self.open(path, os.O_RDONLY)
        try:
            out, off = bytearray(), 0
            while piece := answer(await self._call(self.ops.read, fh, off, 1 << 20)):
                out += piece
                off += len(piece)
            return bytes(out)
        finally:
            await self.close(fh)

    async def truncate(self, path: str, size: int, fh: int | None = None) -> None:
        attr = pyfuse3.EntryAttributes()
        attr.st_size = size
        fields = cast(pyfuse3.SetattrFields, Fields(update_size=True))
        await self._call(self.ops.setattr, await self.lookup(path), attr, fields, fh, self.ctx)

    async def ftruncate(self, fh: int, size: int) -> None:
        attr = pyfuse3.EntryAttributes()
        attr.st_size = size
        fields = cast(pyfuse3.SetattrFields, Fields(update_size=True))
        await self._call(self.ops.setattr, self.inodes[fh], attr, fields, fh, self.ctx)

    async def rename(self, src: str, dst: str) -> None:
        if src == dst:  # the kernel answers it (0, or ENOENT) without the filesystem
            await self.lookup(src)
            return
        p_old, old = await self._parent(src)
        p_new, new = await self._parent(dst, make=True)
        await self._call(self.ops.rename, p_old, old.encode(), p_new, new.encode(), 0, self.ctx)

    async def unlink(self, path: str) -> None:
        parent, name = await self._parent(path)
        await self._call(self.ops.unlink, parent, name.encode(), self.ctx)

    async def files(self) -> dict[str, int]:
        """Every regular file's path and inode, as a walk of the tree lists them."""
        out: dict[str, int] = {}
        todo = [(ROOT_INODE, "")]
        while todo:
            inode, prefix = todo.pop()
            for name, node in await self.ns.readdir(inode):
                if node.is_dir:
                    todo.append((node.inode, f"{prefix}{name}/"))
                else:
                    out[f"{prefix}{name}"] = node.inode
        return out


def answer(reply: bytes | memoryview | pyfuse3.FileSlice) -> bytes | memoryview:
    """A read handler's reply as the kernel gets it: a FileSlice is read from its
    file and given back (`done`), as libfuse does."""
    if not isinstance(reply, pyfuse3.FileSlice):
        return reply
    try:
        return os.pread(reply.fd, reply.length, reply.offset)
    finally:
        if reply.done is not None:
            reply.done()
