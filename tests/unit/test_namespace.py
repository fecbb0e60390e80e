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
from tierfs.posix import Attrs, Defaults, new_attrs, to_metadata
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


# -- directories' attribute objects (namespace/dirattrs.py, attrobjects.py) -------------

T0 = 1_700_000_000 * 10**9


def attrs_for(kind: int, perms: int, uid: int, i: int = 0) -> Attrs:
    return new_attrs(kind, perms, uid, uid + 1, T0 + i * 10**9)


async def copy_in(w: World, files: dict[str, Attrs], dirs: dict[str, Attrs]) -> None:
    """What `cp -a` makes the namespace do: mkdir, files uploaded with their
    attributes, symlinks stored at once, the directories' times set last."""
    for path, a in sorted(dirs.items()):
        parent = await w.path(path.rpartition("/")[0]) if "/" in path else w.ns.get(ROOT_INODE)
        await w.ns.readdir(parent.inode)
        w.store.put_bytes(f"{path}/", b"", metadata=to_metadata(a))
        w.ns.add(parent.inode, path.rpartition("/")[2], is_dir=True, attrs=a)
    for path, a in files.items():
        parent = await w.path(path.rpartition("/")[0])
        name = path.rpartition("/")[2]
        if a.kind == stat.S_IFLNK:
            info = w.store.put_bytes(path, b"../target", metadata=to_metadata(a), typed=True)
            w.ns.add(parent.inode, name, is_dir=False, attrs=a, size=9, etag=info.etag,
                     link="../target", stored_at=info.mtime)
        else:
            info = w.store.put_bytes(path, path.encode(), metadata=to_metadata(a))
            await w.ns.uploaded(path, info)
    await w.ns.settle("")


def shown(w: World, node: Node) -> tuple[int, int, int, int]:
    a = w.ns.stat(node)[0]
    return a.mode, a.uid, a.gid, a.mtime_ns


TREE_DIRS = {"t": attrs_for(stat.S_IFDIR, 0o1777, 0, 50),
             "t/keys": attrs_for(stat.S_IFDIR, 0o700, 65534, 51)}
TREE_FILES = {"t/run.sh": attrs_for(stat.S_IFREG, 0o755, 0, 1),
              "t/keys/id": attrs_for(stat.S_IFREG, 0o600, 65534, 2),
              "t/plain.txt": attrs_for(stat.S_IFREG, 0o644, 1000, 3),
              "t/link": attrs_for(stat.S_IFLNK, 0o777, 1000, 4)}


def test_another_node_lists_what_cp_a_kept_without_a_head(world: World, tmp_path: Path) -> None:
    run(lambda: copy_in(world, TREE_FILES, TREE_DIRS))
    assert not (world.root / "t" / ".tierfs.attrs.json").is_symlink()
    other = World(world.root, tmp_path / "other-cache")  # a node with nothing cached

    async def look() -> None:
        t = await other.path("t")
        entries = dict(await other.ns.readdir(t.inode))
        assert sorted(entries) == ["keys", "link", "plain.txt", "run.sh"]  # no attribute object
        for path, a in {**TREE_FILES, **TREE_DIRS}.items():
            node = await other.path(path)
            assert shown(other, node) == (a.mode, a.uid, a.gid, a.mtime_ns), path
        assert await other.ns.readlink(await other.path("t/link")) == "../target"
        assert other.requests["head"] == 0
        assert other.requests["get"] == 3  # the attribute objects of /, t/, t/keys/: once each

    run(look)
    for c in other.caches:
        c.close()


def test_a_replaced_object_shows_its_own_attributes(world: World, tmp_path: Path) -> None:
    run(lambda: copy_in(world, TREE_FILES, TREE_DIRS))
    world.store.put_bytes("t/run.sh", b"#!/bin/sh\nexit 1\n")  # another tool, no metadata
    other = World(world.root, tmp_path / "other-cache")

    async def look() -> None:
        t = await other.path("t")
        entries = dict(await other.ns.readdir(t.inode))
        a = other.ns.stat(entries["run.sh"])[0]
        assert stat.S_IMODE(a.mode) == 0o644 and a.uid == 1234  # the defaults, not 0755 root
        assert other.requests["head"] == 1  # the stale entry was asked about, the rest not

    run(look)
    for c in other.caches:
        c.close()


def test_what_a_listing_tells_gets_no_entry(world: World) -> None:
    """A file written with the writer's defaults and uploaded soon after its last
    write (a checkpoint shard): no entry, no attribute object in its directory;
    a chmod gives it one, a chmod back takes it away again."""
    async def main() -> None:
        await world.ns.readdir(ROOT_INODE)
        world.ns.add(ROOT_INODE, "ckpt", is_dir=True, attrs=new_attrs(
            stat.S_IFDIR, 0o755, DEFAULTS.uid, DEFAULTS.gid, time.time_ns()))
        plain = new_attrs(stat.S_IFREG, 0o644, DEFAULTS.uid, DEFAULTS.gid, time.time_ns())
        info = world.store.put_bytes("ckpt/shard-0", b"x", metadata=to_metadata(plain))
        await world.ns.uploaded(info.key, info)
        await world.ns.settle("")
        assert not (world.root / "ckpt/.tierfs.attrs.json").exists()
        assert not (world.root / ".tierfs.attrs.json").exists()
        node = await world.path("ckpt/shard-0")
        for perms, table in ((0o600, True), (0o644, False)):
            new = plain.with_perms(perms, time.time_ns())
            got = world.store.replace_metadata(info.key, to_metadata(new), etag=node.etag)
            world.ns.set_attrs(node, new, etag=got.etag, stored_at=got.mtime)
            await world.ns.settle("")
            assert (world.root / "ckpt/.tierfs.attrs.json").exists() == table

    run(main)


