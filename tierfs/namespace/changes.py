"""Changes made through this mount: entries added, removed, moved, and files
that landed in the store or lost their local bytes. Each keeps the inode
table, the attribute knowledge, the kept listings and the directories'
attribute objects (dirattrs.py) consistent with what this mount did."""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Callable
from dataclasses import replace

import tierfs.namespace.dirattrs as dirattrs
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings
from tierfs.namespace.attributes import Attributes
from tierfs.namespace.attrobjects import AttrObjects
from tierfs.namespace.nodes import LocalOverlay, Node, NodeTable, bad_name_errno, join, valid_name
from tierfs.posix import Attrs, Known, from_metadata, has_attrs, to_metadata
from tierfs.store.base import ObjectInfo, Store


class Changes:
    def __init__(self, table: NodeTable, attrs: Attributes, objects: AttrObjects, store: Store,
                 health: StoreHealth, kept: KeptListings, overlay: LocalOverlay, *,
                 on_changed: Callable[[int], None], on_gone: Callable[[int, str], None]) -> None:
        self.table = table
        self.attrs = attrs
        self.objects = objects
        self.store = store
        self.health = health
        self.kept = kept
        self.overlay = overlay
        self.on_changed = on_changed
        self.on_gone = on_gone

    def check_new(self, parent_inode: int, name: str, *, is_dir: bool) -> None:
        """Before a create, mkdir or rename writes anything: `name` must be a valid
        file name whose key the store can take (ENAMETOOLONG, EINVAL otherwise)."""
        parent = self.table.get(parent_inode)
        if not valid_name(name):
            raise OSError(bad_name_errno(name, errno.EINVAL), "invalid name")
        if name == dirattrs.NAME:
            raise OSError(errno.EPERM, f"{name}: the name of a directory's attribute object")
        key = join(parent.path, name) + ("/" if is_dir else "")
        self.store.check_key(key)

    def add(self, parent_inode: int, name: str, *, is_dir: bool, attrs: Attrs, size: int = 0,
            etag: str = "", link: str | None = None, stored_at: float | None = None) -> Node:
        """Record a file, directory, symlink, FIFO or device this mount created
        (`etag`, `stored_at`: the object it stored, and the store's time of it)."""
        parent = self.table.get(parent_inode)
        if not valid_name(name):
            raise OSError(bad_name_errno(name, errno.EINVAL), "invalid name")
        node = self.table.node_for(join(parent.path, name), is_dir)
        node.size, node.mtime, node.etag = size, attrs.mtime_ns / 1e9, etag
        node.attrs, node.link = attrs, link
        self.attrs.note(node)
        node.attr_expire = time.monotonic() + node.settings.attr_ttl
        if is_dir and node.children is None:
            node.children, node.children_expire = {}, time.monotonic() + node.settings.list_ttl
            node.children_epoch = self.health.epoch
        if parent.children is not None:
            parent.children[name] = node.inode
        self.kept.changed(parent.key)
        if is_dir:
            self.kept.changed(node.key)  # a listing kept from an earlier directory of that name
        node.lookups += 1
        self.attrs.touch_dir(parent)
        if is_dir:
            self.objects.created(node.key)
            if not dirattrs.implied(attrs, self.attrs.defaults):
                self.objects.change(parent.key, f"{name}/", dirattrs.dir_entry(attrs))
        elif etag and stored_at is not None:
            self._entry(parent.key, name, attrs, etag, stored_at, link)
        return node

    def _entry(self, prefix: str, name: str, attrs: Attrs, etag: str, stored: float,
               link: str | None) -> None:
        """The entry of an object stored at `stored`: none where a listing tells."""
        entry = None
        if not dirattrs.implied(attrs, self.attrs.defaults, stored):
            entry = dirattrs.file_entry(etag, stored, to_metadata(attrs), link)
        self.objects.change(prefix, name, entry)

    def set_attrs(self, node: Node, attrs: Attrs, *, etag: str | None = None,
                  stored_at: float | None = None) -> None:
        """chmod, chown, utimens: stored on a directory's marker, or on the object
        (its version `etag` stored at `stored_at`; None: kept here until its upload)."""
        self.attrs.set(node, attrs, etag=etag)
        parent = self.table.parent_of(node.path) if node.path else None
        if parent is None or not self.table.linked(node):
            return
        name = node.path.rpartition("/")[2]
        if node.is_dir:  # set explicitly: kept whatever it is
            self.objects.change(parent.key, f"{name}/", dirattrs.dir_entry(attrs))
        elif stored_at is not None and node.etag:
            self._entry(parent.key, name, attrs, node.etag, stored_at, node.link)

    def remove(self, parent_inode: int, name: str) -> None:
        parent = self.table.get(parent_inode)
        path = join(parent.path, name)
        if parent.children is not None:
            parent.children.pop(name, None)
        self.kept.changed(parent.key)
        gone = self.table.at(path)
        if gone is not None:
            self.unlinking(gone)
            if gone.attrs is not None:
                gone.attrs = replace(gone.attrs, ctime_ns=time.time_ns())
            self.table.unname(path)
            self.attrs.note_record(gone.key, None)
            self.objects.change(parent.key, f"{name}/" if gone.is_dir else name, None)
        self.attrs.touch_dir(parent)
        if gone is not None and gone.is_dir:  # a file has nothing below it
            self.kept.changed(f"{path}/")
            for sub in self.table.below(path):
                node = self.table.at(sub)
                if node is not None and node.is_dir:
                    self.kept.changed(f"{sub}/")
                self.table.unname(sub)

    def unlinking(self, node: Node) -> None:
        """`node` is losing its name (unlink, renamed over): its attributes and size
        stay as they are now (descriptors still open on it fstat them), less its
        link, which moves its ctime. Call it before the write path forgets its
        local bytes; `remove` calls it too."""
        if self.table.linked(node) and not node.is_dir and self.overlay.local_file(node.path) is not None:
            node.attrs, node.size = self.attrs.stat(node)
            node.mtime = node.attrs.mtime_ns / 1e9

    def move(self, old_parent: int, old_name: str, new_parent: int, new_name: str) -> None:
        """Re-key a node (and, for a directory, every known node below it)."""
        src, dst = self.table.get(old_parent), self.table.get(new_parent)
        old_path, new_path = join(src.path, old_name), join(dst.path, new_name)
        top = self.table.at(old_path)
        self.remove(new_parent, new_name)
        if src.children is not None:
            src.children.pop(old_name, None)
        self.attrs.touch_dir(src)
        self.kept.changed(src.key)
        if top is None:
            dst.children_expire = -math.inf  # unknown here: the next lookup re-lists
            return
        below = self.table.below(old_path) if top.is_dir else []
        now = time.time_ns()
        moving = [(path, self.table.at(path)) for path in sorted([old_path, *below])]
        for path, _ in moving:
            self.table.unname(path)
        for path, node in moving:
            assert node is not None
            if node.is_dir:  # its listings, old and new name, are this mount's to tell now
                self.kept.changed(node.key)
            self.attrs.note_record(node.key, None)
            self.table.rename(node, new_path + path[len(old_path):])
            if node.is_dir:
                self.kept.changed(node.key)
            if node is top:  # rename(2) moves the ctime (of its local record too)
                if node.attrs is not None:
                    node.attrs = replace(node.attrs, ctime_ns=now)
                lf = None if node.is_dir else self.overlay.local_file(node.path)
                if lf is not None and lf.attrs is not None:
                    lf.attrs = replace(lf.attrs, ctime_ns=now)
            self.attrs.note(node)
        if dst.children is not None:
            dst.children[new_name] = top.inode
        # A file's new entry comes with its object (`uploaded`: a copy, or its upload)
        self.objects.change(src.key, f"{old_name}/" if top.is_dir else old_name, None)
        if top.is_dir and top.attrs is not None:
            self.objects.change(dst.key, f"{new_name}/", dirattrs.dir_entry(top.attrs))

    def uploaded(self, key: str, info: ObjectInfo) -> None:
        """A local file landed in the store (or an object was copied): take its store
        attributes quietly (and show its name, if a cached listing of its directory
        lacks it: a file put back from quarantine). `info.metadata` is the object's."""
        prefix, _, name = key.rpartition("/")
        prefix = f"{prefix}/" if prefix else ""
        if name == dirattrs.NAME:  # a directory rename's copy of an attribute object
            self.objects.copied(prefix, info)
            return
        self.kept.changed(prefix)
        self._took(key, info)
        node = self.table.at(key)
        if not has_attrs(info.metadata):
            self.objects.change(prefix, name, None)
        elif node is not None and node.attrs is not None:
            self._entry(prefix, name, node.attrs, info.etag, info.mtime, node.link)
        else:
            self._entry(prefix, name, self.attrs.from_head(info), info.etag, info.mtime, None)

    def _took(self, key: str, info: ObjectInfo) -> None:
        node = self.table.at(key)
        if node is not None:
            node.size, node.mtime, node.etag = info.size, info.mtime, info.etag
            node.attr_expire = time.monotonic() + node.settings.attr_ttl
            if has_attrs(info.metadata):
                stored = from_metadata(info.metadata, is_dir=False, defaults=self.attrs.defaults,
                                       store_mtime_ns=int(info.mtime * 1e9))
                if node.attrs is not None:  # a rename's copy: its ctime is this mount's
                    stored = replace(stored, ctime_ns=max(stored.ctime_ns, node.attrs.ctime_ns))
                node.attrs = stored
            self.attrs.note(node)
            return
        parent = self.table.parent_of(key)
        name = key.rpartition("/")[2]
        if parent is not None and parent.is_dir and parent.children is not None and valid_name(name):
            head = self.attrs.from_head(info) if has_attrs(info.metadata) else None
            node = self.attrs.apply_info(self.table.node_for(key, False), info, time.monotonic(),
                                         stored=head)
            parent.children[name] = node.inode
        elif has_attrs(info.metadata):
            # No node shows it yet (a directory rename's copy of a file below it that
            # this mount never looked up): kept for the listing that will show it,
            # which a small object's plain ETag would otherwise leave at the defaults.
            self.attrs.note_record(key, Known(info.etag, 0, self.attrs.from_head(info), None))

    def local_dropped(self, key: str) -> None:
        """A file's local bytes are gone (never acknowledged, or refused): what the
        store has shows again, and a name it never had goes."""
        node = self.table.at(key)
        if node is None or node.is_dir:
            return
        if node.etag:
            node.attr_expire = node.validated_at = -math.inf  # ask the store next time
            self.on_changed(node.inode)
            return
        parent = self.table.parent_of(key)
        if parent is not None:
            name = key.rpartition("/")[2]
            self.remove(parent.inode, name)
            self.on_gone(parent.inode, name)
