"""What answering FUSE reads costs a pyfuse3 daemon at all, whoever writes it.

A minimal pyfuse3 filesystem (this file, `--serve`) holds one --size file in
memory and answers each read with a view of it: no store, no cache, no copy
in Python. It mounts with tierfs's FUSE options, worker tasks and kernel
readahead, and one `dd bs=1M` reads the file. Its threads' CPU per GiB is the
floor under "the daemon's Python threads" for any cold read through a
pyfuse3 mount (issue 34's target is 0.3 CPU-s per GiB), printed beside what
tierfs's threads spent on a cold read in bench/engine.py.

--files N (issue 34's small-files row): the minimal filesystem serves N files
of 100 KiB in bench/engine.py's layout (small/NN/NNNNN.jpg), opened as tierfs
opens a cold one (keep_cache, no direct_io, FOPEN_NOFLUSH; passthrough asked
for at init where tierfs would ask), and engine.py's readers (`xargs -P8 -n50
cat`) read them all: the daemon's CPU per file is the floor for any pyfuse3
daemon, with the requests it answered per file. In the same run, against a
SeaweedFS of its own seeded with the same N objects, the bare clients:
boto3 get_object with 8 threads (engine.py's reference) and a bare awscrt
S3Client with 8 GETs in flight (bodies into memory through on_body, and into
local files through recv_filepath), each with its process's and the server's
CPU. The summary is the bound on a pyfuse3 daemon that GETs with awscrt:
(floor + awscrt + server [+ readers]) CPU per file over the machine's cores,
against boto3's wall. Results: bench/results/fusefloor-small.json.

Usage: python bench/fusefloor.py [--size 1G] [--runs 3]
       python bench/fusefloor.py --files 10000 [--runs 3]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # common.py, engine.py (imported where used)

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


SMALL = 100 * 1024  # bench/engine.py's small object
PER_DIR = 1000  # files per small/NN directory (engine.py's seed_small)
FILE_TTL = 300.0  # tierfs's attr/entry timeout of a *.jpg (class "dataset")
DIR_TTL = 10.0  # ... and of a directory without a class of its own ("default")


def small_keys(n: int) -> list[str]:
    """bench/engine.py's seed_small names."""
    return [f"small/{i // PER_DIR:02d}/{i:05d}.jpg" for i in range(n)]


def serve_files(mountpoint: str, n: int, stats: str, passthrough: bool) -> None:
    """The minimal filesystem of `n` small files, until unmounted; then the
    requests it answered, by kind, as JSON in `stats`."""
    import pyfuse3
    import trio

    data = memoryview(bytes(SMALL))
    small_ino = pyfuse3.ROOT_INODE + 1
    dirs = (n + PER_DIR - 1) // PER_DIR
    first_file = small_ino + 1 + dirs
    # (parent, name) -> inode, and each directory's entries in order
    names: dict[tuple[int, bytes], int] = {(pyfuse3.ROOT_INODE, b"small"): small_ino}
    listing: dict[int, list[tuple[bytes, int]]] = {pyfuse3.ROOT_INODE: [(b"small", small_ino)],
                                                   small_ino: []}
    for d in range(dirs):
        ino = small_ino + 1 + d
        names[(small_ino, f"{d:02d}".encode())] = ino
        listing[small_ino].append((f"{d:02d}".encode(), ino))
        listing[ino] = []
    for i in range(n):
        parent, name = small_ino + 1 + i // PER_DIR, f"{i:05d}.jpg".encode()
        names[(parent, name)] = first_file + i
        listing[parent].append((name, first_file + i))
    count: Counter[str] = Counter()

    class Ops(pyfuse3.Operations):
        enable_passthrough = passthrough  # as tierfs asks where it may (fs.py)
        enable_writeback_cache = not passthrough

        def _attrs(self, inode: int) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            if inode < first_file:
                a.st_mode, a.st_size, a.st_nlink = stat.S_IFDIR | 0o755, 0, 2
                a.entry_timeout = a.attr_timeout = DIR_TTL
            else:
                a.st_mode, a.st_size, a.st_nlink = stat.S_IFREG | 0o644, SMALL, 1
                a.st_blocks = (SMALL + 511) // 512
                a.entry_timeout = a.attr_timeout = FILE_TTL
            a.st_blksize = 1 << 20
            return a

        async def lookup(self, parent: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
            count["lookup"] += 1
            ino = names.get((parent, name))
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attrs(ino)

        async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
            count["getattr"] += 1
            return self._attrs(inode)

        async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
            count["forget"] += 1  # one call per batch of inodes
            count["forgotten"] += len(inode_list)

        async def opendir(self, inode: int, ctx: object) -> int:
            count["opendir"] += 1
            return inode

        async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
            count["readdir"] += 1
            entries = listing.get(fh, [])
            for i in range(start_id, len(entries)):
                name, ino = entries[i]
                if not pyfuse3.readdir_reply(token, name, self._attrs(ino), i + 1):
                    return

        async def releasedir(self, fh: int) -> None:
            count["releasedir"] += 1

        async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
            count["open"] += 1
            info = pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)
            if hasattr(info, "noflush"):  # the patched pyfuse3, as tierfs's read handles
                info.noflush = True
            return info

        async def read(self, fh: int, off: int, size_: int) -> memoryview:  # type: ignore[override]
            count["read"] += 1
            return data[off : off + size_]

        async def flush(self, fh: int) -> None:
            count["flush"] += 1

        async def release(self, fh: int) -> None:
            count["release"] += 1

        async def getxattr(self, inode: int, name: bytes, ctx: object) -> bytes:
            count["getxattr"] += 1  # unimplemented, as in tierfs
            raise pyfuse3.FUSEError(errno.ENOSYS)

    options = set(pyfuse3.default_options)  # tierfs's (fuse/session.py), no allow_other
    options |= {"fsname=fusefloor", "subtype=fusefloor", "noatime", "nosuid", "nodev"}
    pyfuse3.init(Ops(), mountpoint, options)
    try:
        trio.run(lambda: pyfuse3.main(min_tasks=FUSE_TASKS[0], max_tasks=FUSE_TASKS[1]))
    finally:
        pyfuse3.close(unmount=False)
        Path(stats).write_text(json.dumps(dict(count)))