def test_changes_are_coalesced_into_one_put_per_directory(world: World) -> None:
    async def main() -> None:
        await world.ns.readdir(ROOT_INODE)
        world.ns.add(ROOT_INODE, "many", is_dir=True, attrs=attrs_for(stat.S_IFDIR, 0o755, 0))
        before = world.requests["put"]
        for i in range(300):
            a = attrs_for(stat.S_IFREG, 0o600, 0, i)
            info = world.store.put_bytes(f"many/f{i:03d}", b"x", metadata=to_metadata(a))
            await world.ns.uploaded(info.key, info)
        assert world.requests["put"] - before == 300  # nothing written for them yet
        await world.ns.settle("")
        assert world.requests["put"] - before == 300 + 2  # many/'s object, and the root's

    run(main)


def test_two_nodes_writing_one_directory_keep_both_entries(world: World, tmp_path: Path) -> None:
    other = World(world.root, tmp_path / "other-cache")

    async def node(w: World, name: str, a: Attrs) -> None:
        d = await w.path("shared")
        await w.ns.readdir(d.inode)
        info = w.store.put_bytes(f"shared/{name}", b"x", metadata=to_metadata(a))
        await w.ns.uploaded(info.key, info)

    async def main() -> None:
        world.put("shared/seed")
        mine, theirs = attrs_for(stat.S_IFREG, 0o600, 1), attrs_for(stat.S_IFREG, 0o751, 2)
        await node(world, "mine", mine)
        await node(other, "theirs", theirs)
        await world.ns.settle("")  # creates the object (If-None-Match: *)
        await other.ns.settle("")  # 412: read it again, put both
        third = World(world.root, tmp_path / "third-cache")
        for name, a in (("mine", mine), ("theirs", theirs)):
            assert shown(third, await third.path(f"shared/{name}"))[:2] == (a.mode, a.uid)
        assert third.requests["head"] == 0
        for c in third.caches:
            c.close()

    run(main)
    for c in other.caches:
        c.close()


def test_rmdir_takes_the_attribute_object_along(world: World) -> None:
    run(lambda: copy_in(world, {"t/keys/id": TREE_FILES["t/keys/id"]}, TREE_DIRS))
    assert (world.root / "t/keys/.tierfs.attrs.json").exists()

    async def main() -> None:
        keys = await world.path("t/keys")
        world.store.delete("t/keys/id")
        world.ns.remove(keys.inode, "id")
        world.ns.expire_listing(keys)
        assert await world.ns.readdir(keys.inode) == []  # empty, for rmdir
        await world.ns.removing_dir(keys)
        world.store.delete("t/keys/")
        t = await world.path("t")
        world.ns.remove(t.inode, "keys")
        world.ns.expire_listing(t)
        assert [n for n, _ in await world.ns.readdir(t.inode)] == []
        with pytest.raises(OSError) as reserved:
            world.ns.check_new(t.inode, ".tierfs.attrs.json", is_dir=False)
        assert reserved.value.errno == errno.EPERM

    run(main)
    assert not (world.root / "t/keys").exists()


def test_an_unreadable_attribute_object_is_ignored(world: World) -> None:
    world.put("d/a.txt", b"a")
    world.put("d/.tierfs.attrs.json", b'{"not": "ours"}')

    async def main() -> None:
        d = await world.path("d")
        entries = await world.ns.readdir(d.inode)
        assert [n for n, _ in entries] == ["a.txt"]
        assert world.ns.stat(entries[0][1])[0].uid == 1234

    run(main)


def test_nothing_is_written_below_a_directory_being_renamed(world: World) -> None:
    """An upload that lands while its directory is renamed object by object: its
    entry would put an attribute object under the old name after the copies
    (a phantom directory); the copy brings it under the new name instead."""
    run(lambda: copy_in(world, TREE_FILES, TREE_DIRS))

    async def main() -> None:
        t = await world.path("t")
        await world.ns.moving_dir(t, "u/")
        a = attrs_for(stat.S_IFREG, 0o600, 3)
        info = world.store.put_bytes("t/landed.txt", b"x", metadata=to_metadata(a))
        await world.ns.uploaded(info.key, info)
        before = world.requests["put"]
        await world.ns.settle("")
        assert world.requests["put"] == before
        world.ns.moved_dir("t/")
        await world.ns.uploaded(info.key, info)  # the rename is over: written again
        await world.ns.settle("")
        assert world.requests["put"] == before + 1

    run(main)
