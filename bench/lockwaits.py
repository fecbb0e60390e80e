"""What a file's seal or upload makes other requests wait (issue 33: the per-file
lock guards state changes only).

Two scenes, each measured on this tree and (with --before TREE) on another
source tree in the same run, alternating, plus a local ext4 reference:

  seal     a 1 GiB write-back checkpoint written top down (so the seal's fsync
           writes ~1 GiB), then fsync'd; meanwhile O_DIRECT 1 MiB reads of it
           through another descriptor, and stats of other names (attr_ttl 0:
           every one reaches the daemon). Latencies of the requests that were
           waiting at some moment between the fsync's start and the end of the
           checksums taken after it.
  through  a write-through close of a 64 MiB file with the store behind a
           100 Mbit/s link (tc on lo for the store's port: --store-rate), so the
           close waits ~5 s for its upload; meanwhile fstat and O_DIRECT 4 KiB
           reads of the same file through another descriptor, and truncate(2)
           of two other write-back files: a checkpoint (each truncate meets
           that file's own upload in flight) and a dataset file (nothing of
           its own in flight: only what the close holds up). Latencies during
           the close.

Prints p50/p99 per kind and tree, the load average, and writes JSON; the
mount's waits for a file's lock (all, and while that file uploaded: `tierfs
status`) after each scene. --profile: py-spy of the daemon during the seal.

    python bench/lockwaits.py [--before /tmp/base-wb33] [--after TREE|none] [--runs 3] [--size 1G]
        [--through-size 64M] [--store-rate 100mbit]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from common import BUCKET, RESULTS, Bench, GiB, MiB, parse_args, py_spy, shaped_uploads

from tests.support.mount import TierfsMount

NO_ATTR_CACHE = """
[classes.default]
attr_ttl = 0
list_ttl = 300
[classes.checkpoint]
attr_ttl = 0
list_ttl = 300
"""
THROUGH = """
[classes.default]
attr_ttl = 0
list_ttl = 300
write_mode = "writethrough"
[classes.checkpoint]
attr_ttl = 0
list_ttl = 300
"""


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": pct(xs, 0.5) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3,
            "max_ms": max(xs, default=float("nan")) * 1e3}


def during(samples: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """Requests that were waiting at some moment of [start, end]."""
    return [s for t, s in samples if t <= end and t + s >= start]


class Loop(threading.Thread):
    """Runs `step` until stopped, timing each call: (start, seconds)."""

    def __init__(self, step: Any, pause: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.step, self.pause = step, pause
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                self.step()
                self.samples.append((t0, time.monotonic() - t0))
                if self.pause:
                    time.sleep(self.pause)
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def finish(self) -> list[tuple[float, float]]:
        self.stop.set()
        self.join(120)
        if self.error is not None:
            raise self.error
        return self.samples


def seal_scene(root: Path, size: int, wait_checksums: Any) -> dict[str, Any]:
    """In directory `root` (a mount, or a local dir): the seal scene's latencies."""
    for i in range(8):
        (root / f"d{i}").mkdir(exist_ok=True)
    path = root / "big.pt"  # checkpoint class: write-back
    piece = os.urandom(4 * MiB)
    wfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    low = [size]
    rng = random.Random(5)
    srng = random.Random(6)

    def read() -> None:
        first = low[0] // MiB
        if first >= size // MiB:
            time.sleep(0.001)
            return
        os.preadv(rfd, [buf], rng.randrange(first, size // MiB) * MiB)

    def look() -> None:
        os.stat(root / f"d{srng.randrange(8)}")

    loops = [Loop(read), Loop(look, 0.002)]
    for lp in loops:
        lp.start()
    try:
        while low[0] > 0:  # top down: the seal's fsync writes it all
            os.pwrite(wfd, piece, low[0] - len(piece))
            low[0] -= len(piece)
        start = time.monotonic()
        os.fsync(wfd)
        wait_checksums()
        end = time.monotonic()
    finally:
        reads, looks = (lp.finish() for lp in loops)
        os.close(rfd)
        os.close(wfd)
    os.unlink(path)
    return {"seal_s": end - start, "read": summary(during(reads, start, end)),
            "lookup": summary(during(looks, start, end))}


def through_scene(root: Path, size: int) -> dict[str, Any]:
    """In `root`: a close that uploads (write-through) and what waits meanwhile."""
    # Two other files truncated meanwhile: a checkpoint (uploads at once, so each
    # truncate meets its own upload in flight) and a dataset file (its quiet
    # delay outlasts the 2 ms between truncates: nothing of its own in flight).
    path, other, quiet = root / "out.txt", root / "other.pt", root / "other.bin"
    for f in (other, quiet):
        f.write_bytes(os.urandom(MiB))
    data = os.urandom(size)
    wf = open(path, "wb")  # noqa: SIM115 (closed below, timed)
    wf.write(data)
    wf.flush()
    rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    rng = random.Random(7)
    sizes = iter(range(1 << 62))

    def stat_read() -> None:
        os.fstat(rfd)
        os.preadv(rfd, [buf], rng.randrange(0, size // 4096) * 4096)

    def cut() -> None:
        os.truncate(other, MiB - 4096 * (next(sizes) % 2))

    def cut_quiet() -> None:
        os.truncate(quiet, MiB - 4096 * (next(sizes) % 2))

    loops = [Loop(stat_read, 0.002), Loop(cut, 0.002), Loop(cut_quiet, 0.002)]
    for lp in loops:
        lp.start()
    try:
        time.sleep(0.2)
        start = time.monotonic()
        wf.close()  # write-through: returns once the store has it
        end = time.monotonic()
    finally:
        with contextlib.suppress(OSError):
            wf.close()
        stats, cuts, quiet_cuts = (lp.finish() for lp in loops)
        os.close(rfd)
    return {"close_s": end - start, "fstat_read": summary(during(stats, start, end)),
            "truncate_other": summary(during(cuts, start, end)),
            "truncate_quiet": summary(during(quiet_cuts, start, end))}


def lock_waits(m: TierfsMount) -> tuple[int, int] | None:
    """(waits for any file's lock, those while that file uploaded); None before
    the counts existed (an older tree)."""
    pending = m.status()["pending"]
    if "lock_waits" not in pending:
        return None
    return pending["lock_waits"], pending["lock_waits_uploading"]


def mount(b: Bench, tree: Path, config: str, tag: str) -> TierfsMount:
    cfg = b.work / f"{tag}.toml"
    cfg.write_text(config)
    b._n += 1
    env = {**b.env, "PYTHONPATH": str(tree)}
    m = TierfsMount(source=f"s3://{BUCKET}", mountpoint=b.work / f"mnt{b._n}",
                    cache_dir=b.work / f"cache{b._n}", env=env, extra=["--config", str(cfg)])
    b.mounts.append(m)
    return m.start()


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--before", default=None, help="another source tree, measured alike")
        p.add_argument("--after", default=None,
                       help="the tree measured as 'after' (default: this one; 'none': skip)")
        p.add_argument("--through-size", default="64M")
        p.add_argument("--store-rate", default="100mbit")
        p.add_argument("--scene", choices=("seal", "through", "both"), default="both")

    args = parse_args(__doc__ or "", GiB, 3, extra)
    through_size = int(args.through_size.rstrip("Mm")) * MiB
    here = Path(__file__).resolve().parent.parent
    after = None if args.after == "none" else Path(args.after).resolve() if args.after else here
    trees = ({"after": after} if after else {}) | (
        {"before": Path(args.before).resolve()} if args.before else {})
    with Bench(args, "lockwaits") as b:
        os.chdir(b.work)  # `python -m tierfs` must import the tree PYTHONPATH names
        out: dict[str, Any] = {name: {"seal": [], "through": []} for name in trees}
        out["local"] = {"seal": [], "through": []}
        local = b.work / "local"
        local.mkdir()
        for run in range(args.runs):
            order = list(trees.items())
            if run % 2:
                order.reverse()
            if args.scene in ("seal", "both"):
                out["local"]["seal"].append(seal_scene(local, args.size, lambda: None))
                for name, tree in order:
                    m = mount(b, tree, NO_ATTR_CACHE, f"seal-{name}")

                    def checksums(m: TierfsMount = m) -> None:
                        deadline = time.monotonic() + 300
                        while m.status()["pending"]["checksums_pending"]:
                            if time.monotonic() > deadline:
                                raise RuntimeError("checksums never taken")
                            time.sleep(0.01)

                    assert m.pid is not None
                    with py_spy(m.pid, RESULTS / f"lockwaits-seal-{name}-{run}.speedscope.json",
                                args.profile):
                        res = seal_scene(m.mountpoint, args.size, checksums)
                    res["load"] = os.getloadavg()[0]
                    res["lock_waits"] = lock_waits(m)
                    out[name]["seal"].append(res)
                    print(f"run {run} seal {name}: {res}", flush=True)
                    b.unmount(m)
            if args.scene in ("through", "both"):
                out["local"]["through"].append(through_scene(local, through_size))
                with shaped_uploads(b.server.s3_port, args.store_rate):
                    for name, tree in order:
                        m = mount(b, tree, THROUGH, f"through-{name}")
                        res = through_scene(m.mountpoint, through_size)
                        res["load"] = os.getloadavg()[0]
                        res["lock_waits"] = lock_waits(m)
                        out[name]["through"].append(res)
                        print(f"run {run} through {name}: {res}", flush=True)
                        b.unmount(m)
        b.result.update(out, store_rate=args.store_rate, through_size=through_size,
                        trees={k: str(v) for k, v in trees.items()})
        print(f"\nload average now {os.getloadavg()}")
        for scene, kinds in (("seal", ("read", "lookup")),
                             ("through", ("fstat_read", "truncate_other", "truncate_quiet"))):
            for name in [*trees, "local"]:
                runs = out[name][scene]
                if not runs:
                    continue
                cols = "  ".join(
                    f"{k} p99 {statistics.median(r[k]['p99_ms'] for r in runs):7.1f} ms "
                    f"(p50 {statistics.median(r[k]['p50_ms'] for r in runs):5.1f}, "
                    f"n {sum(r[k]['n'] for r in runs)})" for k in kinds)
                print(f"{scene:8s} {name:7s} {cols}")
        b.save()


if __name__ == "__main__":
    main()
