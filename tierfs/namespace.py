"""Inodes, dentries and the attribute/listing cache (DESIGN §6).

Directories are key prefixes, files are objects. Inode numbers are stable for
the life of a mount (a path keeps its inode unless it changes kind). What a
listing or HEAD taught us is trusted for the class TTL of each entry; strict
(manifest) paths are re-checked against the store on every lookup.

When the store is unreachable, listings are answered from what this mount
listed before and the objects the tier-1 index knows (degraded mode), so data
read before stays reachable. A directory this mount never had the store's
whole listing of is then incomplete: a name missing from it is unknown, not
absent, and is answered with EIO, never ENOENT (a training script that sees
`latest` missing would start over from scratch).

POSIX attributes (mode, owner, times; symlink targets) are object metadata
(posix.py), which listings do not carry. A node's `attrs` are None until
known: from a HEAD, from this mount's own changes, or from the record the
tier-1 index keeps per object version (what this node learned before a
remount). Unknown attributes show the mount's defaults; what is known is
never contradicted by a later listing of the same version.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from tierfs.cache import Cache
from tierfs.config import DEGRADED_RETRY, ClassSettings
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings, kept_ttl
from tierfs.policy import Policy
from tierfs.posix import (
    SYMLINK_MAX,
    Attrs,
    Defaults,
    Known,
    default_attrs,
    from_metadata,
    has_attrs,
)
from tierfs.store.base import UNREACHABLE_KINDS, Listing, ObjectInfo, Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)

ROOT_INODE = 1
NAME_MAX = 255
# One open(2) is a lookup, an open and an fstat: the lookup's HEAD serves all three.
STRICT_REUSE = 1.0


@dataclass
class Node:
    inode: int
    path: str  # '' for the root, else 'a/b' (no leading or trailing slash)
    is_dir: bool
    settings: ClassSettings
    size: int = 0
    mtime: float = 0.0
    etag: str = ""
    attr_expire: float = 0.0  # monotonic deadline of the attributes
    children: dict[str, int] | None = None  # name -> inode, once listed
    children_expire: float = -math.inf
    children_epoch: int = 0  # StoreHealth.epoch when listed: a return of the store voids it
    # Whether `children` holds every name of the store's last whole listing (or
    # the directory was made here). False: pieced together from the index while
    # the store was away; a name missing from it may still exist.
    complete: bool = True
    lookups: int = 0  # kernel references (lookup counts minus forgets)
    validated_at: float = -math.inf  # monotonic time of the last HEAD
    attrs: Attrs | None = None  # POSIX attributes, once known (None: the mount's defaults)
    link: str | None = None  # a symlink's target, once read

    @property
    def key(self) -> str:
        """The object key (files) or key prefix (directories)."""
        if self.is_dir:
            return f"{self.path}/" if self.path else ""
        return self.path


class LocalFile(Protocol):
    size: int
    mtime_ns: int
    attrs: Attrs | None

    @property
    def mtime(self) -> float: ...


class LocalOverlay(Protocol):
    """Files that exist only on this node (written, not yet uploaded): the write
    path's journal (writeback/journal.py)."""

    def local_file(self, key: str) -> LocalFile | None: ...

    def local_children(self, prefix: str) -> tuple[Mapping[str, LocalFile], set[str]]: ...


@dataclass
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _bad_name_errno(name: str, otherwise: int) -> int:
    """ENAMETOOLONG for a name over NAME_MAX bytes, else `otherwise`."""
    return errno.ENAMETOOLONG if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX else otherwise


def _absent(parent: Node) -> OSError:
    """A name missing from `parent`'s listing: ENOENT if that listing is the
    store's, EIO if it was pieced together while the store was away."""
    if parent.complete:
        return OSError(errno.ENOENT, "no such entry")
    return OSError(errno.EIO, "store unreachable: cannot tell whether it exists")


