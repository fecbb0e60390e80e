"""The namespace's face: lookups, listings, revalidation, and the changes this
mount makes, over the inode table (nodes.py), attribute knowledge
(attributes.py), listings (listings.py), changes (changes.py) and directories'
attribute objects (attrobjects.py, whose writer `objects.run` the composition
root starts)."""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterable

import trio

from tierfs.cache import Cache
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings
from tierfs.namespace.attributes import Attributes
from tierfs.namespace.attrobjects import AttrObjects
from tierfs.namespace.changes import Changes
from tierfs.namespace.listings import Listings
from tierfs.namespace.nodes import (
    LocalOverlay,
    Node,
    NodeTable,
    absent,
    bad_name_errno,
    join,
    valid_name,
)
from tierfs.policy import Policy
from tierfs.posix import SYMLINK_MAX, Attrs, Defaults
from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.workers import Workers

# One open(2) is a lookup, an open and an fstat: the lookup's HEAD serves all three.
STRICT_REUSE = 1.0


class Namespace:
    def __init__(
        self,
        store: Store,
        cache: Cache,
        policy: Policy,
        workers: Workers,
        *,
        health: StoreHealth,
        kept: KeptListings,
        overlay: LocalOverlay,
        on_changed: Callable[[int], None],
        on_gone: Callable[[int, str], None],
        defaults: Defaults,
    ) -> None:
        self.store = store
        self.policy = policy
        self.workers = workers
        self.health = health
        self.overlay = overlay
        self.defaults = defaults
        self.table = NodeTable(policy, time.time())
        self.attrs = Attributes(self.table, store, cache, workers, overlay, defaults,
                                on_changed=on_changed, on_gone=on_gone)
        self.objects = AttrObjects(store, cache, workers)
        self.listings = Listings(self.table, self.attrs, self.objects, store, cache, workers,
                                 health, kept, overlay)
        self.changes = Changes(self.table, self.attrs, self.objects, store, health, kept, overlay,
                               on_changed=on_changed, on_gone=on_gone)

    # -- the table and what is known (for fs, tree, the read and write paths) ------------

    def get(self, inode: int) -> Node:
        return self.table.get(inode)

    def current(self, node: Node) -> Node:
        return self.table.current(node)

    def linked(self, node: Node) -> bool:
        return self.table.linked(node)

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        self.table.forget(items)

    def stat(self, node: Node) -> tuple[Attrs, int]:
        return self.attrs.stat(node)

    def nlink(self, node: Node) -> int:
        return self.attrs.nlink(node)

    def set_attrs(self, node: Node, attrs: Attrs, *, etag: str | None = None,
                  stored_at: float | None = None) -> None:
        self.changes.set_attrs(node, attrs, etag=etag, stored_at=stored_at)

    def learn(self, key: str, etag: str, metadata: dict[str, str]) -> None:
        self.attrs.learn(key, etag, metadata)

    async def remember(self) -> None:
        await self.attrs.remember()

    async def readlink(self, node: Node) -> str:
        return await self.attrs.readlink(node)

    def known_absent(self, parent_inode: int, name: str) -> bool:
        return self.listings.known_absent(parent_inode, name)

    def children_of(self, path: str) -> dict[str, int] | None:
        return self.listings.children_of(path)

    def expire_listing(self, node: Node) -> None:
        self.listings.expire(node)

    def stored_file(self, inode: int) -> ObjectInfo | None:
        """A file's store attributes as last listed or checked; None for a directory
        or a file that exists only here."""
        node = self.table.find(inode)
        if node is None or node.is_dir or not node.etag:
            return None
        return ObjectInfo(node.path, node.size, node.etag, node.mtime)

    # -- lookups -----------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: str) -> Node:
        parent = self.get(parent_inode)
        if not parent.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        if not valid_name(name):
            raise OSError(bad_name_errno(name, errno.ENOENT), "no such entry")
        path = join(parent.path, name)
        if self.policy.settings(path).revalidate_on_open:
            node = await self._lookup_strict(parent, name, path)
        else:
            stale = self.listings.stale(parent)
            found = await self.listings.listed_dir(parent, name, path) if stale else None
            if found is not None:
                node = found
            else:
                if self.listings.stale(parent):
                    await self.listings.refresh(parent)
                assert parent.children is not None
                inode = parent.children.get(name)
                if inode is None:
                    raise absent(parent)
                node = self.get(inode)
                if self.untyped(node):  # a symlink or FIFO of another node's? one HEAD tells
                    await self.revalidate(node)
                    node = self.table.current(node)
                    parent.children[name] = node.inode
        node.lookups += 1
        return node

    async def _lookup_strict(self, parent: Node, name: str, path: str) -> Node:
        """Manifest-class lookup: the store's word, never the listing cache
        (unless the file is being written here: then ours)."""
        lf = self.overlay.local_file(path)
        if lf is not None:
            node = self.table.node_for(path, False)
            self.attrs.apply_local(node, lf)
            if parent.children is not None:
                parent.children[name] = node.inode
            return node
        try:
            info = await self._head(path)
        except StoreError as exc:
            if exc.kind not in UNREACHABLE_KINDS:
                raise
            cached = await self.workers.disk(self.listings.cache.lookup, path)
            if cached is None:
                raise
            info = ObjectInfo(cached.key, cached.size, cached.etag, cached.mtime)
        if info is not None:
            node = self.table.node_for(path, False)
            if node.etag != info.etag:
                # A new or changed manifest vouches for files in its directory
                # subtree: listings cached from before it may not show them yet.
                self.listings.expire_below(parent.path)
            node = self.attrs.apply_info(node, info, time.monotonic(),
                                         stored=self.attrs.from_head(info))
            node.validated_at = time.monotonic()
            await self.remember()
        else:
            # Not an object; perhaps a prefix. A listing of the parent decides.
            if self.listings.stale(parent):
                await self.listings.refresh(parent)
            assert parent.children is not None
            inode = parent.children.get(name)
            if inode is None or not self.get(inode).is_dir:
                parent.children.pop(name, None)
                raise absent(parent)
            node = self.get(inode)
        if parent.children is not None:
            parent.children[name] = node.inode
        return node

    def untyped(self, node: Node) -> bool:
        """Whether a HEAD is worth it for `node`'s attributes, in a class that asks:
        its directory's attribute object says the listing cannot tell (`ask`), or
        it may be a symlink or FIFO this mount cannot tell from a regular file yet
        (a small object of unknown attributes listed with an ETag that tierfs's
        typed objects have: Store.may_be_typed)."""
        return (node.attrs is None and not node.is_dir and bool(node.etag)
                and node.settings.type_small_objects and not self.health.degraded
                and (node.ask or (node.size <= SYMLINK_MAX
                                  and self.store.may_be_typed(node.etag))))

    async def getattr(self, inode: int) -> Node:
        node = self.get(inode)
        if node.is_dir or time.monotonic() < node.attr_expire or not self.linked(node):
            return node
        await self.revalidate(node)
        return node

    async def opening(self, node: Node) -> None:
        """What an open asks the store first: a revalidating class, the current
        version; an empty object of unknown attributes, in a class that types
        small objects, its attributes: a read of it fetches nothing, so no GET's
        headers teach them as they do for other objects (a HEAD, once)."""
        if node.settings.revalidate_on_open:
            await self.revalidate(node)
        elif (node.size == 0 and node.attrs is None and bool(node.etag) and not node.is_dir
              and node.settings.type_small_objects and not self.health.degraded):
            with contextlib.suppress(OSError, StoreError):
                info = await self._head(node.key)
                if info is not None:
                    self.learn(node.key, info.etag, info.metadata)
                    await self.remember()

    async def revalidate(self, node: Node, *, remember: bool = True) -> None:
        """HEAD a file and take what the store says; ENOENT if it is gone.
        A file written on this node and not yet uploaded is its own truth; a HEAD
        within STRICT_REUSE seconds (the lookup of this same open) is reused.
        `remember=False`: the caller writes the learned attributes to the index
        (one transaction for many HEADs)."""
        if not self.linked(node):
            return  # unlinked while open: what it was is all there is to it
        lf = self.overlay.local_file(node.path)
        if lf is not None:
            self.attrs.apply_local(node, lf)
            return
        if time.monotonic() - node.validated_at < STRICT_REUSE:
            return
        try:
            info = await self._head(node.path)
        except StoreError as exc:
            if exc.kind in UNREACHABLE_KINDS and node.etag:
                return  # degraded: keep serving what we know
            raise
        if info is None:
            raise OSError(errno.ENOENT, "object no longer exists")
        current = self.attrs.apply_info(node, info, time.monotonic(),
                                         stored=self.attrs.from_head(info))
        node.validated_at = current.validated_at = time.monotonic()
        if remember:
            await self.remember()

    async def readdir(self, inode: int) -> list[tuple[str, Node]]:
        node = self.get(inode)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        if self.listings.stale(node):
            await self.listings.refresh(node)
        assert node.children is not None
        untyped = [n for i in node.children.values() if self.untyped(n := self.get(i))]
        if untyped:  # `ls -l`: their HEADs at once, not one lookup after the other
            try:
                async with trio.open_nursery() as nursery:
                    for child in untyped:
                        nursery.start_soon(self._type, child)
            finally:  # what they taught, in one index transaction (not one per HEAD)
                with trio.CancelScope(shield=True):
                    await self.remember()
        return sorted((name, self.get(i)) for name, i in node.children.items())

    async def _type(self, node: Node) -> None:
        """Learn a small object's attributes (is it a symlink?) by HEAD; one that is
        gone or unreachable stays as the listing showed it."""
        with contextlib.suppress(OSError, StoreError):
            await self.revalidate(node, remember=False)

    async def refresh(self, key: str) -> ObjectInfo:
        """The store's current version of `key` (a HEAD, whatever was cached)."""
        info = await self._head(key)
        if info is None:
            raise OSError(errno.ENOENT, f"{key}: no longer in the store")
        node = self.table.at(key)
        if node is not None and not node.is_dir:
            node = self.attrs.apply_info(node, info, time.monotonic(),
                                         stored=self.attrs.from_head(info))
            node.validated_at = time.monotonic()
            await self.remember()
        return info

    async def _head(self, path: str) -> ObjectInfo | None:
        if self.health.degraded:
            raise StoreError("store unreachable (degraded mode)", kind="unreachable")
        try:
            return await self.workers.meta(self.store.head, path)
        except StoreError as exc:
            if exc.errno == errno.ENOENT:
                return None
            if exc.kind in UNREACHABLE_KINDS:
                self.health.mark_down(str(exc))
            raise

    # -- changes made through this mount ------------------------------------------------

    def check_new(self, parent_inode: int, name: str, *, is_dir: bool) -> None:
        self.changes.check_new(parent_inode, name, is_dir=is_dir)

    def add(self, parent_inode: int, name: str, *, is_dir: bool, attrs: Attrs, size: int = 0,
            etag: str = "", link: str | None = None, stored_at: float | None = None) -> Node:
        return self.changes.add(parent_inode, name, is_dir=is_dir, attrs=attrs, size=size,
                                etag=etag, link=link, stored_at=stored_at)

    def remove(self, parent_inode: int, name: str) -> None:
        self.changes.remove(parent_inode, name)

    def unlinking(self, node: Node) -> None:
        self.changes.unlinking(node)

    def move(self, old_parent: int, old_name: str, new_parent: int, new_name: str) -> None:
        self.changes.move(old_parent, old_name, new_parent, new_name)

    async def uploaded(self, key: str, info: ObjectInfo) -> None:
        self.changes.uploaded(key, info)
        await self.remember()

    def local_dropped(self, key: str) -> None:
        self.changes.local_dropped(key)

    async def removing_dir(self, node: Node) -> None:
        """rmdir of `node` (checked empty): its attribute object goes first."""
        await self.objects.removed(node.key)

    async def moving_dir(self, node: Node, new_key: str) -> None:
        """A rename of directory `node` to `new_key` is about to copy what is below
        it; `moved_dir` with its old key once it is over (done or failed)."""
        await self.objects.moving(node.key, new_key)

    def moved_dir(self, old_key: str) -> None:
        self.objects.moved(old_key)

    async def settle(self, prefix: str) -> None:
        """Write the attribute objects this mount changed at or below `prefix` now
        (`tierfs flush`, umount): another node lists what this one did."""
        await self.objects.settle(prefix)
