"""The directory tree as the mount changes it: create, unlink, mkdir, rmdir,
rename, truncate and utimens by path.

Each change checks what POSIX asks of it (EEXIST, ENOTEMPTY, EISDIR,
ENOTDIR, RENAME_NOREPLACE), has the write path do the store and journal work
(writeback/), then brings the namespace up to date. fs.py only translates.
"""

from __future__ import annotations

import errno

import pyfuse3

from tierfs.namespace import Namespace, Node, join
from tierfs.writeback.core import WriteBack
from tierfs.writeback.session import WriteSession


class TreeChanges:
    def __init__(self, ns: Namespace, wb: WriteBack) -> None:
        self.ns = ns
        self.wb = wb

    async def create(self, parent_inode: int, name: str, flags: int) -> tuple[Node, WriteSession]:
        self.ns.check_new(parent_inode, name, is_dir=False)
        node = self.ns.add(parent_inode, name, is_dir=False)
        try:
            session = await self.wb.create(node.path, flags=flags, inode=node.inode)
        except BaseException:
            self.ns.remove(parent_inode, name)
            raise
        return node, session

    async def unlink(self, parent_inode: int, name: str) -> None:
        node = await self._child(parent_inode, name)
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        await self.wb.delete(node.path)
        self.ns.remove(parent_inode, name)

    async def mkdir(self, parent_inode: int, name: str) -> Node:
        self.ns.check_new(parent_inode, name, is_dir=True)
        if await self._child_or_none(parent_inode, name) is not None:
            raise OSError(errno.EEXIST, "exists")
        parent = self.ns.get(parent_inode)
        await self.wb.make_dir(f"{parent.key}{name}/")
        return self.ns.add(parent_inode, name, is_dir=True)

    async def rmdir(self, parent_inode: int, name: str) -> None:
        node = await self._child(parent_inode, name)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        await self._ensure_empty(node)
        await self.wb.remove_dir(node.key)
        self.ns.remove(parent_inode, name)

    async def rename(
        self, parent_old: int, old: str, parent_new: int, new: str, flags: int
    ) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        src = await self._child(parent_old, old)
        self.ns.check_new(parent_new, new, is_dir=src.is_dir)
        dst = await self._child_or_none(parent_new, new)
        if dst is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise OSError(errno.EEXIST, "exists")
            if dst.is_dir and not src.is_dir:
                raise OSError(errno.EISDIR, "is a directory")
            if src.is_dir and not dst.is_dir:
                raise OSError(errno.ENOTDIR, "not a directory")
            if dst.is_dir:
                await self._ensure_empty(dst)
                await self.wb.remove_dir(dst.key)
        target = join(self.ns.get(parent_new).path, new)
        if src.is_dir:
            copied = await self.wb.rename_tree(src.key, f"{target}/")
        elif self.ns.policy.settings(target).write_mode == "publish":
            copied = [await self.wb.publish_rename(
                src.path, target, if_match=(dst.etag or None) if dst is not None else None)]
        else:
            copied = await self.wb.rename_file(src.path, target)
        self.ns.move(parent_old, old, parent_new, new)
        for info in copied:
            self.ns.uploaded(info.key, info)

    async def truncate(self, node: Node, size: int) -> None:
        """truncate(2) by path (no open handle)."""
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        await self.wb.truncate(node.path, node.etag, node.size, node.mtime, to=size,
                               inode=node.inode)

    def set_mtime(self, node: Node, mtime: float) -> None:
        self.ns.set_mtime(node, mtime)
        self.wb.set_mtime(node.path, mtime)

    async def _ensure_empty(self, node: Node) -> None:
        self.ns.expire_listing(node)  # emptiness is the store's word, not a stale listing
        if await self.ns.readdir(node.inode):
            raise OSError(errno.ENOTEMPTY, "directory not empty")

    async def _child(self, parent_inode: int, name: str) -> Node:
        """The child `name`, looked up without counting a kernel reference."""
        node = await self.ns.lookup(parent_inode, name)
        node.lookups -= 1
        return node

    async def _child_or_none(self, parent_inode: int, name: str) -> Node | None:
        try:
            return await self._child(parent_inode, name)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