def _wait_mounted(proc: subprocess.Popen[bytes], path: Path) -> None:
    for _ in range(400):  # the mount is up once its first name is there
        if path.exists():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)  # polling for the mount to appear, not a measurement
    raise SystemExit("fusefloor: the minimal filesystem did not mount")


def _unmount(proc: subprocess.Popen[bytes], mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


def floor_small(work: Path, keys: list[str], passthrough: bool, server_pid: int) -> dict[str, Any]:
    """One cold read of every file through a fresh minimal daemon: wall, its
    CPU per file, the readers' (xargs + cat) CPU per file, requests per file."""
    from common import drop_caches, proc_cpu_seconds
    from engine import mount_small

    mnt, stats = work / "floor-mnt", work / "floor-stats.json"
    mnt.mkdir(exist_ok=True)
    stats.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve-files", str(mnt), str(len(keys)),
                             str(stats), "1" if passthrough else "0"])
    try:
        _wait_mounted(proc, mnt / "small")
        set_kernel_readahead(mnt, MountConfig.kernel_read_ahead_kb)
        drop_caches()
        c0, me0, s0 = thread_cpu(proc.pid), os.times(), proc_cpu_seconds(server_pid)
        secs = mount_small(mnt, keys)
        c1, me1, s1 = thread_cpu(proc.pid), os.times(), proc_cpu_seconds(server_pid)
    finally:
        _unmount(proc, mnt)
    n = len(keys)
    counts = json.loads(stats.read_text()) if stats.exists() else {}
    return {
        "seconds": secs,
        "daemon_ms": (c1["python"] + c1["runtime"] - c0["python"] - c0["runtime"]) * 1000 / n,
        "daemon_threads": c1["python_threads"] + c1["runtime_threads"],
        "readers_ms": (me1.children_user + me1.children_system
                       - me0.children_user - me0.children_system) * 1000 / n,
        "server_ms": (s1 - s0) * 1000 / n,
        "requests_per_file": {k: v / n for k, v in sorted(counts.items())},
    }


def crt_small(bare: Any, keys: list[str], into: Path | None) -> float:
    """`keys` through the bare awscrt client, 8 GETs in flight (8 threads, each
    waiting on one request at a time): bodies counted in on_body (into memory,
    nothing kept) or, with `into`, written by the runtime to one file per key."""
    from awscrt import s3
    from smallfiles import pulled

    def get(one: list[tuple[int, str]]) -> int:
        [(i, key)] = one
        req = bare._req("GET", key, [])
        if into is not None:
            path = into / f"{i:05d}"
            bare.client.make_request(type=s3.S3RequestType.GET_OBJECT, request=req,
                                     recv_filepath=str(path)).finished_future.result()
            return path.stat().st_size
        n = [0]

        def on_body(chunk: bytes, offset: int, **_: object) -> None:
            n[0] += len(chunk)

        bare.client.make_request(type=s3.S3RequestType.GET_OBJECT, request=req,
                                 on_body=on_body).finished_future.result()
        return n[0]

    t = time.perf_counter()
    total = pulled(list(enumerate(keys)), 8, 1, get)
    secs = time.perf_counter() - t
    if total != len(keys) * SMALL:
        raise RuntimeError(f"awscrt GETs returned {total} bytes, not {len(keys) * SMALL}")
    return secs


