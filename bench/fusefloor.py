"""What answering FUSE reads costs a pyfuse3 daemon at all, whoever writes it.

A minimal pyfuse3 filesystem (this file, `--serve`) holds one --size file in
memory and answers each read with a view of it: no store, no cache, no copy
in Python. It mounts with tierfs's FUSE options, worker tasks and kernel
readahead, and one `dd bs=1M` reads the file. Its threads' CPU per GiB is the
floor under "the daemon's Python threads" for any cold read through a
pyfuse3 mount (issue 34's target is 0.3 CPU-s per GiB), printed beside what
tierfs's threads spent on a cold read in bench/engine.py.

Usage: python bench/fusefloor.py [--size 1G] [--runs 3]
"""

from __future__ import annotations

import argparse
import errno
import json
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tierfs.config import FUSE_TASKS, MountConfig  # noqa: E402
from tierfs.fuse.kernel import set_kernel_readahead  # noqa: E402
from tierfs.store.crt import thread_cpu  # noqa: E402

GiB = 1 << 30
NAME = b"blob"
INODE = 2


def serve(mountpoint: str, size: int) -> None:
    """The minimal filesystem, until unmounted."""
    import pyfuse3
    import trio

    data = memoryview(bytes(size))  # zero pages: what a read returns is not the point

    class Ops(pyfuse3.Operations):
        def _attrs(self, inode: int) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            a.st_mode = (stat.S_IFDIR | 0o755) if inode == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o444)
            a.st_size = 0 if inode == pyfuse3.ROOT_INODE else size
            a.st_blksize = 1 << 20
            a.entry_timeout = a.attr_timeout = 300
            return a

        async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
            return self._attrs(inode)

        async def lookup(self, parent: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
            if parent != pyfuse3.ROOT_INODE or name != NAME:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attrs(INODE)

        async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
            return pyfuse3.FileInfo(fh=inode)

        async def read(self, fh: int, off: int, size_: int) -> memoryview:  # type: ignore[override]
            return data[off : off + size_]  # a view: the patched pyfuse3 replies from it

    options = set(pyfuse3.default_options) | {"fsname=fusefloor", "subtype=fusefloor", "ro"}
    pyfuse3.init(Ops(), mountpoint, options)
    try:
        trio.run(lambda: pyfuse3.main(min_tasks=FUSE_TASKS[0], max_tasks=FUSE_TASKS[1]))
    finally:
        pyfuse3.close(unmount=False)


def measure(size: int, runs: int) -> list[dict[str, float]]:
    """Per run: dd's seconds and the minimal daemon's CPU per GiB."""
    out: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fusefloor-") as tmp:
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        for _ in range(runs):
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(mnt), str(size)])
            try:
                for _ in range(200):  # the mount is up once its file is there
                    if (mnt / NAME.decode()).exists():
                        break
                    time.sleep(0.05)  # polling for the mount to appear, not a measurement
                else:
                    raise SystemExit("fusefloor: the minimal filesystem did not mount")
                set_kernel_readahead(mnt, MountConfig.kernel_read_ahead_kb)
                c0 = thread_cpu(proc.pid)
                t = time.perf_counter()
                subprocess.run(["dd", f"if={mnt / NAME.decode()}", "of=/dev/null", "bs=1M"],
                               check=True, stderr=subprocess.DEVNULL)
                secs = time.perf_counter() - t
                c1 = thread_cpu(proc.pid)
            finally:
                subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
            cpu = {k: (c1[k] - c0[k]) / (size / GiB) for k in ("python", "runtime")}
            out.append({"seconds": secs, **cpu})
            print(f"dd {secs:.2f} s; the minimal daemon's CPU per GiB: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1G", help="bytes read (K/M/G suffixes)")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20, "G": GiB}
    try:
        size = int(a.size[:-1]) * units[a.size[-1].upper()] if a.size[-1].isalpha() else int(a.size)
    except (KeyError, ValueError):
        raise SystemExit(f"fusefloor: bad --size {a.size!r} (e.g. 512M, 1G)") from None
    if size <= 0 or a.runs < 1:
        raise SystemExit("fusefloor: --size and --runs must be positive")
    res = measure(size, a.runs)
    per = sorted(r["python"] for r in res)
    print(f"median Python-thread CPU per GiB of a minimal pyfuse3 daemon: {per[len(per) // 2]:.2f} "
          f"(issue 34's target for tierfs's cold read: 0.30)")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "fusefloor.json").write_text(json.dumps({"size": size, "runs": res}, indent=1))
    print(f"results: {results / 'fusefloor.json'}")


if __name__ == "__main__":
    main()
