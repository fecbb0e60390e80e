"""The transfer engine (issue 34): tierfs through the AWS Common Runtime vs the
bare runtime, boto3, and (with --botocore) the same mount on the fallback engine.

Stages, each a median of --runs, all in one run against one SeaweedFS:
  read1   cold `dd bs=1M` of a --size object (fresh tier 1, page cache dropped)
          vs a bare awscrt GET of it into a local file (recv_filepath)
  write1  `dd conv=fsync` of a --size file into the mount + `tierfs flush`
          (until the object is in the bucket) vs a bare awscrt PUT of the file;
          beside them the bound of any write-then-upload: the same dd into a
          local file on the disk tier 1 is on, then the bare PUT of it
          (`ext4_then_put_1`); with --stream also a mount whose classes have
          `stream_parts = true` (parts go up while dd writes)
  read4   4 readers of 4 different cold --size objects at once vs 4 bare GETs at once
  small   --files x 100 KiB cold, 8 readers (`xargs -P8 cat`) vs boto3 get_object
          with 8 threads
For tierfs, the daemon's CPU split by thread (/proc/PID/task/*/comm): "python"
is every thread but the runtime's `AwsEventLoop...` ones ("runtime"), in
seconds per GiB (per file for `small`). Machine load is printed beside it.
--before TREE: the same stages on a mount of another source tree (its
defaults, no config file: e.g. the commit before the engine), for an A/B.

Usage: python bench/engine.py [--size 1G] [--runs 3] [--files 10000] [--botocore]
           [--stream] [--before TREE] [--skip read4,...]
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from awscrt import http, s3
from common import (
    BUCKET,
    Bench,
    MiB,
    bare_crt,
    drop_caches,
    median,
    parse_args,
    report,
    write_random_file,
)

from tests.support.mount import TierfsMount
from tierfs.store.crt import thread_cpu

GiB = 1 << 30
SMALL = 100 * 1024


class Bare:
    """A bare awscrt S3Client as a user would make one (the runtime's defaults, path-style)."""

    def __init__(self, b: Bench) -> None:
        self.client, self.host = bare_crt(b.server.env())

    def _req(self, method: str, key: str, extra: list[tuple[str, str]]) -> http.HttpRequest:
        return http.HttpRequest(method, f"/{BUCKET}/{key}",
                                http.HttpHeaders([("Host", self.host), *extra]))

    def get(self, keys: list[str], into: Path) -> float:
        t = time.perf_counter()
        reqs = [self.client.make_request(type=s3.S3RequestType.GET_OBJECT,
                                         request=self._req("GET", k, []),
                                         recv_filepath=str(into / f"bare-{i}"))
                for i, k in enumerate(keys)]
        for r in reqs:
            r.finished_future.result()
        return time.perf_counter() - t

    def put(self, key: str, path: Path) -> float:
        t = time.perf_counter()
        self.client.make_request(
            type=s3.S3RequestType.PUT_OBJECT, send_filepath=str(path),
            request=self._req("PUT", key, [("Content-Length", str(path.stat().st_size))]),
        ).finished_future.result()
        return time.perf_counter() - t


def mount_tree(b: Bench, tree: Path) -> TierfsMount:
    """A mount of the tierfs in `tree` (its defaults), in `b`'s bucket."""
    b._n += 1
    m = TierfsMount(source=f"s3://{BUCKET}", mountpoint=b.work / f"mnt{b._n}",
                    cache_dir=b.work / f"cache{b._n}", env={**b.env, "PYTHONPATH": str(tree)})
    b.mounts.append(m)
    return m.start()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in ("python", "runtime")}


def dd_read(paths: list[Path]) -> float:
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=1M"],
                              stderr=subprocess.DEVNULL) for p in paths]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("dd failed")
    return time.perf_counter() - t


def dd_write(src: Path, dst: Path) -> None:
    subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M", "conv=fsync"], check=True,
                   stderr=subprocess.DEVNULL, env={**os.environ, "LC_ALL": "C"})


def seed_small(b: Bench, n: int) -> list[str]:
    keys = [f"small/{i // 1000:02d}/{i:05d}.jpg" for i in range(n)]
    body = os.urandom(SMALL)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: b.client.put_object(Bucket=BUCKET, Key=k, Body=body), keys))
    return keys


def boto3_small(b: Bench, keys: list[str]) -> float:
    local = threading.local()

    def get(k: str) -> int:
        if not hasattr(local, "c"):
            local.c = b.server.client()
        return len(local.c.get_object(Bucket=BUCKET, Key=k)["Body"].read())

    t = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        assert sum(ex.map(get, keys)) == len(keys) * SMALL
    return time.perf_counter() - t


def mount_small(mnt: Path, keys: list[str]) -> float:
    listing = "\n".join(str(mnt / k) for k in keys).encode()
    t = time.perf_counter()
    subprocess.run(["xargs", "-P8", "-n50", "cat"], input=listing, stdout=subprocess.DEVNULL,
                   check=True)
    return time.perf_counter() - t