def valid_name(name: str) -> bool:
    """Whether a key segment can be a POSIX file name."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\0" not in name
        and len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX
    )


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
        self.cache = cache
        self.policy = policy
        self.workers = workers
        self.health = health
        self.kept = kept
        self.overlay = overlay
        self.on_changed = on_changed  # an inode's object changed: drop the kernel's pages
        self.on_gone = on_gone  # a name the kernel may remember is gone
        self._nodes: dict[int, Node] = {}
        self._by_path: dict[str, int] = {}
        self._next_inode = ROOT_INODE + 1
        self._listing: dict[int, _Pending] = {}
        self._odd_logged: set[str] = set()
        self.mount_time = time.time()
        self.defaults = defaults
        self._remember: dict[str, bytes | None] = {}  # attribute records not yet in the index
        root = Node(ROOT_INODE, "", True, policy.settings(""), mtime=self.mount_time)
        self._nodes[ROOT_INODE] = root
        self._by_path[""] = ROOT_INODE

    # -- table -----------------------------------------------------------------

    def get(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise OSError(errno.ENOENT, "stale inode") from None

    def _node_for(self, path: str, is_dir: bool) -> Node:
        """The node of `path`, created if new; a change of kind gets a new inode."""
        inode = self._by_path.get(path)
        if inode is not None:
            node = self._nodes[inode]
            if node.is_dir == is_dir:
                return node
        node = Node(self._next_inode, path, is_dir, self.policy.settings(path))
        if is_dir:
            node.mtime = self.mount_time
        self._next_inode += 1
        self._nodes[node.inode] = node
        self._by_path[path] = node.inode
        return node

    def _apply_info(self, node: Node, info: ObjectInfo, now: float, *, headed: bool = False,
                    known: Known | None = None) -> Node:
        """Record an object's attributes. An object replaced in the store by someone
        else gets a new inode, like a file replaced by rename on a local disk: with
        the kernel's write-back cache on, the kernel trusts its own cached size of
        an inode over ours, so the old inode could never show the new size. Handles
        open on the old inode keep reading the old version; its pages are dropped."""
        fresh = False
        if node.etag and node.etag != info.etag:
            self.on_changed(node.inode)
            node, fresh = self._renode(node), True
        if headed:  # the store's word on the version: its metadata, or nothing (defaults)
            attrs = from_metadata(info.metadata, is_dir=False, defaults=self.defaults,
                                  store_mtime_ns=int(info.mtime * 1e9))
            if not fresh and node.attrs is None and node.etag and not self._shown_as(node, attrs):
                node = self._renode(node)
            if attrs != node.attrs:
                node.attrs, node.link = attrs, None
                self._note(node)
        elif known is not None and node.attrs is None and known.etag == info.etag:
            node.attrs, node.link = known.attrs, known.link
        node.size, node.mtime, node.etag = info.size, info.mtime, info.etag
        node.attr_expire = now + node.settings.attr_ttl
        return node

    def _renode(self, old: Node) -> Node:
        """A new inode for `old`'s name (its handles keep the old one)."""
        node = Node(self._next_inode, old.path, False, old.settings, validated_at=old.validated_at,
                    size=old.size, mtime=old.mtime, etag=old.etag)
        self._next_inode += 1
        self._nodes[node.inode] = node
        self._by_path[node.path] = node.inode
        parent_path, _, name = node.path.rpartition("/")
        parent = self._nodes.get(self._by_path.get(parent_path, 0))
        if parent is not None and parent.children is not None and name in parent.children:
            parent.children[name] = node.inode
        return node

    def _shown_as(self, node: Node, attrs: Attrs) -> bool:
        """Whether the kernel, told `node`'s defaults, shows `attrs`' times. With the
        write-back cache it keeps a regular file's mtime and ctime as first told:
        learning other times takes a new inode (as a new version of the object does)."""
        shown = int(node.mtime * 1e9)
        return attrs.mtime_ns == attrs.ctime_ns == shown

    # -- POSIX attributes ------------------------------------------------------

    def stat(self, node: Node) -> tuple[Attrs, int]:
        """A node's attributes and size, as stat shows them (an unlinked node's were
        frozen when its name went: what now has its name is another file)."""
        a = node.attrs
        if node.is_dir:
            return a or default_attrs(stat.S_IFDIR, self.defaults, int(node.mtime * 1e9)), 0
        lf = self.overlay.local_file(node.path) if self.linked(node) else None
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
        if not self.linked(node):
            return 0
        if not node.is_dir:
            return 1
        kids = node.children or {}
        return 2 + sum(1 for i in kids.values() if (n := self._nodes.get(i)) is not None and n.is_dir)

    def current(self, node: Node) -> Node:
        """The node now at `node`'s name (a newer version takes a new inode)."""
        inode = self._by_path.get(node.path)
        return node if inode is None else self._nodes[inode]

    def linked(self, node: Node) -> bool:
        """Whether `node` still has its name (not unlinked, renamed over or replaced)."""
        return node.inode == ROOT_INODE or self._by_path.get(node.path) == node.inode

    def set_attrs(self, node: Node, attrs: Attrs, *, etag: str | None = None,
                  link: str | None = None) -> None:
        """Attributes this mount gave `node` (and the object's new ETag, if it has one)."""
        if etag is not None:
            node.etag = etag
        node.attrs = attrs
        if link is not None:
            node.link = link
        self._note(node)

    def touch_dir(self, inode: int) -> None:
        """An entry was added to or removed from a directory: its mtime and ctime move."""
        node = self._nodes.get(inode)
        if node is None or not node.is_dir:
            return
        now = time.time_ns()
        base, _ = self.stat(node)
        node.mtime = now / 1e9
        self.set_attrs(node, replace(base, mtime_ns=now, ctime_ns=now))

    def _note(self, node: Node) -> None:
        """Keep `node`'s attributes in the index (on the next `remember`)."""
        if node.attrs is not None:
            self._remember[node.key] = Known(node.etag, 0, node.attrs, node.link).pack()

    def learn(self, key: str, etag: str, metadata: dict[str, str]) -> None:
        """A GET's response showed the attributes of `key` at `etag`: take them if they
        were unknown (the kernel is told to ask again: one invalidation per version)."""
        inode = self._by_path.get(key)
        node = None if inode is None else self._nodes[inode]
        if node is None or node.is_dir or node.attrs is not None or node.etag != etag:
            return
        if not has_attrs(metadata):
            return
        attrs = from_metadata(metadata, is_dir=False, defaults=self.defaults,
                              store_mtime_ns=int(node.mtime * 1e9))
        self.on_changed(node.inode)
        if not self._shown_as(node, attrs):
            node = self._renode(node)
            parent_path, _, name = key.rpartition("/")
            parent_inode = self._by_path.get(parent_path)
            if parent_inode is not None:
                self.on_gone(parent_inode, name)  # the kernel looks the name up again
        node.attrs = attrs
        self._note(node)

    async def remember(self) -> None:
        """Write the attribute records noted since the last call."""
        if self._remember:
            batch, self._remember = self._remember, {}
            await self.workers.disk(self.cache.set_attrs, batch)

    async def _known(self, keys: list[str]) -> dict[str, Known]:
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
            self._note(node)
            await self.remember()
        return node.link

    def _apply_local(self, node: Node, lf: LocalFile) -> None:
        node.size, node.mtime, node.etag = lf.size, lf.mtime, ""
        node.attr_expire = time.monotonic() + node.settings.attr_ttl

    def _expire_listings(self, path: str) -> None:
        """Make the listings of `path` and every directory below it stale."""
        below = f"{path}/" if path else ""
        for p, inode in self._by_path.items():
            if p == path or p.startswith(below):
                node = self._nodes[inode]
                if node.is_dir:
                    node.children_expire = -math.inf

    def known_absent(self, parent_inode: int, name: str) -> bool:
        """Whether the store has no object `name` in that directory as far as this
        mount knows: the directory's listing is current (or it was made here) and
        lacks the name."""
        parent = self._nodes.get(parent_inode)
        if parent is None or not parent.is_dir or self._listing_stale(parent):
            return False
        assert parent.children is not None
        return name not in parent.children and join(parent.path, name) not in self._by_path

    def _listing_stale(self, node: Node) -> bool:
        return (
            node.children is None
            or time.monotonic() >= node.children_expire
            or node.children_epoch != self.health.epoch
        )

    def children_of(self, path: str) -> dict[str, int] | None:
        """The entries (name -> inode) held for directory `path`, if it was listed
        (read/walkahead.py orders them; a new listing is a new dict)."""
        inode = self._by_path.get(path)
        node = self._nodes.get(inode) if inode is not None else None
        return node.children if node is not None and node.is_dir else None

    def stored_file(self, inode: int) -> ObjectInfo | None:
        """A file's store attributes as last listed or checked; None for a directory
        or a file that exists only here."""
        node = self._nodes.get(inode)
        if node is None or node.is_dir or not node.etag:
            return None
        return ObjectInfo(node.path, node.size, node.etag, node.mtime)

    def expire_listing(self, node: Node) -> None:
        """The next lookup or readdir of `node` lists it from the store again."""
        node.children_expire = -math.inf

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        for inode, count in items:
            node = self._nodes.get(inode)
            if node is not None:
                node.lookups = max(0, node.lookups - count)

    def _log_odd(self, key: str, why: str) -> None:
        if key not in self._odd_logged:
            self._odd_logged.add(key)
            log.warning("skipping key %r: %s", key, why)

    # -- store access ----------------------------------------------------------

    async def _fetch_listing(self, node: Node) -> tuple[Listing, bool]:
        """The store's listing, and whether it is complete; while the store is known
        to be down, the index's (incomplete), at once (not after a store deadline
        per directory)."""
        if not self.health.degraded:
            try:
                return await self.workers.meta(self.store.list_dir, node.key), True
            except StoreError as exc:
                if exc.kind not in UNREACHABLE_KINDS:
                    raise
                self._store_down(exc)
        return await self.workers.disk(self._listing_from_index, node.key), False

    def _store_down(self, exc: StoreError) -> None:
        self.health.mark_down(str(exc))

    def _listing_from_index(self, prefix: str) -> Listing:
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

    async def _refresh_children(self, node: Node) -> None:
        """(Re)list a directory; concurrent callers share one LIST."""
        pending = self._listing.get(node.inode)
        if pending is not None:
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return
        pending = self._listing[node.inode] = _Pending()
        try:
            ttl = kept_ttl(node.settings)
            kept = await self.kept.load(node.key, ttl) if node.children is None else None
            taken: float | None = None
            if kept is not None:  # this directory's first listing since the mount
                listing, left = kept
                complete, taken = True, time.monotonic() - (ttl - left)
            else:
                generation = self.kept.generation(node.key)
                listed_at = time.time()
                listing, complete = await self._fetch_listing(node)
            known = await self._known([
                *(i.key for i in listing.files if self._unknown(i)),
                *(f"{node.key}{d}/" for d in listing.dirs if self._unknown_dir(node, d))])
            self._install_listing(node, listing, complete, known, taken=taken)
            if kept is None and complete:
                await self.kept.keep(node.key, listing, listed_at, ttl, generation)
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            del self._listing[node.inode]
            pending.done.set()

    def _unknown(self, info: ObjectInfo) -> bool:
        inode = self._by_path.get(info.key)
        n = None if inode is None else self._nodes[inode]
        return n is None or n.attrs is None or n.etag != info.etag

    def _unknown_dir(self, parent: Node, name: str) -> bool:
        inode = self._by_path.get(join(parent.path, name))
        return inode is None or self._nodes[inode].attrs is None

    def _install_listing(self, node: Node, listing: Listing, complete: bool = True,
                         known: Mapping[str, Known] | None = None,
                         taken: float | None = None) -> None:
        """Take a listing. An incomplete one (the index's, the store being away)
        adds to what this mount knew of the directory; if that is nothing at all,
        the directory's entries are unknown: EIO, not an empty directory.
        `taken`: when it was listed (monotonic; a kept listing is older than now):
        it and its entries' attributes expire that long after."""
        now = time.monotonic() if taken is None else taken
        children: dict[str, int] = {}
        if not complete and node.children is not None:
            children = {n: i for n, i in node.children.items() if i in self._nodes}
            complete = node.complete  # what the last whole listing said still stands
        for name in listing.dirs:
            if not valid_name(name):
                self._log_odd(node.key + name + "/", "not a valid directory name")
                continue
            sub = self._node_for(join(node.path, name), True)
            if sub.attrs is None and known and (k := known.get(sub.key)) is not None:
                sub.attrs = k.attrs
                sub.mtime = k.attrs.mtime_ns / 1e9
            children[name] = sub.inode
        for info in listing.files:
            name = info.key[len(node.key) :]
            if not valid_name(name) or "/" in name:
                self._log_odd(info.key, "not a valid file name")
                continue
            if name in children:
                self._log_odd(info.key, "both an object and a prefix; the directory wins")
                continue
            child = self._node_for(info.key, False)
            child = self._apply_info(child, info, now, known=known.get(info.key) if known else None)
            children[name] = child.inode
        files, dirs = self.overlay.local_children(node.key)
        for name in dirs:
            if name not in children:
                children[name] = self._node_for(join(node.path, name), True).inode
        for name, lf in files.items():
            child = self._node_for(join(node.path, name), False)
            self._apply_local(child, lf)
            children[name] = child.inode
        if not complete and not children and node.children is None:
            raise OSError(errno.EIO, f"{node.path or '/'}: store unreachable and never listed here")
        node.children = children
        node.complete = complete
        ttl = DEGRADED_RETRY if self.health.degraded else node.settings.list_ttl
        node.children_expire = now + ttl
        node.children_epoch = self.health.epoch

    async def _head(self, path: str) -> ObjectInfo | None:
        if self.health.degraded:
            raise StoreError("store unreachable (degraded mode)", kind="unreachable")
        try:
            return await self.workers.meta(self.store.head, path)
        except StoreError as exc:
            if exc.errno == errno.ENOENT:
                return None
            if exc.kind in UNREACHABLE_KINDS:
                self._store_down(exc)
            raise

    # -- operations ------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: str) -> Node:
        parent = self.get(parent_inode)
        if not parent.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        if not valid_name(name):
            raise OSError(_bad_name_errno(name, errno.ENOENT), "no such entry")
        path = join(parent.path, name)
        settings = self.policy.settings(path)
        if settings.revalidate_on_open:
            node = await self._lookup_strict(parent, name, path)
        else:
            found = await self._listed_dir(parent, name, path) if self._listing_stale(parent) else None
            if found is not None:
                node = found
            else:
                if self._listing_stale(parent):
                    await self._refresh_children(parent)
                assert parent.children is not None
                inode = parent.children.get(name)
                if inode is None:
                    raise _absent(parent)
                node = self._nodes[inode]
                if self.untyped(node):  # a symlink or FIFO of another node's? one HEAD tells
                    await self.revalidate(node)
                    node = self._nodes[self._by_path[path]]
                    parent.children[name] = node.inode
        node.lookups += 1
        return node

    def untyped(self, node: Node) -> bool:
        """Whether `node` may be a symlink or FIFO this mount cannot tell from a regular
        file yet (a small object of unknown attributes, in a class that asks, listed
        with an ETag that tierfs's typed objects have: Store.may_be_typed)."""
        return (node.attrs is None and not node.is_dir and bool(node.etag)
                and node.size <= SYMLINK_MAX and node.settings.type_small_objects
                and self.store.may_be_typed(node.etag) and not self.health.degraded)

    async def _listed_dir(self, parent: Node, name: str, path: str) -> Node | None:
        """`path` as a directory whose own listing is fresh (listed by this mount or
        kept from an earlier one), found without listing the parent again: a
        directory listed within its TTL exists within it. (A dataset directory in
        a default-class parent, looked up after a remount: 0 LISTs.)"""
        inode = self._by_path.get(path)
        node = self._nodes.get(inode) if inode is not None else None
        if node is not None and node.is_dir and not self._listing_stale(node):
            return node
        if (node is not None and not node.is_dir) or self.health.degraded:
            return None
        settings = self.policy.settings(path)
        ttl = kept_ttl(settings)
        kept = await self.kept.load(f"{path}/", ttl)
        if kept is None:
            return None
        listing, left = kept
        node = self._node_for(path, True)
        if node.children is None:  # (another lookup may have listed it meanwhile)
            self._install_listing(node, listing, taken=time.monotonic() - (ttl - left))
        if parent.children is not None:
            parent.children[name] = node.inode
        return node

    async def _lookup_strict(self, parent: Node, name: str, path: str) -> Node:
        """Manifest-class lookup: the store's word, never the listing cache
        (unless the file is being written here: then ours)."""
        lf = self.overlay.local_file(path)
        if lf is not None:
            node = self._node_for(path, False)
            self._apply_local(node, lf)
            if parent.children is not None:
                parent.children[name] = node.inode
            return node
        try:
            info = await self._head(path)
        except StoreError as exc:
            if exc.kind not in UNREACHABLE_KINDS:
                raise
            cached = await self.workers.disk(self.cache.lookup, path)
            if cached is None:
                raise
            info = ObjectInfo(cached.key, cached.size, cached.etag, cached.mtime)
        if info is not None:
            node = self._node_for(path, False)
            if node.etag != info.etag:
                # A new or changed manifest vouches for files in its directory
                # subtree: listings cached from before it may not show them yet.
                self._expire_listings(parent.path)
            node = self._apply_info(node, info, time.monotonic(), headed=True)
            node.validated_at = time.monotonic()
            await self.remember()
        else:
            # Not an object; perhaps a prefix. A listing of the parent decides.
            if self._listing_stale(parent):
                await self._refresh_children(parent)
            assert parent.children is not None
            inode = parent.children.get(name)
            if inode is None or not self._nodes[inode].is_dir:
                if parent.children is not None:
                    parent.children.pop(name, None)
                raise _absent(parent)
            node = self._nodes[inode]
        if parent.children is not None:
            parent.children[name] = node.inode
        return node

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
            self._apply_local(node, lf)
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
        current = self._apply_info(node, info, time.monotonic(), headed=True)
        node.validated_at = current.validated_at = time.monotonic()
        if remember:
            await self.remember()

    async def readdir(self, inode: int) -> list[tuple[str, Node]]:
        node = self.get(inode)
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        if self._listing_stale(node):
            await self._refresh_children(node)
        assert node.children is not None
        untyped = [n for i in node.children.values() if self.untyped(n := self._nodes[i])]
        if untyped:  # `ls -l`: their HEADs at once, not one lookup after the other
            try:
                async with trio.open_nursery() as nursery:
                    for child in untyped:
                        nursery.start_soon(self._type, child)
            finally:  # what they taught, in one index transaction (not one per HEAD)
                with trio.CancelScope(shield=True):
                    await self.remember()
        return sorted((name, self._nodes[i]) for name, i in node.children.items())

    async def _type(self, node: Node) -> None:
        """Learn a small object's attributes (is it a symlink?) by HEAD; one that is
        gone or unreachable stays as the listing showed it."""
        with contextlib.suppress(OSError, StoreError):
            await self.revalidate(node, remember=False)

    def size_mtime(self, node: Node) -> tuple[int, float]:
        """A file's size and mtime: its local bytes' if it is being written here."""
        lf = None if node.is_dir or not self.linked(node) else self.overlay.local_file(node.path)
        return (node.size, node.mtime) if lf is None else (lf.size, lf.mtime)

    async def refresh(self, key: str) -> ObjectInfo:
        """The store's current version of `key` (a HEAD, whatever was cached)."""
        info = await self._head(key)
        if info is None:
            raise OSError(errno.ENOENT, f"{key}: no longer in the store")
        inode = self._by_path.get(key)
        if inode is not None and not self._nodes[inode].is_dir:
            node = self._apply_info(self._nodes[inode], info, time.monotonic(), headed=True)
            node.validated_at = time.monotonic()
            await self.remember()
        return info

    # -- changes made through this mount ----------------------------------------

    def local_dropped(self, key: str) -> None:
        """A file's local bytes are gone (never acknowledged, or refused): what the
        store has shows again, and a name it never had goes."""
        inode = self._by_path.get(key)
        if inode is None:
            return
        node = self._nodes[inode]
        if node.is_dir:
            return
        if node.etag:
            node.attr_expire = node.validated_at = -math.inf  # ask the store next time
            self.on_changed(node.inode)
            return
        parent_path, _, name = key.rpartition("/")
        parent_inode = self._by_path.get(parent_path)
        if parent_inode is not None:
            self.remove(parent_inode, name)
            self.on_gone(parent_inode, name)

    def check_new(self, parent_inode: int, name: str, *, is_dir: bool) -> None:
        """Before a create, mkdir or rename writes anything: `name` must be a valid
        file name whose key the store can take (ENAMETOOLONG, EINVAL otherwise)."""
        parent = self.get(parent_inode)
        if not valid_name(name):
            raise OSError(_bad_name_errno(name, errno.EINVAL), "invalid name")
        key = join(parent.path, name) + ("/" if is_dir else "")
        self.store.check_key(key)

    def add(self, parent_inode: int, name: str, *, is_dir: bool, attrs: Attrs, size: int = 0,
            etag: str = "", link: str | None = None) -> Node:
        """Record a file, directory, symlink or FIFO this mount created."""
        parent = self.get(parent_inode)
        if not valid_name(name):
            raise OSError(_bad_name_errno(name, errno.EINVAL), "invalid name")
        node = self._node_for(join(parent.path, name), is_dir)
        node.size, node.mtime, node.etag = size, attrs.mtime_ns / 1e9, etag
        node.attrs, node.link = attrs, link
        self._note(node)
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
        self.touch_dir(parent_inode)
        return node

    def remove(self, parent_inode: int, name: str) -> None:
        parent = self.get(parent_inode)
        path = join(parent.path, name)
        if parent.children is not None:
            parent.children.pop(name, None)
        self.kept.changed(parent.key)
        inode = self._by_path.get(path)
        if inode is not None:
            gone = self._nodes[inode]
            self.unlinking(gone)
            if gone.attrs is not None:
                gone.attrs = replace(gone.attrs, ctime_ns=time.time_ns())
            del self._by_path[path]
            self._remember[self._nodes[inode].key] = None
        self.touch_dir(parent_inode)
        if inode is not None and self._nodes[inode].is_dir:  # a file has nothing below it
            self.kept.changed(f"{path}/")
            for sub in [p for p in self._by_path if p.startswith(path + "/")]:
                if self._nodes[self._by_path[sub]].is_dir:
                    self.kept.changed(f"{sub}/")
                del self._by_path[sub]

    def unlinking(self, node: Node) -> None:
        """`node` is losing its name (unlink, renamed over): its attributes and size
        stay as they are now (descriptors still open on it fstat them), less its
        link, which moves its ctime. Call it before the write path forgets its
        local bytes; `remove` calls it too."""
        if self.linked(node) and not node.is_dir and self.overlay.local_file(node.path) is not None:
            node.attrs, node.size = self.stat(node)
            node.mtime = node.attrs.mtime_ns / 1e9

    def move(self, old_parent: int, old_name: str, new_parent: int, new_name: str) -> None:
        """Re-key a node (and, for a directory, every known node below it)."""
        src, dst = self.get(old_parent), self.get(new_parent)
        old_path, new_path = join(src.path, old_name), join(dst.path, new_name)
        inode = self._by_path.get(old_path)
        self.remove(new_parent, new_name)
        if src.children is not None:
            src.children.pop(old_name, None)
        self.touch_dir(old_parent)
        self.kept.changed(src.key)
        if inode is None:
            dst.children_expire = -math.inf  # unknown here: the next lookup re-lists
            return
        below = (p for p in self._by_path if p.startswith(old_path + "/")) if self._nodes[inode].is_dir else ()
        now = time.time_ns()
        for path in sorted([old_path, *below]):
            moved = self._by_path.pop(path)
            node = self._nodes[moved]
            if node.is_dir:  # its listings, old and new name, are this mount's to tell now
                self.kept.changed(node.key)
            self._remember[node.key] = None
            node.path = new_path + path[len(old_path):]
            node.settings = self.policy.settings(node.path)
            self._by_path[node.path] = moved
            if node.is_dir:
                self.kept.changed(node.key)
            if moved == inode:  # rename(2) moves the ctime (of its local record too)
                if node.attrs is not None:
                    node.attrs = replace(node.attrs, ctime_ns=now)
                lf = None if node.is_dir else self.overlay.local_file(node.path)
                if lf is not None and lf.attrs is not None:
                    lf.attrs = replace(lf.attrs, ctime_ns=now)
            self._note(node)
        if dst.children is not None:
            dst.children[new_name] = inode

    async def uploaded(self, key: str, info: ObjectInfo) -> None:
        """A local file landed in the store (or an object was copied): take its store
        attributes quietly (and show its name, if a cached listing of its directory
        lacks it: a file put back from quarantine). `info.metadata` is the object's."""
        self.kept.changed(key.rpartition("/")[0] + "/" if "/" in key else "")
        self._took(key, info)
        await self.remember()

    def _took(self, key: str, info: ObjectInfo) -> None:
        inode = self._by_path.get(key)
        if inode is not None:
            node = self._nodes[inode]
            node.size, node.mtime, node.etag = info.size, info.mtime, info.etag
            node.attr_expire = time.monotonic() + node.settings.attr_ttl
            if has_attrs(info.metadata):
                stored = from_metadata(info.metadata, is_dir=False, defaults=self.defaults,
                                       store_mtime_ns=int(info.mtime * 1e9))
                if node.attrs is not None:  # a rename's copy: its ctime is this mount's
                    stored = replace(stored, ctime_ns=max(stored.ctime_ns, node.attrs.ctime_ns))
                node.attrs = stored
            self._note(node)
            return
        parent_path, _, name = key.rpartition("/")
        parent_inode = self._by_path.get(parent_path)
        parent = None if parent_inode is None else self._nodes[parent_inode]
        if parent is not None and parent.is_dir and parent.children is not None and valid_name(name):
            node = self._apply_info(self._node_for(key, False), info, time.monotonic(),
                                    headed=has_attrs(info.metadata))
            parent.children[name] = node.inode
        elif has_attrs(info.metadata):
            # No node shows it yet (a directory rename's copy of a file below it that
            # this mount never looked up): kept for the listing that will show it,
            # which a small object's plain ETag would otherwise leave at the defaults.
            attrs = from_metadata(info.metadata, is_dir=False, defaults=self.defaults,
                                  store_mtime_ns=int(info.mtime * 1e9))
            self._remember[key] = Known(info.etag, 0, attrs, None).pack()
