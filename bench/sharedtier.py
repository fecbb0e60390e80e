"""A replica herd through a shared tier: N nodes load one model, the origin pays once.

Two SeaweedFS servers: the origin, whose egress (bytes sent from its S3 port)
is limited with tc to --origin-rate (a WAN link), and the shared tier, not
limited. A model of --size bytes in --shards safetensors shards. Per run:

  alone   one tierfs mount without the shared tier loads the model cold (the reference)
  herd    N mounts (own cache dirs) with --shared-cache load it at the same moment;
          claims won / lost / expired summed over the herd
  bare    the bound this machine sets: N processes started at once doing the herd's
          work ideally with no tierfs, through bare awscrt S3Clients (16 x 16 MiB
          here: ~0.35 client CPU-s for GETs or PUTs, boto3 threads 0.36-0.94 and
          0.66-0.74; the store's CPU the same either way). The same
          blocks (tierfs's block size and names, a fresh prefix); node i owns
          blocks i, i+N, ... of the model (in shard order): GETs each from the
          shaped origin (--bare-fetches at once: tierfs's origin_fetches), PUTs it
          to the shared tier, announces it on a multiprocessing queue (free,
          ideal coordination); every node GETs each block it does not own from the
          shared tier once announced (4 at once); every block goes into a local
          file per shard at its offset (as tier 1), and a node loads each shard
          (load_file) once all its blocks are local. Wall: until its loads and
          its puts are done. Shard files checked by sha256 after the timing
  today   N boto3 processes GET the whole model from the shaped origin at once:
          what N nodes without a shared tier pay (N copies through one link)
  fifth   one more mount after the herd: origin bytes (should be 0), and its
          load against boto3 GETs of the same block objects from the shared tier;
          and N boto3 processes GETting them all at once: what this machine allows
          a herd reading from the shared tier (the bound when it is not the link)
  kill    a new herd (new shared prefix); the daemon holding the first claim is
          killed with -9: how much later than the herd the others finish (target
          <= lease + one block's fetch), every byte checked
  corrupt one block of the fifth node's prefix overwritten by boto3 (its metadata
          kept): a new node detects it, never serves it, fetches it from the origin
  nocond  the shared tier behind a proxy that answers conditional PUTs 501 (a
          store without conditional writes): every node fetches for itself

`today` and `nocond` each send N copies through the shaped link (N x the
alone time): they run in the first --heavy-runs runs only.

"Origin bytes" are the daemons' own GET byte counters, and beside them what tc
counted leaving the origin's port (headers and listings included). Every load
is safetensors.numpy.load_file of each shard in turn, page cache dropped first;
bytes are checked after the timing (sha256 of each shard read back through the
mount against the local file's). Medians of --runs; the machine load beside them.

Usage: python bench/sharedtier.py [--size 1G] [--shards 4] [--nodes 4] [--runs 3]
                                   [--origin-rate 400mbit] [--lease 30] [--heavy-runs 1]
                                   [--engine crt|botocore]
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from awscrt import http, s3
from botocore.exceptions import ClientError
from common import (
    BUCKET,
    Bench,
    GiB,
    MiB,
    bare_crt,
    drop_caches,
    median,
    parse_args,
    proc_cpu_seconds,
    report,
)
from safetensors.numpy import load_file, save_file

from tests.fault.proxy import FaultProxy, Rule
from tests.support.mount import TierfsMount, is_mounted
from tests.support.seaweed import SeaweedServer
from tierfs.config import SHARED_BLOCK, SHARED_ORIGIN_FETCHES
from tierfs.sharedtier.blocks import BlockRef, Blocks

SHARED_BUCKET = "shared"
TENSOR = 16 * MiB
CLAIM_POLL = 0.02
BARE_TAKES = 4  # shared-tier GETs a bare node has in flight at once


def make_shards(work: Path, size: int, shards: int) -> list[Path]:
    rng = np.random.default_rng(0)
    per = max(1, size // shards // TENSOR)
    paths = []
    for s in range(shards):
        p = work / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layers.{s}.{i}.weight":
                   rng.standard_normal(TENSOR // 4, dtype=np.float32).reshape(-1, 1024)
                   for i in range(per)}, str(p))
        paths.append(p)
    return paths


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _load(paths: list[str], start: Any, out: Any, tag: int) -> None:
    start.wait()
    t = time.perf_counter()
    try:
        for p in paths:
            tensors = load_file(p)
            assert sum(a.nbytes for a in tensors.values()) > 0
            del tensors
        out.put((tag, time.perf_counter() - t, None))
    except Exception as exc:  # a node whose daemon was killed (OSError, SafetensorError)
        out.put((tag, time.perf_counter() - t, f"{type(exc).__name__}: {exc}"))


def load_together(nodes: list[list[str]]) -> tuple[dict[int, float], dict[int, str]]:
    """Every node's loader starts at the same moment: (wall by node, errors by node)."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_load, args=(paths, start, out, i)) for i, paths in enumerate(nodes)]
    for p in ps:
        p.start()
    time.sleep(0.3)
    start.set()
    walls: dict[int, float] = {}
    errors: dict[int, str] = {}
    while len(walls) < len(ps):
        try:
            tag, wall, err = out.get(timeout=1)
        except queue.Empty:
            for i, p in enumerate(ps):  # a loader that died without a word
                if i not in walls and p.exitcode is not None and out.empty():
                    walls[i], errors[i] = float("nan"), f"loader exited {p.exitcode}"
            continue
        walls[tag] = wall
        if err is not None:
            errors[tag] = err
    for p in ps:
        p.join()
    return walls, errors


