"""What the namespace knows of POSIX attributes (DESIGN §6).

POSIX attributes (mode, owner, times; symlink targets) are object metadata
(posix.py), which listings do not carry. A node's `attrs` are None until
known: from a HEAD, from this mount's own changes, from the record the tier-1
index keeps per object version (what this node learned before a remount), or
from the directory's attribute object (dirattrs.py). Unknown attributes show
the mount's defaults; what is known is never contradicted by a later listing
of the same version.
"""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Callable
from dataclasses import replace

from tierfs.cache import Cache
from tierfs.namespace.nodes import LocalFile, LocalOverlay, Node, NodeTable
from tierfs.posix import (
    SYMLINK_MAX,
    Attrs,
    Defaults,
    Known,
    default_attrs,
    from_metadata,
    has_attrs,
)
from tierfs.store.base import ObjectInfo, Store
from tierfs.workers import Workers


class Attributes:
    def __init__(self, table: NodeTable, store: Store, cache: Cache, workers: Workers,
                 overlay: LocalOverlay, defaults: Defaults, *,
                 on_changed: Callable[[int], None], on_gone: Callable[[int, str], None]) -> None:
        self.table = table
        self.store = store
        self.cache = cache
        self.workers = workers
        self.overlay = overlay
        self.defaults = defaults
        self.on_changed = on_changed  # an inode's object changed: drop the kernel's pages
        self.on_gone = on_gone  # a name the kernel may remember is gone
        self._remember: dict[str, bytes | None] = {}  # attribute records not yet in the index

    def stat(self, node: Node) -> tuple[Attrs, int]:
        """A node's attributes and size, as stat shows them (an unlinked node's were
        frozen when its name went: what now has its name is another file)."""
        a = node.attrs
        if node.is_dir:
            return a or default_attrs(stat.S_IFDIR, self.defaults, int(node.mtime * 1e9)), 0
        lf = self.overlay.local_file(node.path) if self.table.linked(node) else None
        size = node.size if lf is None else lf.size
        if lf is not None:
            a = lf.attrs or a
        if a is None:
            mtime_ns = int(node.mtime * 1e9) if lf is None else lf.mtime_ns
            return default_attrs(stat.S_IFREG, self.defaults, mtime_ns), size
        return (a if lf is None else a.written_at(lf.mtime_ns)), size

    def nlink(self, node: Node) -> int:
        """2 + subdirectories for a directory whose entries are known, else 2; 1 for
        files; 0 once unlinked (renamed over, removed: fstat of an open descriptor)."""
        if not self.table.linked(node):
            return 0
        if not node.is_dir:
            return 1
        kids = node.children or {}
        return 2 + sum(1 for i in kids.values() if (n := self.table.find(i)) is not None and n.is_dir)

    def set(self, node: Node, attrs: Attrs, *, etag: str | None = None,
            link: str | None = None) -> None:
        """Attributes this mount gave `node` (and the object's new ETag, if it has one)."""
        if etag is not None:
            node.etag = etag
        node.attrs = attrs
        if link is not None:
            node.link = link
        self.note(node)

    def touch_dir(self, node: Node | None) -> None:
        """An entry was added to or removed from a directory: its mtime and ctime move."""
        if node is None or not node.is_dir:
            return
        now = time.time_ns()
        base, _ = self.stat(node)
        node.mtime = now / 1e9
        self.set(node, replace(base, mtime_ns=now, ctime_ns=now))

    def note(self, node: Node) -> None:
        """Keep `node`'s attributes in the index (on the next `remember`)."""
        if node.attrs is not None:
            self._remember[node.key] = Known(node.etag, 0, node.attrs, node.link).pack()

    def note_record(self, key: str, record: Known | None) -> None:
        """Keep `record` for `key` in the index (None: drop what is kept)."""
        self._remember[key] = None if record is None else record.pack()

    def from_head(self, info: ObjectInfo) -> Attrs:
        """The attributes a HEAD's (or GET's) metadata gives the version `info`."""
        return from_metadata(info.metadata, is_dir=False, defaults=self.defaults,
                             store_mtime_ns=int(info.mtime * 1e9))

    def apply_info(self, node: Node, info: ObjectInfo, now: float, *,
                   stored: Attrs | None = None, link: str | None = None,
                   known: Known | None = None, unknown_only: bool = False) -> Node:
        """Record an object's attributes: `stored`, the store's word on this version
        (a HEAD's metadata; its directory's attribute object's entry, which only
        fills what is not known yet: `unknown_only`, as a listing may be older than
        this mount's own change), with a symlink's target if it tells it; else
        `known`, what the index kept of it, if nothing is known yet. An object replaced in the store by someone else gets a new
        inode, like a file replaced by rename on a local disk: with the kernel's
        write-back cache on, the kernel trusts its own cached size of an inode over
        ours, so the old inode could never show the new size. Handles open on the
        old inode keep reading the old version; its pages are dropped."""
        fresh = False
        if node.etag and node.etag != info.etag:
            self.on_changed(node.inode)
            node, fresh = self.table.renode(node), True
        if stored is not None and (node.attrs is None or not unknown_only):
            if not fresh and node.attrs is None and node.etag and not self._shown_as(node, stored):
                node = self.table.renode(node)
            if stored != node.attrs or (link is not None and link != node.link):
                node.attrs, node.link = stored, link
                self.note(node)
        elif known is not None and node.attrs is None and known.etag == info.etag:
            node.attrs, node.link = known.attrs, known.link
        node.size, node.mtime, node.etag = info.size, info.mtime, info.etag
        node.attr_expire = now + node.settings.attr_ttl
        return node

    def apply_local(self, node: Node, lf: LocalFile) -> None:
        node.size, node.mtime, node.etag = lf.size, lf.mtime, ""
        node.attr_expire = time.monotonic() + node.settings.attr_ttl

    def _shown_as(self, node: Node, attrs: Attrs) -> bool:
        """Whether the kernel, told `node`'s defaults, shows `attrs`' times. With the
        write-back cache it keeps a regular file's mtime and ctime as first told:
        learning other times takes a new inode (as a new version of the object does)."""
        shown = int(node.mtime * 1e9)
        return attrs.mtime_ns == attrs.ctime_ns == shown

    def learn(self, key: str, etag: str, metadata: dict[str, str]) -> None:
        """A GET's response showed the attributes of `key` at `etag`: take them if they
        were unknown (the kernel is told to ask again: one invalidation per version)."""
        node = self.table.at(key)
        if node is None or node.is_dir or node.attrs is not None or node.etag != etag:
            return
        if not has_attrs(metadata):
            return
        attrs = from_metadata(metadata, is_dir=False, defaults=self.defaults,
                              store_mtime_ns=int(node.mtime * 1e9))
        self.on_changed(node.inode)
        if not self._shown_as(node, attrs):
            node = self.table.renode(node)
            parent = self.table.parent_of(key)
            if parent is not None:
                self.on_gone(parent.inode, key.rpartition("/")[2])  # the kernel looks it up again
        node.attrs = attrs
        self.note(node)

    async def remember(self) -> None:
        """Write the attribute records noted since the last call."""
        if self._remember:
            batch, self._remember = self._remember, {}
            await self.workers.disk(self.cache.set_attrs, batch)

    async def known(self, keys: list[str]) -> dict[str, Known]:
        """The records the index keeps for `keys`."""
        if not keys:
            return {}
        raw = await self.workers.disk(self.cache.attrs_of, keys)
        return {k: known for k, r in raw.items() if (known := Known.unpack(r)) is not None}

    async def readlink(self, node: Node) -> str:
        """A symlink's target: its object's body (read once)."""
        a, _ = self.stat(node)
        if a.kind != stat.S_IFLNK:
            raise OSError(errno.EINVAL, "not a symlink")
        if node.link is None:
            body = await self.workers.meta(self.store.get_range, node.key, 0, SYMLINK_MAX + 1,
                                           node.etag or None)
            node.link = body.decode("utf-8", "surrogateescape")
            self.note(node)
            await self.remember()
        return node.link
