"""A seeded random model of POSIX metadata calls: the mount vs a local oracle.

Thousands of calls (create with modes, mkdir, chmod, chown, utimensat,
symlink, readlink, mkfifo, mknod of a socket, rename over files, symlinks and
directories, unlink, rmdir, small writes, truncate) run on the mount and on a
local tmpfs (mounted noatime, as tierfs is), with the same umask, as root.
After each call the errno must match, and so must the `lstat` of every path
the call touched (type, permission bits, owner, group, link count, size, and
times: exactly where the call set them, within a few seconds where "now" is
meant). The mount is remounted on the same cache every REMOUNT_EVERY calls
and the whole trees compared; at the end a second mount with an empty cache
(another node) must show the same tree from the store alone, once it read
each file: listings and the directories' attribute objects tell what differs
from the defaults (modes, owners, types, directories' modes and owners), the
first GET's headers the rest (a file's times, where they are about its
upload's).

Documented differences (docs/semantics.md), the only ones accepted:
- link(2): EPERM on the mount. The oracle's extra name is removed again so the
  trees stay comparable.
- a directory's times moved by entries made or removed in it are the node's
  that made them (memory, and the tier-1 index across remounts); what is set
  explicitly (mkdir, chmod, chown, utimensat) is stored: another node shows
  those, so a directory's times are not compared on the second mount.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.mount import TierfsMount, run_tierfs

pytestmark = needs_root  # chown to other users, mknod, a tmpfs oracle

OPS = 2000
REMOUNT_EVERY = 750
SLACK_NS = 3 * 10**9  # "now" on the mount vs "now" on the oracle, a call apart
DIRS = ["", "d0/", "d1/", "d0/d1/", "d1/d0/"]
LEAVES = ["a", "b", "c", "d0", "d1"]
# Symlink targets stay inside the tree (no "..", no absolute path that exists).
TARGETS = ["a", "b", "d0", "d1", "d0/a", "d1/d0", "missing", "/nonexistent-tierfs/x"]
IDS = [0, 1000, 4242, 65534]
PERMS = [0o644, 0o600, 0o755, 0o700, 0o444, 0o000, 0o777, 0o1777, 0o2755, 0o4755, 0o6711,
         0o2775, 0o640, 0o311]


@pytest.fixture
def oracle(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted noatime: reads never move atime, as on the mount."""
    root = tmp_path / "oracle"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noatime,size=64m,mode=0755", "tmpfs",
                    str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def lstat_of(root: Path, rel: str) -> tuple[str, os.stat_result | None]:
    try:
        return "ok", os.lstat(root / rel)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, "?"), None