@contextlib.contextmanager
def shaped_egress(port: int, rate: str) -> Iterator[Any]:
    """Bytes sent FROM 127.0.0.1:`port` (the origin's S3 port: its GET bodies)
    limited to `rate`; yields a function giving the bytes tc has sent so far in
    the limited class. An HTB qdisc on lo, removed on exit."""
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb",
                    "default", "10"], check=True)
    try:
        for cmd in (["class", "add", "dev", "lo", "parent", "1:", "classid", "1:10",
                     "htb", "rate", "100gbit"],
                    ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:20",
                     "htb", "rate", rate, "ceil", rate],
                    ["filter", "add", "dev", "lo", "protocol", "ip", "parent", "1:0", "prio",
                     "1", "u32", "match", "ip", "sport", str(port), "0xffff", "flowid", "1:20"]):
            subprocess.run(["tc", *cmd], check=True, stderr=subprocess.DEVNULL)

        def sent() -> int:
            out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo", "classid", "1:20"],
                                 capture_output=True, text=True, check=True).stdout
            m = re.search(r"Sent (\d+) bytes", out)
            return int(m.group(1)) if m else 0

        yield sent
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


class Herd:
    """The bench's mounts: each its own cache dir; unmounted and wiped after use."""

    def __init__(self, b: Bench, shared: SeaweedServer, args: Any, files: list[Path]) -> None:
        self.b, self.shared, self.args = b, shared, args
        self.keys = [f"models/llm/{p.name}" for p in files]
        self.digests = {k: sha256_file(p) for k, p in zip(self.keys, files, strict=True)}
        for k, p in zip(self.keys, files, strict=True):
            b.seed(k, p)
        store = "" if args.engine is None else f'[store]\nengine = "{args.engine}"\n'
        self.alone_config = b.work / "alone.toml"
        self.alone_config.write_text(store)
        self.config = b.work / "shared.toml"
        self.config.write_text(f'{store}[shared]\nlease = {args.lease}\n')

    def mount(self, prefix: str | None, endpoint: str | None = None) -> TierfsMount:
        extra = ["--config", str(self.alone_config)] if prefix is None else [
            "--config", str(self.config), "--shared-cache", f"s3://{SHARED_BUCKET}/{prefix}",
            "--shared-endpoint-url", endpoint or self.shared.endpoint]
        return self.b.mount(None, *extra)

    def done(self, mounts: list[TierfsMount]) -> None:
        for m in mounts:
            if m.pid is None and is_mounted(m.mountpoint):
                m.cleanup()  # killed: a dead mount
            else:
                self.b.unmount(m)
            shutil.rmtree(m.cache_dir, ignore_errors=True)

    def paths(self, m: TierfsMount) -> list[str]:
        return [str(m.mountpoint / k) for k in self.keys]

    def verified(self, m: TierfsMount) -> bool:
        return all(sha256_file(m.mountpoint / k) == self.digests[k] for k in self.keys)


def origin_bytes(mounts: list[TierfsMount]) -> float:
    return sum(m.metric("tierfs_store_bytes_total{op=get}") for m in mounts)