def client_small(run: Callable[[], float], keys: list[str],
                 server_pid: int) -> dict[str, Any]:
    """One cold pass of a bare client (page cache dropped first, as before the
    mount's in engine.py): wall, this process's CPU and the server's per object."""
    from common import drop_caches, proc_cpu_seconds

    drop_caches()
    me0, s0 = os.times(), proc_cpu_seconds(server_pid)
    secs = run()
    me1, s1 = os.times(), proc_cpu_seconds(server_pid)
    n = len(keys)
    return {"seconds": secs, "client_ms": (me1.user + me1.system - me0.user - me0.system) * 1000 / n,
            "server_ms": (s1 - s0) * 1000 / n}


def measure_small(n: int, runs: int) -> dict[str, Any]:
    """Per run: the floor daemon, boto3, and awscrt (memory, files), one SeaweedFS."""
    from common import Bench
    from engine import Bare, boto3_small, load, seed_small

    from tierfs.fuse.passthrough import probe

    res: dict[str, list[dict[str, Any]]] = {"floor": [], "boto3": [], "crt_mem": [], "crt_file": []}
    args = argparse.Namespace(workdir=None, runs=runs, size=SMALL)
    with Bench(args, "fusefloor-small") as b:
        passthrough = probe(b.work).enabled  # what tierfs would ask the kernel for here
        t = time.perf_counter()
        keys = seed_small(b, n)
        assert keys == small_keys(n)
        print(f"seeded {n} x 100 KiB in {time.perf_counter() - t:.1f} s; passthrough asked: "
              f"{passthrough}", flush=True)
        bare = Bare(b)
        pid = b.server_pid
        files = b.work / "crt-files"
        for run in range(runs):
            res["floor"].append({"at": time.strftime("%H:%M:%S"), "load": load(),
                                 **floor_small(b.work, keys, passthrough, pid)})
            res["boto3"].append(client_small(lambda: boto3_small(b, keys), keys, pid))
            res["crt_mem"].append(client_small(lambda: crt_small(bare, keys, None),
                                               keys, pid))
            files.mkdir(exist_ok=True)
            res["crt_file"].append(client_small(lambda: crt_small(bare, keys, files),
                                                keys, pid))
            shutil.rmtree(files)
            f = res["floor"][-1]
            print(f"run {run} (load {load()}): floor {f['seconds']:.2f} s, daemon "
                  f"{f['daemon_ms']:.3f} ms/file, readers {f['readers_ms']:.3f} ms/file, "
                  f"requests/file {f['requests_per_file']}; "
                  + "; ".join(f"{k} {r[-1]['seconds']:.2f} s, client {r[-1]['client_ms']:.3f} "
                              f"ms, server {r[-1]['server_ms']:.3f} ms"
                              for k, r in res.items() if k != "floor"), flush=True)
    return {"files": n, "passthrough_asked": passthrough, "finished": time.strftime("%H:%M:%S"),
            "runs": res}


def summarize(out: dict[str, Any], cores: int) -> dict[str, float]:
    """Medians, and the bound on a pyfuse3 daemon doing awscrt GETs (into memory)."""
    runs, n = out["runs"], out["files"]

    def med(stage: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[stage]))

    s = {
        "floor_seconds": med("floor", "seconds"), "floor_daemon_ms": med("floor", "daemon_ms"),
        "floor_readers_ms": med("floor", "readers_ms"),
        "boto3_seconds": med("boto3", "seconds"), "boto3_client_ms": med("boto3", "client_ms"),
        "boto3_server_ms": med("boto3", "server_ms"),
    }
    for k in ("crt_mem", "crt_file"):
        s |= {f"{k}_seconds": med(k, "seconds"), f"{k}_client_ms": med(k, "client_ms"),
              f"{k}_server_ms": med(k, "server_ms")}
    s["daemon_ms_bound"] = s["floor_daemon_ms"] + s["crt_mem_client_ms"]
    s["cpu_ms_bound"] = s["daemon_ms_bound"] + s["crt_mem_server_ms"]
    s["cpu_ms_bound_with_readers"] = s["cpu_ms_bound"] + s["floor_readers_ms"]
    for k in ("cpu_ms_bound", "cpu_ms_bound_with_readers"):
        wall = s[k] * n / 1000 / cores
        s[k.replace("cpu_ms", "seconds")] = wall
        s[k.replace("cpu_ms", "ratio_vs_boto3")] = wall / s["boto3_seconds"]
    s["cores"] = cores
    return s


