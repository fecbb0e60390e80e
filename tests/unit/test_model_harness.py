"""The write oracle without a kernel: seeded random writes, truncates, renames,
unlinks, appends, rewrites, descriptors held open across them, fsyncs,
flushes and remounts, run on the real TierFS operations (fuse/fs.py) of a
mount built in-process on a file:// store (model_kernel.py), and on a local
directory, the oracle. As mountpoint-s3's reference tests do, without FUSE:
thousands of operations a second instead of a mount's hundreds.

After every call the errno must match. Every CHECK_EVERY calls (and at each
remount) every file reads back as the oracle holds it, and every pending file
with no writer is in the state its tier-1 record says (pending.py: STORED is
a clean record, SEALED a sealed one). After a flush barrier, the store holds
every closed file as the oracle does. The classes mix every write contract:
checkpoint (write-back, direct writes queued), default (write-back after a
short quiet delay: uploads race the next writes), dataset, write-through, a
temporary name (staged), and a manifest published on rename and close.
"""

from __future__ import annotations

import errno
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.model_kernel import Kernel, config, harness_mount
from tierfs.mount import Parts
from tierfs.namespace.dirattrs import NAME as ATTRS_OBJECT

SEEDS = (11, 23, 37, 41, 59)
OPS = 2000
CHECK_EVERY = 100
REMOUNT_EVERY = 700
HELD_MAX = 3
DIRS = ("", "d1/", "d1/d2/")
EXTS = ("pt", "txt", "bin", "wt", "tmp")
NAMES = [f"{d}f{i}.{e}" for d in DIRS for i in range(3) for e in EXTS] + ["latest", "d1/latest"]
CONFIG = """
[classes.default]
upload_delay = 0.005
[classes.dataset]
upload_delay = 0.02
[classes.through]
write_mode = "writethrough"
[[rules]]
glob = "*.wt"
class = "through"
"""
KINDS = ["write", "truncate", "rename", "unlink", "append", "rewrite", "read",
         "hold", "hwrite", "htruncate", "hclose", "fsync", "flush"]
WEIGHTS = [30, 8, 10, 6, 8, 12, 6, 5, 10, 3, 5, 3, 1]