def cpu_s(pid: int | None) -> float:
    """CPU seconds of process `pid`; 0 for none, or for one gone (a daemon killed)."""
    try:
        return 0.0 if pid is None else proc_cpu_seconds(pid)
    except OSError:
        return 0.0


def shared_requests(mounts: list[TierfsMount]) -> list[dict[str, float]]:
    """Each mount's shared-tier requests by op (and status where not ok), and its
    shared-tier counters (block puts, polls)."""
    out = []
    for m in mounts:
        metrics = m.status()["metrics"]
        got: dict[str, float] = {}
        for k, v in metrics.items():
            r = re.match(r"tierfs_store_requests_total\{op=shared_(\w+),status=(\w+)\}", k)
            if r:
                op = r[1] if r[2] == "ok" else f"{r[1]}:{r[2]}"
                got[op] = got.get(op, 0.0) + v
        for c in ("puts", "claims_won", "claims_lost", "hits", "misses"):
            got[f"n_{c}"] = metrics.get(f"tierfs_shared_{c}_total", 0.0)
        out.append(got)
    return out


def claims(mounts: list[TierfsMount], what: str) -> float:
    return sum(m.metric(f"tierfs_shared_claims_{what}_total") for m in mounts)


def shared_blocks(client: Any, prefix: str) -> list[tuple[str, int]]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=SHARED_BUCKET,
                                                                  Prefix=prefix + "/"):
        out += [(o["Key"], o["Size"]) for o in page.get("Contents", [])
                if not o["Key"].endswith(".claim")]
    return out


def boto_get_all(client: Any, keys: list[tuple[str, int]], threads: int,
                 bucket: str = SHARED_BUCKET) -> tuple[float, int]:
    """GET every block object whole into a reused buffer per thread: the shared
    tier's speed for these bytes as a plain client sees it."""
    local = threading.local()

    def get(item: tuple[str, int]) -> int:
        key, size = item
        if getattr(local, "buf", None) is None or len(local.buf) < size:
            local.buf = memoryview(bytearray(size))
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        got = 0
        while got < size and (n := body.readinto(local.buf[got:size])):
            got += n
        return got

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(get, keys))
    return time.perf_counter() - t, total


def _boto_node(server: SeaweedServer, bucket: str, keys: list[tuple[str, int]], threads: int,
               start: Any, out: Any) -> None:
    client = server.client()
    start.wait()
    out.put(boto_get_all(client, keys, threads, bucket)[0])