def report_small(s: dict[str, float], n: int) -> None:
    from engine import load

    print(f"small files: {n} x 100 KiB, 8 readers / 8 in flight, medians "
          f"(load now {load()}):")
    print(f"  floor daemon (pyfuse3, from memory): {s['floor_seconds']:.2f} s, "
          f"{s['floor_daemon_ms']:.3f} ms CPU/file; readers (xargs+cat) "
          f"{s['floor_readers_ms']:.3f} ms/file")
    print(f"  boto3 get_object x8 threads:          {s['boto3_seconds']:.2f} s, client "
          f"{s['boto3_client_ms']:.3f} ms/obj, server {s['boto3_server_ms']:.3f} ms/obj")
    for k, what in (("crt_mem", "awscrt x8, on_body (memory)"),
                    ("crt_file", "awscrt x8, recv_filepath")):
        print(f"  {what + ':':37} {s[k + '_seconds']:.2f} s, client "
              f"{s[k + '_client_ms']:.3f} ms/obj, server {s[k + '_server_ms']:.3f} ms/obj")
    print(f"  a pyfuse3 daemon doing awscrt GETs: >= {s['daemon_ms_bound']:.3f} ms CPU/file "
          f"(floor + awscrt client; issue 34's target: 1.5)")
    print(f"  + server: {s['cpu_ms_bound']:.3f} ms/file over {s['cores']:.0f} cores = "
          f"{s['seconds_bound']:.2f} s = {s['ratio_vs_boto3_bound']:.2f}x boto3's wall "
          f"(target 0.8); + readers: {s['cpu_ms_bound_with_readers']:.3f} ms/file = "
          f"{s['seconds_bound_with_readers']:.2f} s = "
          f"{s['ratio_vs_boto3_bound_with_readers']:.2f}x")


def measure(size: int, runs: int) -> list[dict[str, float]]:
    """Per run: dd's seconds and the minimal daemon's CPU per GiB."""
    out: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fusefloor-") as tmp:
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        for _ in range(runs):
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(mnt), str(size)])
            try:
                _wait_mounted(proc, mnt / NAME.decode())
                set_kernel_readahead(mnt, MountConfig.kernel_read_ahead_kb)
                c0 = thread_cpu(proc.pid)
                t = time.perf_counter()
                subprocess.run(["dd", f"if={mnt / NAME.decode()}", "of=/dev/null", "bs=1M"],
                               check=True, stderr=subprocess.DEVNULL)
                secs = time.perf_counter() - t
                c1 = thread_cpu(proc.pid)
            finally:
                _unmount(proc, mnt)
            cpu = {k: (c1[k] - c0[k]) / (size / GiB) for k in ("python", "runtime")}
            out.append({"seconds": secs, **cpu})
            print(f"dd {secs:.2f} s; the minimal daemon's CPU per GiB: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) == 6 and sys.argv[1] == "--serve-files":
        serve_files(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1G", help="bytes read (K/M/G suffixes)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--files", type=int, default=0,
                   help="small-files mode: this many 100 KiB files, and the bare clients")
    a = p.parse_args()
    results = ROOT / "bench" / "results"
    if a.files:
        if a.files < 1 or a.runs < 1:
            raise SystemExit("fusefloor: --files and --runs must be positive")
        from common import need_weed

        need_weed()
        from engine import load

        out = measure_small(a.files, a.runs)
        out["summary"] = summarize(out, os.cpu_count() or 1)
        out["load_end"] = load()
        report_small(out["summary"], a.files)
        results.mkdir(exist_ok=True)
        (results / "fusefloor-small.json").write_text(json.dumps(out, indent=1))
        print(f"results: {results / 'fusefloor-small.json'}")
        return
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
    results.mkdir(exist_ok=True)
    (results / "fusefloor.json").write_text(json.dumps({"size": size, "runs": res}, indent=1))
    print(f"results: {results / 'fusefloor.json'}")


if __name__ == "__main__":
    main()
