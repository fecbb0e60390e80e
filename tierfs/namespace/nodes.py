"""The inode table: nodes by inode and by path, names a key may carry.

Inode numbers are stable for the life of a mount: a path keeps its inode
unless it changes kind, or its object is replaced (a new version takes a new
inode, as a file replaced by rename does on a local disk).
"""

from __future__ import annotations

import errno
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from tierfs.config import ClassSettings
from tierfs.policy import Policy
from tierfs.posix import Attrs

ROOT_INODE = 1
NAME_MAX = 255


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
    # Its listing cannot tell its attributes, and its directory's attribute object
    # says so (a stale entry, or none for an object newer than the table): a HEAD
    # tells, where the class asks (Namespace.untyped).
    ask: bool = False

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


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def bad_name_errno(name: str, otherwise: int) -> int:
    """ENAMETOOLONG for a name over NAME_MAX bytes, else `otherwise`."""
    return errno.ENAMETOOLONG if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX else otherwise


def absent(parent: Node) -> OSError:
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


class NodeTable:
    """Nodes by inode, and the inode each path has now."""

    def __init__(self, policy: Policy, mount_time: float) -> None:
        self.policy = policy
        self.mount_time = mount_time
        self._nodes: dict[int, Node] = {}
        self._by_path: dict[str, int] = {}
        self._next_inode = ROOT_INODE + 1
        root = Node(ROOT_INODE, "", True, policy.settings(""), mtime=mount_time)
        self._nodes[ROOT_INODE] = root
        self._by_path[""] = ROOT_INODE

    def get(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise OSError(errno.ENOENT, "stale inode") from None

    def find(self, inode: int) -> Node | None:
        return self._nodes.get(inode)

    def at(self, path: str) -> Node | None:
        """The node that has `path` now."""
        inode = self._by_path.get(path)
        return None if inode is None else self._nodes[inode]

    def parent_of(self, path: str) -> Node | None:
        return self.at(path.rpartition("/")[0])

    def node_for(self, path: str, is_dir: bool) -> Node:
        """The node of `path`, created if new; a change of kind gets a new inode."""
        node = self.at(path)
        if node is not None and node.is_dir == is_dir:
            return node
        node = Node(self._next_inode, path, is_dir, self.policy.settings(path))
        if is_dir:
            node.mtime = self.mount_time
        self._add(node)
        return node

    def renode(self, old: Node) -> Node:
        """A new inode for `old`'s name (its handles keep the old one)."""
        node = Node(self._next_inode, old.path, False, old.settings, validated_at=old.validated_at,
                    size=old.size, mtime=old.mtime, etag=old.etag)
        self._add(node)
        parent = self.parent_of(node.path)
        name = node.path.rpartition("/")[2]
        if parent is not None and parent.children is not None and name in parent.children:
            parent.children[name] = node.inode
        return node

    def _add(self, node: Node) -> None:
        self._next_inode += 1
        self._nodes[node.inode] = node
        self._by_path[node.path] = node.inode

    def current(self, node: Node) -> Node:
        """The node now at `node`'s name (a newer version takes a new inode)."""
        return self.at(node.path) or node

    def linked(self, node: Node) -> bool:
        """Whether `node` still has its name (not unlinked, renamed over or replaced)."""
        return node.inode == ROOT_INODE or self._by_path.get(node.path) == node.inode

    def unname(self, path: str) -> None:
        """`path` names nothing now (its node lives on for open handles)."""
        self._by_path.pop(path, None)

    def rename(self, node: Node, path: str) -> None:
        """Give `node` the name `path` (the caller unnamed its old one)."""
        node.path = path
        node.settings = self.policy.settings(path)
        self._by_path[path] = node.inode

    def below(self, path: str) -> list[str]:
        """The named paths strictly below directory `path`."""
        prefix = f"{path}/" if path else ""
        return [p for p in self._by_path if p.startswith(prefix) and p != path]

    def dirs_at_or_below(self, path: str) -> Iterator[Node]:
        below = f"{path}/" if path else ""
        for p, inode in self._by_path.items():
            if p == path or p.startswith(below):
                node = self._nodes[inode]
                if node.is_dir:
                    yield node

    def live(self, inodes: Mapping[str, int]) -> dict[str, int]:
        """The entries of `inodes` whose node still exists."""
        return {n: i for n, i in inodes.items() if i in self._nodes}

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        for inode, count in items:
            node = self._nodes.get(inode)
            if node is not None:
                node.lookups = max(0, node.lookups - count)