def boto_herd(server: SeaweedServer, keys: list[tuple[str, int]], nodes: int,
              threads: int, bucket: str = SHARED_BUCKET) -> float:
    """`nodes` boto3 processes GET every key of `bucket` on `server` at once (the
    slowest one's seconds): from the shared tier, what this machine allows a herd
    reading from it; from the origin, what N nodes without a shared tier pay."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_boto_node, args=(server, bucket, keys, threads, start, out))
          for _ in range(nodes)]
    for p in ps:
        p.start()
    time.sleep(0.5)
    start.set()
    walls = [out.get() for _ in ps]
    for p in ps:
        p.join()
    return max(walls)


class Crt:
    """A bare awscrt S3Client of one server (the runtime's defaults, path-style):
    blocking GETs into a file at an offset, PUTs from memory."""

    def __init__(self, env: dict[str, str]) -> None:
        self.client, self.host = bare_crt(env)

    def _req(self, method: str, bucket: str, key: str, headers: list[tuple[str, str]],
             body: Any = None) -> http.HttpRequest:
        return http.HttpRequest(method, f"/{bucket}/{key}",
                                http.HttpHeaders([("Host", self.host), *headers]), body)

    def get(self, bucket: str, key: str, into: str, at: int, length: int | None = None,
            start: int = 0) -> None:
        """Bytes [start, start + length) of `key` (all of it if no length) into file
        `into` from offset `at` (written by the runtime's threads)."""
        rng = [] if length is None else [("Range", f"bytes={start}-{start + length - 1}")]
        self.client.make_request(
            type=s3.S3RequestType.GET_OBJECT, request=self._req("GET", bucket, key, rng),
            recv_filepath=into, recv_file_option=s3.S3RecvFileOption.WRITE_TO_POSITION,
            recv_file_position=at).finished_future.result()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """One PutObject of `data` (not multipart: tierfs puts a block whole)."""
        self.client.make_request(
            type=s3.S3RequestType.PUT_OBJECT, part_size=len(data),
            multipart_upload_threshold=len(data),
            request=self._req("PUT", bucket, key, [("Content-Length", str(len(data)))],
                              io.BytesIO(data))).finished_future.result()


@dataclass(frozen=True)
class BareBlock:
    shard: int
    key: str  # the origin object's key
    start: int  # its offset in that object
    length: int
    name: str  # the block object's key in the shared bucket


def bare_blocks(client: Any, keys: list[str], prefix: str) -> list[BareBlock]:
    """Every block of the model, in shard order: tierfs's block boundaries and names."""
    out = []
    for s, key in enumerate(keys):
        head = client.head_object(Bucket=BUCKET, Key=key)
        size, etag = head["ContentLength"], head["ETag"].strip('"')
        for i in range(-(-size // SHARED_BLOCK)):
            ref = BlockRef(f"s3://{BUCKET}", key, etag, size, SHARED_BLOCK, i)
            out.append(BareBlock(s, key, ref.start, ref.length, f"{prefix}/{Blocks().name(ref)}"))
    return out


def _bare_node(i: int, blocks: list[BareBlock], shards: list[str], origin: dict[str, str],
               shared: dict[str, str], fetches: int, inboxes: list[Any], start: Any,
               out: Any) -> None:
    """Node i of the bare herd (see `bare` in the module's docstring); posts
    (i, wall, CPU-s of this process, error or None)."""
    n = len(inboxes)
    src, tier = Crt(origin), Crt(shared)
    left = Counter(b.shard for b in blocks)
    ready = [threading.Event() for _ in shards]
    lock = threading.Lock()
    for s, path in enumerate(shards):
        with open(path, "wb") as f:
            f.truncate(sum(b.length for b in blocks if b.shard == s))

    def landed(b: BareBlock) -> None:
        with lock:
            left[b.shard] -= 1
            if not left[b.shard]:
                ready[b.shard].set()

    def own(j: int) -> None:
        b = blocks[j]
        src.get(BUCKET, b.key, shards[b.shard], b.start, b.length, b.start)
        landed(b)
        with open(shards[b.shard], "rb") as f:
            data = os.pread(f.fileno(), b.length, b.start)
        tier.put(SHARED_BUCKET, b.name, data)
        for k, box in enumerate(inboxes):
            if k != i:
                box.put(j)

    def take() -> None:  # the next block announced (BARE_TAKES at once, in their order)
        b = blocks[inboxes[i].get(timeout=600)]
        tier.get(SHARED_BUCKET, b.name, shards[b.shard], b.start)
        landed(b)

    def failing(f: Future[None]) -> None:
        if f.exception() is not None:
            for e in ready:  # the loads go on (and fail): the error is raised after them
                e.set()

    mine = range(i, len(blocks), n)
    start.wait()
    t, cpu = time.perf_counter(), sum(os.times()[:2])
    try:
        with ThreadPoolExecutor(fetches) as owners, ThreadPoolExecutor(BARE_TAKES) as takers:
            done = [owners.submit(own, j) for j in mine]
            done += [takers.submit(take) for _ in range(len(blocks) - len(mine))]
            for fut in done:
                fut.add_done_callback(failing)
            for s, path in enumerate(shards):
                ready[s].wait()
                tensors = load_file(path)
                assert sum(a.nbytes for a in tensors.values()) > 0
                del tensors
            for fut in done:
                fut.result()
        out.put((i, time.perf_counter() - t, sum(os.times()[:2]) - cpu, None))
    except BaseException as exc:
        out.put((i, time.perf_counter() - t, 0.0, f"{type(exc).__name__}: {exc}"))


def bare_herd(b: Bench, herd: Herd, prefix: str, nodes: int,
              fetches: int) -> tuple[list[float], list[float], bool]:
    """The bare-client herd (`bare` above): (wall by node, CPU-s by node, every
    node's shard files byte-identical to the model)."""
    blocks = bare_blocks(b.client, herd.keys, prefix)
    dirs = [Path(tempfile.mkdtemp(prefix="tierfs-bare-", dir="/tmp")) for _ in range(nodes)]
    shards = [[str(d / Path(k).name) for k in herd.keys] for d in dirs]
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(nodes)]
    ps = [ctx.Process(target=_bare_node, args=(i, blocks, shards[i], b.server.env(),
                                                herd.shared.env(), fetches, inboxes, start, out))
          for i in range(nodes)]
    try:
        for p in ps:
            p.start()
        time.sleep(0.5)
        start.set()
        got = []
        for _ in ps:
            got.append(out.get(timeout=900))
            if got[-1][3] is not None:
                raise RuntimeError(f"bare node {got[-1][0]}: {got[-1][3]}")
        got.sort()
        ok = all(sha256_file(Path(p)) == herd.digests[k]
                 for paths in shards for p, k in zip(paths, herd.keys, strict=True))
        return [g[1] for g in got], [g[2] for g in got], ok
    finally:
        for p in ps:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def kill_first_claimer(client: Any, prefix: str, mounts: list[TierfsMount],
                       stop: threading.Event, killed: list[int]) -> None:
    """Watch the shared prefix for a claim; kill -9 the daemon that made it."""
    pids = {m.pid: i for i, m in enumerate(mounts)}
    while not stop.is_set():
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=SHARED_BUCKET, Prefix=prefix + "/"):
            for o in page.get("Contents", []):
                if not o["Key"].endswith(".claim"):
                    continue
                with contextlib.suppress(Exception):
                    body = client.get_object(Bucket=SHARED_BUCKET, Key=o["Key"])["Body"].read()
                    pid = int(json.loads(body)["node"].rsplit(":", 1)[1])
                    if pid in pids:
                        os.kill(pid, 9)
                        killed.append(pids[pid])
                        mounts[pids[pid]].pid = None
                        return
        time.sleep(CLAIM_POLL)


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--shards", type=int, default=4)
        p.add_argument("--nodes", type=int, default=4)
        p.add_argument("--origin-rate", default="400mbit")
        p.add_argument("--lease", type=float, default=30.0)
        p.add_argument("--boto-threads", type=int, default=4)
        p.add_argument("--bare-fetches", type=int, default=SHARED_ORIGIN_FETCHES,
                       help="origin GETs a bare-herd node has in flight at once")
        p.add_argument("--engine", choices=("crt", "botocore"), default=None,
                       help="[store] engine of every mount (default: tierfs's)")
        p.add_argument("--heavy-runs", type=int, default=1,
                       help="runs that also measure `today` and `nocond` (N copies each)")

    args = parse_args(__doc__.splitlines()[0], GiB, 3, extra)
    shared = SeaweedServer(data_dir=None)
    with Bench(args, "sharedtier") as b, shared:
        sc = shared.client()
        sc.create_bucket(Bucket=SHARED_BUCKET)
        files = make_shards(b.work, args.size, args.shards)
        size = sum(p.stat().st_size for p in files)
        herd = Herd(b, shared, args, files)
        res: dict[str, list[float]] = {k: [] for k in (
            "alone_s", "herd_slowest_s", "herd_vs_alone", "herd_origin_gib", "herd_tc_origin_gib",
            "herd_claims_won", "herd_claims_lost", "herd_claims_expired",
            "herd_shared_store_cpu_s", "herd_daemon_cpu_s",
            "bare_slowest_s", "herd_vs_bare", "bare_vs_alone", "bare_tc_origin_gib",
            "bare_shared_store_cpu_s", "bare_origin_cpu_s", "bare_node_cpu_s",
            "today_boto_s", "herd_vs_today", "today_tc_origin_gib",
            "fifth_s", "fifth_origin_bytes", "fifth_boto_s", "fifth_vs_boto", "herd_boto_s",
            "herd_vs_bound",
            "kill_survivors_slowest_s", "kill_extra_s", "kill_origin_gib", "kill_claims_expired",
            "corrupt_detected",
            "corrupt_origin_mib", "nocond_slowest_s", "nocond_origin_gib")}
        checks: dict[str, list[bool]] = {"herd": [], "bare": [], "kill": [], "corrupt": [], "nocond": []}
        proxy = FaultProxy(shared.endpoint).start()
        proxy.set_rules([Rule("501", ops={"put"}, header="if-none-match"),
                         Rule("501", ops={"put"}, header="if-match")])
        try:
            with shaped_egress(b.server.s3_port, args.origin_rate) as tc_sent:
                for run in range(args.runs):
                    one_run(run, b, herd, sc, proxy, tc_sent, size, args, res, checks)
        finally:
            proxy.stop()
        load = os.getloadavg()
        b.result.update({k: {"runs": v, "median": median(v)} for k, v in res.items()})
        b.result["checks"] = checks
        b.result["model_bytes"] = size
        b.result["origin_rate"] = args.origin_rate
        b.result["lease_s"] = args.lease
        b.result["heavy_runs"] = min(args.heavy_runs, args.runs)
        b.result["engine"] = args.engine or "default"
        b.result["nodes"] = args.nodes
        b.result["bare_fetches"] = args.bare_fetches
        b.result["bare_client"] = "awscrt S3Client"
        b.result["shards"] = args.shards
        b.result["loadavg"] = load
        b.save()
        med = {k: median(v) for k, v in res.items()}
        print(f"sharedtier: {size / GiB:.2f} GiB model in {args.shards} shards, {args.nodes} nodes, "
              f"origin egress {args.origin_rate}, lease {args.lease:g} s, median of {args.runs}; "
              f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        report([
            ("one node alone, cold, no shared tier", f"{med['alone_s']:.1f} s"),
            (f"herd of {args.nodes}: slowest node", f"{med['herd_slowest_s']:.1f} s = "
             f"{med['herd_vs_alone']:.2f}x alone (target <= 1.3x)"),
            (f"bare herd of {args.nodes} (awscrt, ideal division, no tierfs): slowest",
             f"{med['bare_slowest_s']:.1f} s = {med['bare_vs_alone']:.2f}x alone; the herd's "
             f"slowest is {med['herd_vs_bare']:.2f}x this; bytes verified {all(checks['bare'])}"),
            ("CPU-s: shared store in the herd / in the bare herd",
             f"{med['herd_shared_store_cpu_s']:.1f} / {med['bare_shared_store_cpu_s']:.1f} "
             f"(origin {med['bare_origin_cpu_s']:.1f}); tierfs daemons "
             f"{med['herd_daemon_cpu_s']:.1f} / bare nodes {med['bare_node_cpu_s']:.1f}"),
            (f"{args.nodes} boto3 processes GET it all from the shared tier at once",
             f"{med['herd_boto_s']:.1f} s: the herd's slowest is {med['herd_vs_bound']:.2f}x "
             "max(alone, this)"),
            (f"today: {args.nodes} boto3 processes GET it from the origin at once",
             f"{med['today_boto_s']:.1f} s, tc {med['today_tc_origin_gib']:.2f} GiB: the herd's "
             f"slowest is {med['herd_vs_today']:.2f}x this"),
            ("herd: origin bytes (daemons / tc)", f"{med['herd_origin_gib']:.3f} / "
             f"{med['herd_tc_origin_gib']:.3f} GiB (target <= 1.1; without: {args.nodes})"),
            ("herd: claims won / lost / expired", f"{med['herd_claims_won']:.0f} / "
             f"{med['herd_claims_lost']:.0f} / {med['herd_claims_expired']:.0f}"),
            ("fifth node: origin bytes", f"{med['fifth_origin_bytes']:.0f}"),
            ("fifth node: load vs boto3 GETs of the blocks",
             f"{med['fifth_s']:.2f} s vs {med['fifth_boto_s']:.2f} s "
             f"({args.boto_threads} threads) = {med['fifth_vs_boto']:.2f}x"),
            ("claimer killed -9: survivors' slowest", f"{med['kill_survivors_slowest_s']:.1f} s, "
             f"{med['kill_extra_s']:.1f} s over the herd (lease {args.lease:g} s); "
             f"{med['kill_claims_expired']:.0f} claims expired; "
             f"origin {med['kill_origin_gib']:.3f} GiB; bytes verified {all(checks['kill'])}"),
            ("corrupt block", f"detected {med['corrupt_detected']:.0f}x, origin "
             f"{med['corrupt_origin_mib']:.0f} MiB, bytes verified {all(checks['corrupt'])}"),
            ("no conditional writes: slowest / origin",
             f"{med['nocond_slowest_s']:.1f} s / {med['nocond_origin_gib']:.3f} GiB; "
             f"bytes verified {all(checks['nocond'])}"),
        ])


def said(run: int, res: dict[str, list[float]], *keys: str) -> None:
    print(f"run {run}: " + ", ".join(f"{k} {res[k][-1]:.3g}" for k in keys), flush=True)


def one_run(run: int, b: Bench, herd: Herd, sc: Any, proxy: FaultProxy, tc_sent: Any,
            size: int, args: Any, res: dict[str, list[float]],
            checks: dict[str, list[bool]]) -> None:
    n = args.nodes
    # alone: the reference
    m = herd.mount(None)
    drop_caches()
    walls, _ = load_together([herd.paths(m)])
    res["alone_s"].append(walls[0])
    herd.done([m])
    said(run, res, "alone_s")

    # herd
    prefix = f"run{run}"
    ms = [herd.mount(prefix) for _ in range(n)]
    drop_caches()
    before = tc_sent()
    assert herd.shared.proc is not None and b.server.proc is not None
    pids = [herd.shared.proc.pid, b.server.proc.pid, *(m.pid for m in ms)]  # shared, origin, daemons
    cpu0 = [cpu_s(p) for p in pids]
    walls, errors = load_together([herd.paths(m) for m in ms])
    cpu = [round(cpu_s(p) - c, 1) for p, c in zip(pids, cpu0, strict=True)]
    reqs = shared_requests(ms)
    total: Counter[str] = Counter()
    for r in reqs:
        total.update(r)  # (update keeps zero counts; a sum of Counters drops them)
    print(f"run {run}: herd cpu s: shared store {cpu[0]}, origin {cpu[1]}, daemons {cpu[2:]}; "
          f"load {os.getloadavg()}", flush=True)
    for i, r in enumerate(reqs):
        print(f"run {run}: node {i} shared requests {json.dumps(dict(sorted(r.items())))}",
              flush=True)
    print(f"run {run}: herd shared requests {json.dumps(dict(sorted(total.items())))}", flush=True)
    res["herd_shared_store_cpu_s"].append(cpu[0])
    res["herd_daemon_cpu_s"].append(sum(cpu[2:]))
    res["herd_tc_origin_gib"].append((tc_sent() - before) / GiB)
    res["herd_slowest_s"].append(max(walls.values()))
    res["herd_vs_alone"].append(res["herd_slowest_s"][-1] / res["alone_s"][-1])
    res["herd_origin_gib"].append(origin_bytes(ms) / GiB)
    for what in ("won", "lost", "expired"):
        res[f"herd_claims_{what}"].append(claims(ms, what))
    checks["herd"].append(not errors and all(herd.verified(m) for m in ms))
    herd.done(ms)
    said(run, res, "herd_slowest_s", "herd_vs_alone", "herd_origin_gib", "herd_tc_origin_gib",
         "herd_claims_won", "herd_claims_lost", "herd_claims_expired")

    # bare: the same work ideally divided, bare clients, no tierfs
    drop_caches()
    before = tc_sent()
    cpu0 = [cpu_s(p) for p in pids[:2]]
    walls_b, cpu_b, ok = bare_herd(b, herd, f"bare{run}", n, args.bare_fetches)
    cpu = [round(cpu_s(p) - c, 1) for p, c in zip(pids[:2], cpu0, strict=True)]
    res["bare_tc_origin_gib"].append((tc_sent() - before) / GiB)
    res["bare_shared_store_cpu_s"].append(cpu[0])
    res["bare_origin_cpu_s"].append(cpu[1])
    res["bare_node_cpu_s"].append(round(sum(cpu_b), 1))
    res["bare_slowest_s"].append(max(walls_b))
    res["herd_vs_bare"].append(res["herd_slowest_s"][-1] / res["bare_slowest_s"][-1])
    res["bare_vs_alone"].append(res["bare_slowest_s"][-1] / res["alone_s"][-1])
    checks["bare"].append(ok)
    print(f"run {run}: bare walls {[round(w, 1) for w in walls_b]}, node cpu s "
          f"{[round(c, 1) for c in cpu_b]}; load {os.getloadavg()}", flush=True)
    said(run, res, "bare_slowest_s", "herd_vs_bare", "bare_vs_alone", "bare_tc_origin_gib",
         "bare_shared_store_cpu_s", "bare_origin_cpu_s", "bare_node_cpu_s")

    heavy = run < args.heavy_runs
    if heavy:  # today: N plain clients, each its own copy through the link
        model = [(k, b.client.head_object(Bucket=BUCKET, Key=k)["ContentLength"])
                 for k in herd.keys]
        drop_caches()
        before = tc_sent()
        res["today_boto_s"].append(boto_herd(b.server, model, n, args.boto_threads, BUCKET))
        res["today_tc_origin_gib"].append((tc_sent() - before) / GiB)
        res["herd_vs_today"].append(res["herd_slowest_s"][-1] / res["today_boto_s"][-1])
        said(run, res, "today_boto_s", "today_tc_origin_gib", "herd_vs_today")

    # fifth node, and boto3 GETs of the same bytes from the shared tier
    m5 = herd.mount(prefix)
    drop_caches()
    walls, _ = load_together([herd.paths(m5)])
    res["fifth_s"].append(walls[0])
    res["fifth_origin_bytes"].append(origin_bytes([m5]))
    herd.done([m5])
    blocks = shared_blocks(sc, prefix)
    drop_caches()
    secs, got = boto_get_all(sc, blocks, args.boto_threads)
    assert got == size, (got, size)
    res["fifth_boto_s"].append(secs)
    res["fifth_vs_boto"].append(res["fifth_s"][-1] / secs)
    drop_caches()
    res["herd_boto_s"].append(boto_herd(herd.shared, blocks, n, args.boto_threads))
    res["herd_vs_bound"].append(res["herd_slowest_s"][-1]
                                / max(res["alone_s"][-1], res["herd_boto_s"][-1]))
    said(run, res, "fifth_s", "fifth_origin_bytes", "fifth_boto_s", "fifth_vs_boto",
         "herd_boto_s", "herd_vs_bound")

    # a corrupt block: overwritten by boto3, its metadata kept
    key, bsize = blocks[len(blocks) // 2]
    meta = sc.head_object(Bucket=SHARED_BUCKET, Key=key)["Metadata"]
    for attempt in range(5):  # SeaweedFS under a herd's load answered one PUT InternalError
        try:
            sc.put_object(Bucket=SHARED_BUCKET, Key=key, Body=os.urandom(bsize), Metadata=meta)
            break
        except ClientError as exc:
            if attempt == 4 or exc.response.get("Error", {}).get("Code") != "InternalError":
                raise
    mc = herd.mount(prefix)
    drop_caches()
    load_together([herd.paths(mc)])
    res["corrupt_detected"].append(mc.metric("tierfs_shared_corrupt_blocks_total"))
    res["corrupt_origin_mib"].append(origin_bytes([mc]) / MiB)
    checks["corrupt"].append(herd.verified(mc))
    herd.done([mc])
    said(run, res, "corrupt_detected", "corrupt_origin_mib")

    # the claimer killed with -9 mid-fetch
    kprefix = f"kill{run}"
    ms = [herd.mount(kprefix) for _ in range(n)]
    drop_caches()
    stop, killed = threading.Event(), list[int]()
    watcher = threading.Thread(target=kill_first_claimer, args=(sc, kprefix, ms, stop, killed))
    watcher.start()
    walls, errors = load_together([herd.paths(m) for m in ms])
    stop.set()
    watcher.join()
    survivors = [i for i in range(n) if i not in killed]
    res["kill_survivors_slowest_s"].append(max(walls[i] for i in survivors))
    res["kill_extra_s"].append(res["kill_survivors_slowest_s"][-1] - res["herd_slowest_s"][-1])
    res["kill_origin_gib"].append(origin_bytes([ms[i] for i in survivors]) / GiB)
    res["kill_claims_expired"].append(claims([ms[i] for i in survivors], "expired"))
    checks["kill"].append(len(killed) == 1 and not set(errors) - set(killed)
                          and all(herd.verified(ms[i]) for i in survivors))
    herd.done(ms)
    said(run, res, "kill_survivors_slowest_s", "kill_extra_s", "kill_origin_gib",
         "kill_claims_expired")
    if not heavy:
        print(f"run {run}: checks {checks}; load {os.getloadavg()}", flush=True)
        return

    # a shared tier without conditional writes (behind the proxy)
    ms = [herd.mount(f"nocond{run}", proxy.endpoint) for _ in range(n)]
    drop_caches()
    walls, errors = load_together([herd.paths(m) for m in ms])
    res["nocond_slowest_s"].append(max(walls.values()))
    res["nocond_origin_gib"].append(origin_bytes(ms) / GiB)
    checks["nocond"].append(not errors and all(herd.verified(m) for m in ms))
    herd.done(ms)
    said(run, res, "nocond_slowest_s", "nocond_origin_gib")
    print(f"run {run}: checks {checks}; load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