def differences(rel: str, got: os.stat_result, want: os.stat_result, *, exact_times: bool,
                dir_times: bool = True) -> list[str]:
    out = []
    is_dir = stat.S_ISDIR(want.st_mode)
    if stat.S_IFMT(got.st_mode) != stat.S_IFMT(want.st_mode):
        return [f"{rel}: type {oct(stat.S_IFMT(got.st_mode))} != {oct(stat.S_IFMT(want.st_mode))}"]
    fields = [("nlink", got.st_nlink, want.st_nlink)]
    if not is_dir:
        fields.append(("size", got.st_size, want.st_size))
    fields += [("mode", oct(got.st_mode), oct(want.st_mode)), ("uid", got.st_uid, want.st_uid),
               ("gid", got.st_gid, want.st_gid)]
    if stat.S_ISCHR(want.st_mode) or stat.S_ISBLK(want.st_mode):
        fields.append(("rdev", got.st_rdev, want.st_rdev))
    out += [f"{rel}: {name} {g} != {w}" for name, g, w in fields if g != w]
    if dir_times or not is_dir:
        for name in ("st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            g, w = getattr(got, name), getattr(want, name)
            if (g != w) if exact_times and name != "st_ctime_ns" else abs(g - w) > SLACK_NS:
                out.append(f"{rel}: {name[3:]} {g} != {w} ({(g - w) / 1e9:+.3f} s)")
    return out


def walk(root: Path) -> dict[str, os.stat_result]:
    """Every path's lstat, taken once every directory was listed: a directory's
    link count counts its subdirectories once they are known (README)."""
    paths = [Path(d) / n for d, dirs, files in os.walk(root) for n in dirs + files]
    return {str(p.relative_to(root)): os.lstat(p) for p in paths}


def compare_trees(mount: Path, oracle: Path, *, dir_times: bool = True) -> list[str]:
    got, want = walk(mount), walk(oracle)
    out = [f"{rel}: {'only on the mount' if rel in got else 'missing on the mount'}"
           for rel in sorted(got.keys() ^ want.keys())]
    for rel in sorted(got.keys() & want.keys()):
        out += differences(rel, got[rel], want[rel], exact_times=False, dir_times=dir_times)
        if stat.S_ISLNK(want[rel].st_mode) and os.readlink(mount / rel) != os.readlink(oracle / rel):
            out.append(f"{rel}: readlink {os.readlink(mount / rel)!r} != {os.readlink(oracle / rel)!r}")
    return out


def path(rng: random.Random) -> str:
    return rng.choice(DIRS) + rng.choice(LEAVES)


@dataclass
class Op:
    desc: str
    fn: Callable[[Path], object]  # the call, under a root
    touched: list[str]  # paths whose lstat it may change (first: the one it names)
    exact: bool  # it sets the first path's atime and mtime to given values


def make_op(rng: random.Random, oracle: Path) -> Op:
    """One random call, decided from the oracle's state where a call could block."""
    a, b = path(rng), path(rng)
    parent_a, parent_b = os.path.dirname(a), os.path.dirname(b)
    perms = rng.choice(PERMS)
    kind = rng.choices(
        ["create", "mkdir", "symlink", "mkfifo", "mksock", "chmod", "chown", "utime", "touch",
         "readlink", "rename", "unlink", "rmdir", "write", "truncate", "link", "mkdev"],
        weights=[12, 8, 8, 3, 2, 12, 8, 10, 3, 4, 10, 6, 5, 5, 3, 1, 1])[0]
    follow = rng.random() < 0.5
    touched = [a, parent_a]
    if kind == "create":
        def fn(r: Path) -> object:
            # O_NONBLOCK: a FIFO under that name fails (ENXIO) instead of blocking.
            os.close(os.open(r / a, os.O_CREAT | os.O_WRONLY | os.O_NONBLOCK, perms))
            return None
    elif kind == "mkdir":
        def fn(r: Path) -> object:
            return os.mkdir(r / a, perms)
    elif kind == "symlink":
        target = rng.choice(TARGETS)
        def fn(r: Path) -> object:
            return os.symlink(target, r / a)
    elif kind == "mkfifo":
        def fn(r: Path) -> object:
            return os.mkfifo(r / a, perms & 0o777)
    elif kind == "mksock":
        def fn(r: Path) -> object:
            return os.mknod(r / a, stat.S_IFSOCK | (perms & 0o777))
    elif kind == "mkdev":
        def fn(r: Path) -> object:
            return os.mknod(r / a, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "chmod":
        def fn(r: Path) -> object:
            return os.chmod(r / a, perms)  # Linux has no lchmod: always follows
    elif kind == "chown":
        uid, gid = rng.choice(IDS + [-1]), rng.choice(IDS + [-1])
        def fn(r: Path) -> object:
            return os.chown(r / a, uid, gid, follow_symlinks=follow)
    elif kind == "utime":
        at, mt = (rng.randrange(-(10**18), 4 * 10**18) for _ in range(2))
        def fn(r: Path) -> object:
            return os.utime(r / a, ns=(at, mt), follow_symlinks=follow)
    elif kind == "touch":
        def fn(r: Path) -> object:
            return os.utime(r / a, follow_symlinks=follow)
    elif kind == "readlink":
        def fn(r: Path) -> object:
            return os.readlink(r / a)
    elif kind == "rename":
        touched += [b, parent_b]
        def fn(r: Path) -> object:
            return os.rename(r / a, r / b)
    elif kind == "unlink":
        def fn(r: Path) -> object:
            return os.unlink(r / a)
    elif kind == "rmdir":
        def fn(r: Path) -> object:
            return os.rmdir(r / a)
    elif kind == "write":
        data = rng.randbytes(rng.choice([1, 100, 5000]))
        regular = stat.S_ISREG(os.lstat(oracle / a).st_mode) if (oracle / a).exists() else True
        def fn(r: Path) -> object:
            if not regular:  # a FIFO would block; a dir or link: not this call's business
                return "skipped"
            with open(r / a, "ab") as f:
                f.write(data)
            return None
    elif kind == "truncate":
        size = rng.choice([0, 10, 7000])
        regular = not (oracle / a).exists() or stat.S_ISREG(os.stat(oracle / a).st_mode)
        def fn(r: Path) -> object:
            return os.truncate(r / a, size) if regular else "skipped"
    else:  # link
        touched += [b, parent_b]
        def fn(r: Path) -> object:
            return os.link(r / a, r / b, follow_symlinks=False)
    desc = f"{kind} {a}" + (f" {b}" if kind in ("rename", "link") else "")
    if kind in ("create", "mkdir", "mkfifo", "mksock", "chmod"):
        desc += f" {oct(perms)}"
    if kind in ("chown", "utime", "touch"):
        desc += f" follow={follow}"
    on_link = os.path.islink(oracle / a)
    exact = kind == "utime" and not (follow and on_link)
    return Op(desc, fn, [t for t in dict.fromkeys(touched) if t], exact)


def run(fn: Callable[[Path], object], root: Path) -> tuple[str, object]:
    try:
        return "ok", fn(root)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, "?"), None


def documented(desc: str, got: str, want: str) -> bool:
    """link(2): EPERM on the mount where the oracle made the link."""
    return desc.split()[0] == "link" and got == "EPERM" and want == "ok"


def flush(m: TierfsMount) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_random_metadata_calls_match_local_oracle(
    kind: str, mount_factory: MountFactory, bucket: str, tmp_path: Path, oracle: Path,
    umask_022: None,
) -> None:
    rng = random.Random(20261204)
    if kind == "s3":
        source = f"s3://{bucket}"
    else:
        (tmp_path / "store").mkdir()
        source = f"file://{tmp_path / 'store'}"
    cache = tmp_path / "cache"
    m = mount_factory(source, "--allow-other", cache_dir=cache)
    mismatches: list[str] = []
    for i in range(OPS):
        op = make_op(rng, oracle)
        want, want_value = run(op.fn, oracle)
        got, got_value = run(op.fn, m.mountpoint)
        if documented(op.desc, got, want):
            (oracle / op.desc.split()[-1]).unlink()  # the name only the oracle made
        elif (got, got_value) != (want, want_value):
            mismatches.append(
                f"op {i} {op.desc}: mount {got} {got_value!r}, oracle {want} {want_value!r}")
        for rel in op.touched:
            (gs, g), (ws, w) = lstat_of(m.mountpoint, rel), lstat_of(oracle, rel)
            if gs != ws:
                mismatches.append(f"op {i} {op.desc}: lstat {rel}: mount {gs}, oracle {ws}")
            elif g is not None and w is not None:
                exact = op.exact and want == "ok" and rel == op.touched[0]
                mismatches += [f"op {i} {op.desc}: {d}"
                               for d in differences(rel, g, w, exact_times=exact)]
        assert len(mismatches) < 20, "\n".join(mismatches)
        if i % REMOUNT_EVERY == REMOUNT_EVERY - 1:
            m.umount()
            m = mount_factory(source, "--allow-other", cache_dir=cache, mountpoint=m.mountpoint)
            assert compare_trees(m.mountpoint, oracle) == [], \
                f"after op {i} and a remount"
    assert mismatches == [], "\n".join(mismatches)
    assert compare_trees(m.mountpoint, oracle) == []
    flush(m)
    other = mount_factory(source, "--allow-other")  # another node: an empty cache
    for rel, st in walk(other.mountpoint).items():
        if stat.S_ISREG(st.st_mode):
            (other.mountpoint / rel).read_bytes()
    diffs = compare_trees(other.mountpoint, oracle, dir_times=False)
    assert diffs == [], "\n".join(diffs)
