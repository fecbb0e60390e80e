"""Directory listings: fetched, shared, kept across remounts, and answered from
the tier-1 index while the store is away (DESIGN §6).

When the store is unreachable, listings are answered from what this mount
listed before and the objects the tier-1 index knows (degraded mode), so data
read before stays reachable. A directory this mount never had the store's
whole listing of is then incomplete: a name missing from it is unknown, not
absent, and is answered with EIO, never ENOENT (a training script that sees
`latest` missing would start over from scratch).
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import trio

import tierfs.namespace.dirattrs as dirattrs
from tierfs.cache import Cache
from tierfs.config import DEGRADED_RETRY, ClassSettings
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings, kept_ttl, listing_settings
from tierfs.namespace.attributes import Attributes
from tierfs.namespace.attrobjects import AttrObjects
from tierfs.namespace.nodes import LocalOverlay, Node, NodeTable, join, valid_name
from tierfs.posix import Known, from_metadata
from tierfs.store.base import UNREACHABLE_KINDS, Listing, ObjectInfo, Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


class Listings:
    def __init__(self, table: NodeTable, attrs: Attributes, objects: AttrObjects, store: Store,
                 cache: Cache, workers: Workers, health: StoreHealth, kept: KeptListings,
                 overlay: LocalOverlay) -> None:
        self.table = table
        self.attrs = attrs
        self.objects = objects
        self.store = store
        self.cache = cache
        self.workers = workers
        self.health = health
        self.kept = kept
        self.overlay = overlay
        self._listing: dict[int, _Pending] = {}
        self._odd_logged: set[str] = set()

    def stale(self, node: Node) -> bool:
        return (
            node.children is None
            or time.monotonic() >= node.children_expire
            or node.children_epoch != self.health.epoch
        )

    def expire(self, node: Node) -> None:
        """The next lookup or readdir of `node` lists it from the store again."""
        node.children_expire = -math.inf

    def expire_below(self, path: str) -> None:
        """Make the listings of `path` and every directory below it stale."""
        for node in self.table.dirs_at_or_below(path):
            node.children_expire = -math.inf

    def known_absent(self, parent_inode: int, name: str) -> bool:
        """Whether the store has no object `name` in that directory as far as this
        mount knows: the directory's listing is current (or it was made here) and
        lacks the name."""
        parent = self.table.find(parent_inode)
        if parent is None or not parent.is_dir or self.stale(parent):
            return False
        assert parent.children is not None
        return name not in parent.children and self.table.at(join(parent.path, name)) is None

    def children_of(self, path: str) -> dict[str, int] | None:
        """The entries (name -> inode) held for directory `path`, if it was listed
        (read/walkahead.py orders them; a new listing is a new dict)."""
        node = self.table.at(path)
        return node.children if node is not None and node.is_dir else None

    def _log_odd(self, key: str, why: str) -> None:
        if key not in self._odd_logged:
            self._odd_logged.add(key)
            log.warning("skipping key %r: %s", key, why)

    async def _fetch(self, node: Node) -> tuple[Listing, bool]:
        """The store's listing, and whether it is complete; while the store is known
        to be down, the index's (incomplete), at once (not after a store deadline
        per directory)."""
        if not self.health.degraded:
            try:
                return await self.workers.meta(self.store.list_dir, node.key), True
            except StoreError as exc:
                if exc.kind not in UNREACHABLE_KINDS:
                    raise
                self.health.mark_down(str(exc))
        return await self.workers.disk(self._from_index, node.key), False

    def _from_index(self, prefix: str) -> Listing:
        files: list[ObjectInfo] = []
        dirs: set[str] = set()
        for obj in self.cache.iter_objects(prefix):
            rest = obj.key[len(prefix) :]
            if not rest:
                continue
            head, sep, _ = rest.partition("/")
            if sep:
                dirs.add(head)
            else:
                files.append(ObjectInfo(obj.key, obj.size, obj.etag, obj.mtime))
        return Listing(files, sorted(dirs))

    async def refresh(self, node: Node) -> None:
        """(Re)list a directory; concurrent callers share one LIST."""
        pending = self._listing.get(node.inode)
        if pending is not None:
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return
        pending = self._listing[node.inode] = _Pending()
        try:
            kept = await self._kept(node.key, node.settings) if node.children is None else None
            taken: float | None = None
            if kept is not None:  # this directory's first listing since the mount
                listing, taken = kept
                complete = True
            else:
                generation = self.kept.generation(node.key)
                listed_at = time.time()
                listing, complete = await self._fetch(node)
            await self._take(node, listing, complete, taken)
            if kept is None and complete:
                ttl = kept_ttl(self.list_settings(node.settings, listing))
                await self.kept.keep(node.key, listing, listed_at, ttl, generation)
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            del self._listing[node.inode]
            pending.done.set()

    async def _take(self, node: Node, listing: Listing, complete: bool,
                    taken: float | None) -> None:
        """Install a listing, with what its directory's attribute object and the
        index tell of its entries."""
        listing, table_info = dirattrs.split(node.key, listing)
        table = None
        if complete:
            self.objects.listed(node.key, table_info)
            if table_info is not None:
                table = await self.objects.table(node.key, table_info)
        known = await self.attrs.known([
            *(i.key for i in listing.files if self._unknown(i, table)),
            *(f"{node.key}{d}/" for d in listing.dirs if self._unknown_dir(node, d))])
        self.install(node, listing, complete, known, taken=taken, table=table)

    async def _kept(self, prefix: str, own: ClassSettings) -> tuple[Listing, float] | None:
        """The listing kept for `prefix` if it is younger than the listing TTL of the
        class it shows, and when it was taken (monotonic)."""
        got = await self.kept.load(prefix)
        if got is None:
            return None
        listing, age = got
        if age >= kept_ttl(self.list_settings(own, listing)):
            return None
        return listing, time.monotonic() - age

    def list_settings(self, own: ClassSettings, listing: Listing) -> ClassSettings:
        """The class whose listing TTL a directory of class `own` with `listing` follows."""
        return listing_settings(own, (self.table.policy.settings(f.key) for f in listing.files
                                      if not f.key.endswith(dirattrs.NAME)))

    def _unknown(self, info: ObjectInfo, table: dirattrs.Table | None) -> bool:
        """Whether the index may know more of `info` than this mount and `table` do."""
        entry = table.file(info.key.rpartition("/")[2]) if table is not None else None
        if entry is not None and dirattrs.describes(entry, info):
            return False
        n = self.table.at(info.key)
        return n is None or n.attrs is None or n.etag != info.etag

    def _unknown_dir(self, parent: Node, name: str) -> bool:
        n = self.table.at(join(parent.path, name))
        return n is None or n.attrs is None

    def install(self, node: Node, listing: Listing, complete: bool = True,
                known: Mapping[str, Known] | None = None, taken: float | None = None,
                table: dirattrs.Table | None = None) -> None:
        """Take a listing. An incomplete one (the index's, the store being away)
        adds to what this mount knew of the directory; if that is nothing at all,
        the directory's entries are unknown: EIO, not an empty directory.
        `taken`: when it was listed (monotonic; a kept listing is older than now):
        it and its entries' attributes expire that long after. `table`: the
        directory's attribute object, whose entries of the versions listed are
        the store's word on them."""
        now = time.monotonic() if taken is None else taken
        children: dict[str, int] = {}
        if not complete and node.children is not None:
            children = self.table.live(node.children)
            complete = node.complete  # what the last whole listing said still stands
        for name in listing.dirs:
            if not valid_name(name):
                self._log_odd(node.key + name + "/", "not a valid directory name")
                continue
            sub = self.table.node_for(join(node.path, name), True)
            # What this node knows of a directory (memory, then the index) stands: the
            # times its entries moved are its own, never stored; else what was set
            # on it explicitly, as its parent's attribute object tells.
            if sub.attrs is None:
                entry = table.dir(name) if table is not None else None
                if known and (k := known.get(sub.key)) is not None:
                    sub.attrs = k.attrs
                elif entry is not None:
                    sub.attrs = from_metadata(entry, is_dir=True, defaults=self.attrs.defaults,
                                              store_mtime_ns=int(sub.mtime * 1e9))
                    self.attrs.note(sub)
                if sub.attrs is not None:
                    sub.mtime = sub.attrs.mtime_ns / 1e9
            children[name] = sub.inode
        for info in listing.files:
            name = info.key[len(node.key) :]
            if not valid_name(name) or "/" in name:
                self._log_odd(info.key, "not a valid file name")
                continue
            if name in children:
                self._log_odd(info.key, "both an object and a prefix; the directory wins")
                continue
            child = self._apply(name, info, now, known.get(info.key) if known else None, table)
            children[name] = child.inode
        files, dirs = self.overlay.local_children(node.key)
        for name in dirs:
            if name not in children:
                children[name] = self.table.node_for(join(node.path, name), True).inode
        for name, lf in files.items():
            child = self.table.node_for(join(node.path, name), False)
            self.attrs.apply_local(child, lf)
            children[name] = child.inode
        if not complete and not children and node.children is None:
            raise OSError(errno.EIO, f"{node.path or '/'}: store unreachable and never listed here")
        node.children = children
        node.complete = complete
        ttl = (DEGRADED_RETRY if self.health.degraded
               else self.list_settings(node.settings, listing).list_ttl)
        node.children_expire = now + ttl
        node.children_epoch = self.health.epoch

    def _apply(self, name: str, info: ObjectInfo, now: float, known: Known | None,
               table: dirattrs.Table | None) -> Node:
        """A listed file's node, with what its directory's attribute object says of it:
        its entry, if of this version; a HEAD is worth it (`ask`) if the entry is
        another version's (the object was replaced, or its metadata changed). No
        entry: the listing tells (dirattrs.implied), or tierfs did not write it."""
        child = self.table.node_for(info.key, False)
        entry = table.file(name) if table is not None else None
        if entry is not None and dirattrs.describes(entry, info):
            stored = from_metadata(entry, is_dir=False, defaults=self.attrs.defaults,
                                   store_mtime_ns=int(info.mtime * 1e9))
            child = self.attrs.apply_info(child, info, now, stored=stored, unknown_only=True,
                                          link=entry.get(dirattrs.LINK), known=known)
            child.ask = False
            return child
        child = self.attrs.apply_info(child, info, now, known=known)
        child.ask = entry is not None
        return child

    async def listed_dir(self, parent: Node, name: str, path: str) -> Node | None:
        """`path` as a directory whose own listing is fresh (listed by this mount or
        kept from an earlier one), found without listing the parent again: a
        directory listed within its TTL exists within it. (A dataset directory in
        a default-class parent, looked up after a remount: 0 LISTs.)"""
        node = self.table.at(path)
        if node is not None and node.is_dir and not self.stale(node):
            return node
        if (node is not None and not node.is_dir) or self.health.degraded:
            return None
        kept = await self._kept(f"{path}/", self.table.policy.settings(path))
        if kept is None:
            return None
        listing, taken = kept
        node = self.table.node_for(path, True)
        if node.children is None:  # (another lookup may have listed it meanwhile)
            await self._take(node, listing, True, taken)
        if parent.children is not None:
            parent.children[name] = node.inode
        return node
