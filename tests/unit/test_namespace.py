"""The namespace without a kernel mount: a real file:// store (its request
observer counts LISTs and HEADs), a real tier-1 cache and the write path's
journal as the overlay, driven through the calls fs.py and tree.py make."""

from __future__ import annotations

import errno
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from tierfs.cache import Cache
from tierfs.config import DEFAULT_CLASSES, DEFAULT_RULES
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings
from tierfs.namespace import ROOT_INODE, Namespace, Node
from tierfs.policy import Policy
from tierfs.posix import Defaults, new_attrs, to_metadata
from tierfs.store import LocalStore
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal

DEFAULTS = Defaults(uid=1234, gid=4321)


@dataclass
class World:
    """One node's namespace over a shared store; `remount` is a new node life."""

    root: Path
    cache_dir: Path
    requests: Counter[str] = field(default_factory=Counter)
    changed: list[int] = field(default_factory=list)
    caches: list[Cache] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = LocalStore(str(self.root), observer=self._seen)
        self.ns = self._namespace()

    def _seen(self, op: str, outcome: str, secs: float, nbytes: int) -> None:
        self.requests[op] += 1

    def _namespace(self) -> Namespace:
        cache = Cache(self.cache_dir, capacity=64 << 20, min_free=0)
        cache.bind(self.store.identity)
        self.caches.append(cache)
        workers = Workers(data=2, upload=1, meta=4, disk=2)
        return Namespace(self.store, cache, Policy(DEFAULT_RULES, DEFAULT_CLASSES, "default"),
                         workers, health=StoreHealth(probe_every=5.0), overlay=Journal(),
                         kept=KeptListings(cache, workers),
                         on_changed=self.changed.append, on_gone=lambda parent, name: None,
                         defaults=DEFAULTS)

    def remount(self) -> None:
        """A new life of this node (the same tier-1 cache)."""
        self.caches.pop().close()
        self.ns = self._namespace()
        self.requests.clear()

    def put(self, key: str, body: bytes = b"x", **meta: str) -> str:
        return self.store.put_bytes(key, body, metadata=meta or None).etag

    async def path(self, path: str) -> Node:
        node = self.ns.get(ROOT_INODE)
        for part in path.split("/"):
            node = await self.ns.lookup(node.inode, part)
        return node


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    (tmp_path / "src").mkdir()
    w = World(tmp_path / "src", tmp_path / "cache")
    yield w
    for c in w.caches:
        c.close()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn)


def test_listing_names_inodes_and_defaults(world: World) -> None:
    world.put("a/one.txt", b"1")
    world.put("a/two.txt", b"22")
    world.put("a/sub/three.txt")

    async def main() -> None:
        a = await world.path("a")
        entries = await world.ns.readdir(a.inode)
        assert [n for n, _ in entries] == ["one.txt", "sub", "two.txt"]
        kinds = {n: node.is_dir for n, node in entries}
        assert kinds == {"one.txt": False, "sub": True, "two.txt": False}
        two = dict(entries)["two.txt"]
        attrs, size = world.ns.stat(two)
        assert size == 2 and attrs.uid == 1234 and attrs.gid == 4321
        assert stat.S_IMODE(attrs.mode) == 0o644 and stat.S_ISREG(attrs.mode)
        # a lookup of a listed name costs nothing more; the same node answers
        before = sum(world.requests.values())
        again = await world.ns.lookup(a.inode, "two.txt")
        assert again.inode == two.inode and sum(world.requests.values()) == before
        with pytest.raises(OSError) as missing:
            await world.ns.lookup(a.inode, "nope")
        assert missing.value.errno == errno.ENOENT
        with pytest.raises(OSError) as notdir:
            await world.ns.lookup(two.inode, "x")
        assert notdir.value.errno == errno.ENOTDIR
        with pytest.raises(OSError) as long:
            await world.ns.lookup(a.inode, "n" * 256)
        assert long.value.errno == errno.ENAMETOOLONG

    run(main)


def test_an_object_replaced_by_another_tool_takes_a_new_inode(world: World) -> None:
    world.put("f.bin", b"old")

    async def main() -> None:
        old = await world.path("f.bin")
        world.put("f.bin", b"newer")
        await world.ns.revalidate(old)
        new = world.ns.current(old)
        assert new.inode != old.inode and new.size == 5
        assert old.inode in world.changed  # the kernel drops the old pages
        assert not world.ns.linked(old) and world.ns.linked(new)

    run(main)


def test_rename_of_a_directory_rekeys_what_is_below(world: World) -> None:
    world.put("d/x/f.txt")

    async def main() -> None:
        f = await world.path("d/x/f.txt")
        d = await world.path("d")
        world.ns.move(ROOT_INODE, "d", ROOT_INODE, "e")
        assert d.path == "e" and f.path == "e/x/f.txt" and f.key == "e/x/f.txt"
        assert world.ns.linked(f) and world.ns.stat(f)[1] == 1
        root = world.ns.get(ROOT_INODE)
        assert root.children is not None and "d" not in root.children
        assert root.children["e"] == d.inode

    run(main)


def test_create_remove_and_the_directory_times(world: World) -> None:
    async def main() -> None:
        root = world.ns.get(ROOT_INODE)
        await world.ns.readdir(ROOT_INODE)
        before = world.ns.stat(root)[0].mtime_ns
        now = time.time_ns()
        attrs = new_attrs(stat.S_IFDIR, 0o750, 7, 8, now)
        d = world.ns.add(ROOT_INODE, "made", is_dir=True, attrs=attrs)
        assert world.ns.stat(d)[0] == attrs and world.ns.nlink(root) == 3
        assert world.ns.stat(root)[0].mtime_ns >= max(before, now)
        assert world.ns.known_absent(d.inode, "anything")
        world.ns.remove(ROOT_INODE, "made")
        assert not world.ns.linked(d) and world.ns.nlink(d) == 0
        with pytest.raises(OSError):
            world.ns.add(ROOT_INODE, "a/b", is_dir=False, attrs=attrs)

    run(main)


def test_attributes_learned_are_kept_across_a_remount(world: World) -> None:
    mode = stat.S_IFREG | 0o600
    meta = to_metadata(new_attrs(stat.S_IFREG, 0o600, 5, 6, 1_700_000_000 * 10**9))
    world.put("k/key.pem", b"secret", **meta)

    async def first() -> None:
        node = await world.path("k/key.pem")
        assert node.attrs is not None and node.attrs.mode == mode  # a HEAD typed it
        assert world.requests["head"] == 1

    async def second() -> None:
        node = await world.path("k/key.pem")
        assert world.ns.stat(node)[0].mode == mode and world.ns.stat(node)[0].uid == 5
        assert world.requests["head"] == 0  # the index kept what the HEAD taught

    run(first)
    world.remount()
    run(second)


def test_a_directory_of_samples_is_listed_once_across_a_remount(world: World) -> None:
    """`imgs/` is of the default class, but 20 of its 21 files are `.jpg` (dataset):
    its listing is kept like a dataset directory's; `code/`'s is not."""
    for i in range(20):
        world.put(f"imgs/{i:04d}.jpg")
    world.put("imgs/labels.txt")
    world.put("code/train.py")

    async def listed() -> None:
        for d, n in (("imgs", 21), ("code", 1)):
            node = await world.path(d)
            assert len(await world.ns.readdir(node.inode)) == n

    run(listed)
    assert world.requests["list"] == 3  # the root, imgs/, code/
    world.remount()
    run(listed)
    # the root (no files: its own class) and code/ again; imgs/ from the index
    assert world.requests["list"] == 2