def main() -> None:
    def extra(p) -> None:  # type: ignore[no-untyped-def]
        p.add_argument("--files", type=int, default=10_000)
        p.add_argument("--botocore", action="store_true",
                       help="also the same mount with [store] engine = \"botocore\"")
        p.add_argument("--stream", action="store_true",
                       help="also a mount with stream_parts = true (write1 only)")
        p.add_argument("--skip", default="", help="comma-separated stages to skip")
        p.add_argument("--before", default=None,
                       help="another source tree, mounted with its defaults as 'before'")

    args = parse_args(__doc__.splitlines()[0], GiB, 3, extra)
    skip = set(filter(None, args.skip.split(",")))
    engines = ["crt", *(["botocore"] if args.botocore else []),
               *(["before"] if args.before else []), *(["stream"] if args.stream else [])]
    with Bench(args, "engine") as b:
        os.chdir(b.work)  # `python -m tierfs` of a --before tree imports what PYTHONPATH names
        size = args.size
        gib = size / GiB
        src = b.work / "src.bin"
        write_random_file(src, size)
        big = [f"big/shard-{i}.tar" for i in range(4)]
        for k in big if "read4" not in skip else big[:1]:
            b.seed(k, src)
        keys = seed_small(b, args.files) if "small" not in skip else []
        bare = Bare(b)
        readers = [e for e in engines if e != "stream"]  # stream_parts changes writes only
        mounts: dict[str, Callable[[], TierfsMount]] = {}
        for e in engines:
            if e == "before":
                mounts[e] = partial(mount_tree, b, Path(args.before).resolve())
                continue
            conf = b.work / f"{e}.toml"
            conf.write_text(f'[store]\nengine = "{e}"\n' if e != "stream" else "".join(
                f"[classes.{c}]\nstream_parts = true\n" for c in ("default", "checkpoint", "dataset")))
            mounts[e] = partial(b.mount, None, "--config", str(conf))
        t: dict[str, list[float]] = {}
        cpu: dict[str, list[dict[str, float]]] = {}

        def rec(name: str, secs: float, use: dict[str, float] | None = None,
                per: float = 1.0) -> None:
            t.setdefault(name, []).append(secs)
            if use is not None:
                cpu.setdefault(name, []).append({k: v / per for k, v in use.items()})

        out = b.work / "out"
        out.mkdir()
        for run in range(args.runs):
            if "read1" not in skip:
                drop_caches()
                rec("bare_get_1", bare.get(big[:1], out))
                for e in readers:
                    m = mounts[e]()
                    drop_caches()
                    c0 = thread_cpu(m.pid)
                    secs = dd_read([m.mountpoint / big[0]])
                    rec(f"{e}_read_1", secs, split(c0, thread_cpu(m.pid)), gib)
                    b.unmount(m)
            if "write1" not in skip:
                rec("bare_put_1", bare.put(f"bare/put-{run}", src))
                local = b.work / "local.bin"
                t0 = time.perf_counter()
                dd_write(src, local)
                rec("ext4_dd_1", time.perf_counter() - t0)
                rec("ext4_then_put_1", t["ext4_dd_1"][-1] + bare.put(f"bare/local-{run}", local))
                local.unlink()
                for e in engines:
                    m = mounts[e]()
                    c0 = thread_cpu(m.pid)
                    t0 = time.perf_counter()
                    dd_write(src, m.mountpoint / f"w-{e}-{run}.pt")
                    dd = time.perf_counter() - t0
                    b.flush(m)
                    secs = time.perf_counter() - t0
                    rec(f"{e}_write_1", secs, split(c0, thread_cpu(m.pid)), gib)
                    rec(f"{e}_write_1_dd", dd)
                    b.unmount(m)
            if "read4" not in skip:
                drop_caches()
                rec("bare_get_4", bare.get(big, out))
                for e in readers:
                    m = mounts[e]()
                    drop_caches()
                    c0 = thread_cpu(m.pid)
                    secs = dd_read([m.mountpoint / k for k in big])
                    rec(f"{e}_read_4", secs, split(c0, thread_cpu(m.pid)), 4 * gib)
                    b.unmount(m)
            if "small" not in skip:
                rec("boto3_small_8", boto3_small(b, keys))
                for e in readers:
                    m = mounts[e]()
                    drop_caches()
                    c0 = thread_cpu(m.pid)
                    secs = mount_small(m.mountpoint, keys)
                    rec(f"{e}_small_8", secs, split(c0, thread_cpu(m.pid)), len(keys) / 1000)
                    b.unmount(m)
            print(f"run {run} (load {load()}): "
                  + ", ".join(f"{k}={v[-1]:.2f}s" for k, v in t.items()), flush=True)
        med = {k: median(v) for k, v in t.items()}
        cpu_med = {k: {n: median([u[n] for u in v]) for n in v[0]} for k, v in cpu.items()}
        ratios: dict[str, float] = {}
        for e in engines:
            for stage, ref in (("read_1", "bare_get_1"), ("write_1", "bare_put_1"),
                               ("write_1", "ext4_then_put_1"),
                               ("read_4", "bare_get_4"), ("small_8", "boto3_small_8")):
                if f"{e}_{stage}" in med and ref in med:
                    ratios[f"{e}_{stage}_vs_{ref}"] = med[f"{e}_{stage}"] / med[ref]
                if e != "crt" and f"crt_{stage}" in med and f"{e}_{stage}" in med:
                    ratios[f"crt_{stage}_vs_{e}"] = med[f"crt_{stage}"] / med[f"{e}_{stage}"]
        b.result.update(seconds=t, seconds_median=med, ratios=ratios, cpu_median=cpu_med,
                        cpu=cpu, files=len(keys), load_end=load())
        print(f"engine bench, {size / MiB:.0f} MiB objects, {len(keys)} small files, "
              f"median of {args.runs} (load now {load()}):")
        report([(k, f"{v:8.2f} s") for k, v in med.items()])
        print("time ratios (lower is faster; targets: read_1, write_1 <= 1.05; "
              "read_4 <= 1/0.95; small <= 0.8):")
        report([(k, f"{v:6.2f}") for k, v in ratios.items()])
        print("daemon CPU, seconds per GiB (read/write) or ms per file (small): "
              "python = every thread but AwsEventLoop*")
        report([(k, ", ".join(f"{n} {x:.2f}" for n, x in v.items())) for k, v in cpu_med.items()])
        b.save()


if __name__ == "__main__":
    main()