class Oracle:
    """The same calls on a local directory; held descriptors are real ones."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _mkdirs(self, rel: str) -> None:
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)

    def open(self, rel: str, flags: int) -> int:
        if flags & os.O_CREAT:
            self._mkdirs(rel)
        return os.open(self.root / rel, flags, 0o644)

    def truncate(self, rel: str, size: int) -> None:
        os.truncate(self.root / rel, size)

    def rename(self, src: str, dst: str) -> None:
        self._mkdirs(dst)
        os.replace(self.root / src, self.root / dst)

    def unlink(self, rel: str) -> None:
        os.unlink(self.root / rel)

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def files(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.root)): p.read_bytes()
                for p in self.root.rglob("*") if p.is_file()}


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "?")


class Model:
    """One seed's run: each call on the mount and on the oracle, compared."""

    def __init__(self, seed: int, tmp: Path) -> None:
        self.rng = random.Random(seed)
        self.tmp = tmp
        self.oracle = Oracle(tmp / "oracle")
        self.oracle.root.mkdir()
        self.store = tmp / "store"
        self.store.mkdir()
        self.cfg = config(self.store, tmp / "cache", tmp / "mnt", CONFIG)
        self.held: list[tuple[int, int]] = []  # (mount fh, oracle fd)
        self.mismatches: list[str] = []
        self.calls = 0

    async def both(self, what: str, on_mount: object, on_oracle: object) -> None:
        """Run one call on each side; their outcomes (ok or the errno) must match."""
        self.calls += 1
        got = want = "ok"
        try:
            await on_mount  # type: ignore[misc]
        except OSError as exc:
            got = _errname(exc)
        try:
            on_oracle()  # type: ignore[operator]
        except OSError as exc:
            want = _errname(exc)
        if got != want:
            self.mismatches.append(f"call {self.calls} {what}: mount {got}, oracle {want}")

    async def step(self, k: Kernel, parts: Parts) -> None:
        rng = self.rng
        kind = rng.choices(KINDS, weights=WEIGHTS)[0]
        a, b = rng.choice(NAMES), rng.choice(NAMES)
        data = rng.randbytes(rng.choice([1, 100, 4096, 65536, 300_000]))
        off = rng.randrange(0, 400_000)
        size = rng.randrange(0, 400_000)
        o = self.oracle
        if kind == "write":
            await self.both(f"write {a}@{off}", self._write(k, a, data, off),
                            lambda: self._owrite(a, os.O_WRONLY | os.O_CREAT, data, off))
        elif kind == "append":
            await self.both(f"append {a}", self._append(k, a, data),
                            lambda: self._owrite(a, os.O_WRONLY | os.O_APPEND | os.O_CREAT, data, None))
        elif kind == "rewrite":
            await self.both(f"rewrite {a}", self._rewrite(k, a, data),
                            lambda: self._owrite(a, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, data, 0))
        elif kind == "truncate":
            await self.both(f"truncate {a} {size}", k.truncate(a, size), lambda: o.truncate(a, size))
        elif kind == "rename":
            await self.both(f"rename {a} {b}", k.rename(a, b), lambda: o.rename(a, b))
        elif kind == "unlink":
            await self.both(f"unlink {a}", k.unlink(a), lambda: o.unlink(a))
        elif kind == "read":
            await self._compare_read(k, a)
        elif kind == "hold" and len(self.held) < HELD_MAX:
            await self._hold(k, a)
        elif kind in ("hwrite", "htruncate", "hclose", "fsync") and self.held:
            i = rng.randrange(len(self.held))
            fh, fd = self.held[i]
            if kind == "hwrite":
                await self.both(f"hwrite {i}@{off}", k.pwrite(fh, data, off),
                                lambda: os.pwrite(fd, data, off))
            elif kind == "htruncate":
                await self.both(f"ftruncate {i} {size}", k.ftruncate(fh, size),
                                lambda: os.ftruncate(fd, size))
            elif kind == "fsync":
                await self.both(f"fsync {i}", k.fsync(fh), lambda: os.fsync(fd))
            else:
                del self.held[i]
                await self.both(f"close {i}", k.close(fh), lambda: os.close(fd))
        elif kind == "flush":
            await self.flush_and_compare_store(parts)

    # -- the calls -------------------------------------------------------------------

    @staticmethod
    async def _write(k: Kernel, rel: str, data: bytes, off: int) -> None:
        fh = await k.open(rel, os.O_WRONLY | os.O_CREAT, mkdirs=True)
        try:
            await k.pwrite(fh, data, off)
        finally:
            await k.close(fh)

    @staticmethod
    async def _append(k: Kernel, rel: str, data: bytes) -> None:
        fh = await k.open(rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mkdirs=True)
        try:  # the kernel writes an append at the size it knows
            await k.pwrite(fh, data, await k.size(rel))
        finally:
            await k.close(fh)

    @staticmethod
    async def _rewrite(k: Kernel, rel: str, data: bytes) -> None:
        fh = await k.open(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mkdirs=True)
        try:
            await k.pwrite(fh, data, 0)
        finally:
            await k.close(fh)

    def _owrite(self, rel: str, flags: int, data: bytes, off: int | None) -> None:
        fd = self.oracle.open(rel, flags)
        try:
            if off is None:
                os.write(fd, data)
            else:
                os.pwrite(fd, data, off)
        finally:
            os.close(fd)

    async def _hold(self, k: Kernel, rel: str) -> None:
        fh: list[int] = []

        async def on_mount() -> None:
            fh.append(await k.open(rel, os.O_RDWR | os.O_CREAT, mkdirs=True))

        fd: list[int] = []
        await self.both(f"hold {rel}", on_mount(),
                        lambda: fd.append(self.oracle.open(rel, os.O_RDWR | os.O_CREAT)))
        if fh and fd:
            self.held.append((fh[0], fd[0]))
        else:  # one side failed (reported): close what the other opened
            for h in fh:
                await k.close(h)
            for d in fd:
                os.close(d)

    async def _compare_read(self, k: Kernel, rel: str) -> None:
        got: list[bytes] = []

        async def on_mount() -> None:
            got.append(await k.read_all(rel))

        want: list[bytes] = []
        await self.both(f"read {rel}", on_mount(), lambda: want.append(self.oracle.read(rel)))
        if got and want and got[0] != want[0]:
            self.mismatches.append(f"call {self.calls} read {rel}: {len(got[0])} bytes on the "
                                   f"mount, {len(want[0])} in the oracle, or other bytes")

    # -- whole-tree checks -------------------------------------------------------------

    async def compare_tree(self, k: Kernel, parts: Parts, when: str) -> None:
        want = self.oracle.files()
        names = await k.files()
        if set(names) != set(want):
            self.mismatches.append(f"{when}: names differ: only on the mount "
                                   f"{sorted(set(names) - set(want))}, only in the oracle "
                                   f"{sorted(set(want) - set(names))}")
        for rel in sorted(set(names) & set(want)):
            got = await k.read_all(rel)
            if got != want[rel]:
                self.mismatches.append(f"{when}: {rel}: {len(got)} bytes on the mount, "
                                       f"{len(want[rel])} in the oracle, or other bytes")
        await self.check_states(parts, when)

    async def check_states(self, parts: Parts, when: str) -> None:
        """A pending file with no writer is in the state its tier-1 record says."""
        cache = parts.cache
        for pf in list(parts.journal.files.values()):
            if pf.sessions:
                continue
            async with pf.lock:
                entry = await parts.workers.disk(cache.open_existing, pf.key)
                record = None if entry is None else entry.state
                if entry is not None:
                    await parts.workers.disk(cache.release, entry)
                want = pf.state.record
                if want is not None and record not in (want, None if want == "clean" else want):
                    self.mismatches.append(f"{when}: {pf.key} is {pf.state.value}, "
                                           f"its record {record}")

    async def flush_and_compare_store(self, parts: Parts) -> None:
        """After a flush barrier every closed file is in the store as the oracle
        holds it; files held open are not (they are not closed yet)."""
        out = await parts.pending.flush("")
        if out.failed or out.gave_up:
            self.mismatches.append(f"flush at call {self.calls}: {out.asdict()}")
        held = {os.fstat(fd).st_ino for _, fd in self.held}
        want = self.oracle.files()
        open_now = {rel for rel in want if (self.oracle.root / rel).stat().st_ino in held}
        got = {str(p.relative_to(self.store)): p.read_bytes() for p in self.store.rglob("*")
               if p.is_file() and not p.name.startswith(".tierfs-") and p.name != ATTRS_OBJECT}
        for rel in sorted((want.keys() | got.keys()) - open_now):
            if got.get(rel) != want.get(rel):
                g, w = got.get(rel), want.get(rel)
                self.mismatches.append(
                    f"store after call {self.calls}: {rel}: "
                    f"{'absent' if g is None else len(g)} in the store, "
                    f"{'absent' if w is None else len(w)} in the oracle")

    async def close_all(self, k: Kernel) -> None:
        while self.held:
            fh, fd = self.held.pop()
            await self.both("close (all)", k.close(fh), lambda fd=fd: os.close(fd))

    async def run(self) -> None:
        steps = 0
        while self.calls < OPS:
            async with harness_mount(self.cfg) as parts:
                k = Kernel(parts)
                await self.compare_tree(k, parts, f"mounted at call {self.calls}")
                for _ in range(REMOUNT_EVERY):
                    if self.calls >= OPS:
                        break
                    await self.step(k, parts)
                    steps += 1
                    if steps % CHECK_EVERY == 0:
                        await self.compare_tree(k, parts, f"call {self.calls}")
                    if len(self.mismatches) > 20:
                        return
                await self.close_all(k)
                await self.flush_and_compare_store(parts)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """Where the store, the cache and the oracle live: a tmpfs where there is one.
    The model checks what the calls do, not what a disk makes durable, and every
    seal and upload fsyncs: on this machine's disk a seed took 37 s, on tmpfs 17."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tierfs-model-") as d:
        yield Path(d)


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_calls_match_the_oracle(seed: int, scratch: Path) -> None:
    model = Model(seed, scratch)
    await model.run()
    assert model.mismatches == []
    assert model.calls >= OPS  # every call ran on both sides
