"""The directory tree as the mount changes it: create, mknod, symlink, unlink,
mkdir, rmdir, rename, truncate, and chmod/chown/utimens (`set_attrs`).

Each change checks what POSIX asks of it (EEXIST, ENOTEMPTY, EISDIR,
ENOTDIR, RENAME_NOREPLACE), has the write path do the store and journal work
(writeback/), then brings the namespace up to date. Permission checks are the
kernel's (default_permissions). fs.py only translates.
"""

from __future__ import annotations

import errno
import stat
import time
from dataclasses import dataclass, replace
from functools import partial

import pyfuse3

from tierfs.namespace import Namespace, Node, join
from tierfs.posix import OBJECT_TYPES, SYMLINK_MAX, Attrs, new_attrs
from tierfs.store.base import StoreError
from tierfs.writeback.core import WriteBack
from tierfs.writeback.rename import Renames
from tierfs.writeback.session import WriteSession


@dataclass(frozen=True)
class Caller:
    """Who asks (the FUSE request's context): owner of what it creates."""

    uid: int
    gid: int


@dataclass(frozen=True)
class AttrChange:
    """What a setattr changes (None: not that)."""

    perms: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None


class TreeChanges:
    def __init__(self, ns: Namespace, wb: WriteBack, renames: Renames) -> None:
        self.ns = ns
        self.wb = wb
        self.renames = renames

    def _new_attrs(self, parent_inode: int, kind: int, perms: int, who: Caller,
                   rdev: int = 0) -> Attrs:
        """A new entry's attributes: the caller's, but a setgid directory's group (and,
        for a directory, its setgid bit), as on a local filesystem."""
        parent, _ = self.ns.stat(self.ns.get(parent_inode))
        gid = who.gid
        if parent.mode & stat.S_ISGID:
            gid = parent.gid
            if kind == stat.S_IFDIR:
                perms |= stat.S_ISGID
        return new_attrs(kind, perms, who.uid, gid, time.time_ns(), rdev)

    async def create(self, parent_inode: int, name: str, flags: int, perms: int,
                     who: Caller) -> tuple[Node, WriteSession]:
        self.ns.check_new(parent_inode, name, is_dir=False)
        attrs = self._new_attrs(parent_inode, stat.S_IFREG, perms, who)
        fresh = self.ns.known_absent(parent_inode, name)
        node = self.ns.add(parent_inode, name, is_dir=False, attrs=attrs)
        try:
            session = await self.wb.create(node.path, flags=flags, inode=node.inode, attrs=attrs,
                                           fresh=fresh)
        except BaseException:
            self.ns.remove(parent_inode, name)
            raise
        await self.ns.remember()
        return node, session

    async def mknod(self, parent_inode: int, name: str, mode: int, rdev: int,
                    who: Caller) -> Node:
        """FIFOs, sockets, device nodes (inert metadata: the mount is nodev, so the
        kernel opens none) and empty regular files: empty objects typed by metadata."""
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind not in OBJECT_TYPES or kind == stat.S_IFLNK:
            raise OSError(errno.EINVAL, "not a type mknod makes")
        return await self._special(parent_inode, name, b"",
                                   self._new_attrs(parent_inode, kind, mode, who, rdev))

    async def symlink(self, parent_inode: int, name: str, target: str, who: Caller) -> Node:
        body = target.encode("utf-8", "surrogateescape")
        if len(body) > SYMLINK_MAX:
            raise OSError(errno.ENAMETOOLONG, "symlink target too long")
        attrs = self._new_attrs(parent_inode, stat.S_IFLNK, 0o777, who)
        return await self._special(parent_inode, name, body, attrs, link=target)

    async def _special(self, parent_inode: int, name: str, body: bytes, attrs: Attrs,
                       link: str | None = None) -> Node:
        self.ns.check_new(parent_inode, name, is_dir=False)
        if await self._child_or_none(parent_inode, name) is not None:
            raise OSError(errno.EEXIST, "exists")
        parent = self.ns.get(parent_inode)
        info = await self.wb.put_special(join(parent.path, name), body, attrs)
        node = self.ns.add(parent_inode, name, is_dir=False, attrs=attrs, size=len(body),
                           etag=info.etag, link=link, stored_at=info.mtime)
        await self.ns.remember()
        return node

    async def readlink(self, node: Node) -> str:
        return await self.ns.readlink(node)

    async def set_attrs(self, node: Node, change: AttrChange) -> None:
        """chmod, chown, utimens (each moves the ctime, as on a local filesystem)."""
        now = time.time_ns()
        old, _ = self.ns.stat(node)
        new = old
        if change.perms is not None:
            new = new.with_perms(change.perms, now)
        if change.uid is not None or change.gid is not None:
            new = new.with_owner(change.uid, change.gid, now)
        if change.atime_ns is not None or change.mtime_ns is not None:
            new = new.with_times(change.atime_ns, change.mtime_ns, now)
        if change.ctime_ns is not None:
            new = replace(new, ctime_ns=change.ctime_ns)
        if change == AttrChange():  # chown(-1, -1): nothing to change but the ctime
            new = replace(old, ctime_ns=now)
        if new == old:
            return
        if not self.ns.linked(node):
            # Unlinked or replaced (fchmod of an open file, or the kernel's late
            # setattr of the times of an inode renamed over): no object is its.
            node.attrs = new
            return
        try:
            info = await self.wb.set_attrs(node.key, node.etag, new)
        except StoreError as exc:
            if exc.kind != "precondition" or node.is_dir:
                raise
            # The object moved on since this mount saw it (another node's write, or
            # the kernel flushing times of a version it held): the last change wins,
            # made on the current version (its bytes stay as they are).
            current = await self.ns.refresh(node.key)
            info = await self.wb.set_attrs(node.key, current.etag, new)
            node = self.ns.current(node)
        if not node.is_dir and info is not None:  # stored: its (maybe new) version
            self.ns.set_attrs(node, new, etag=info.etag, stored_at=info.mtime)
        else:
            self.ns.set_attrs(node, new)
        if node.is_dir:
            node.mtime = new.mtime_ns / 1e9
        await self.ns.remember()

    async def unlink(self, parent_inode: int, name: str) -> None:
        node = await self._child(parent_inode, name)
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        self.ns.unlinking(node)  # what its open descriptors fstat from now on
        await self.wb.delete(node.path)
        self.ns.remove(parent_inode, name)
        await self.ns.remember()

    async def mkdir(self, parent_inode: int, name: str, perms: int, who: Caller) -> Node:
        self.ns.check_new(parent_inode, name, is_dir=True)
        if await self._child_or_none(parent_inode, name) is not None:
            raise OSError(errno.EEXIST, "exists")
        parent = self.ns.get(parent_inode)
        attrs = self._new_attrs(parent_inode, stat.S_IFDIR, perms, who)
        await self.wb.make_dir(f"{parent.key}{name}/", attrs)
        node = self.ns.add(parent_inode, name, is_dir=True, attrs=attrs)
        await self.ns.remember()
        return node

    async def rmdir(self, parent_inode: int, name: str) -> None:
        node = await self._child(parent_inode, name)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        await self._ensure_empty(node)
        await self.ns.removing_dir(node)
        await self.wb.remove_dir(node.key)
        self.ns.remove(parent_inode, name)
        await self.ns.remember()

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
                await self.ns.removing_dir(dst)
                await self.wb.remove_dir(dst.key)
            else:
                self.ns.unlinking(dst)
        target = join(self.ns.get(parent_new).path, new)
        # The write path moves the namespace itself, before anything can land under
        # the new name (writeback/rename.py).
        moved = partial(self.ns.move, parent_old, old, parent_new, new)
        if src.is_dir:
            old_key = src.key
            await self.ns.moving_dir(src, f"{target}/")
            try:
                copied = await self.renames.rename_tree(old_key, f"{target}/", moved)
            finally:
                self.ns.moved_dir(old_key)
        elif (self.ns.policy.settings(target).write_mode == "publish"
              and self.ns.stat(src)[0].kind == stat.S_IFREG):  # `ln -sfn`: a symlink moves
            copied = await self.renames.publish_rename(
                src.path, target, moved, if_match=(dst.etag or None) if dst is not None else None)
        else:
            copied = await self.renames.rename_file(src.path, target, moved)
        for info in copied:
            await self.ns.uploaded(info.key, info)
        await self.ns.remember()

    async def truncate(self, node: Node, size: int) -> None:
        """truncate(2) by path (no open handle)."""
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        await self.wb.truncate(node.path, node.etag, node.size, node.mtime, to=size,
                               inode=node.inode, attrs=node.attrs)

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
