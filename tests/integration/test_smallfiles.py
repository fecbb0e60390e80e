"""Datasets of small objects through a real mount (issue 21): whole small objects
kept in tier 1 across remounts, listings kept across remounts within their TTL,
no HEAD per file after a listing, a shuffled read fetching about what it reads,
and a serial walk of a directory fetched ahead in parallel.

Request counts come from the mount's store counters; parallelism from the
fault proxy's record of how many GETs were in flight at once (request timing,
not a wall clock).
"""

from __future__ import annotations

import json
import os
import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, run_tierfs
from tests.support.seaweed import SeaweedServer

KiB = 1 << 10
MiB = 1 << 20
GETS = "tierfs_store_requests_total{op=get,status=ok}"
LISTS = "tierfs_store_requests_total{op=list,status=ok}"
HEADS = "tierfs_store_requests_total{op=head,status=ok}"
GET_BYTES = "tierfs_store_bytes_total{op=get}"
# The directory ds/ and everything in it are a dataset (listings and attributes
# kept for minutes), as a user with such a dataset configures it.
DATASET = '[[rules]]\nglob = "ds"\nclass = "dataset"\n\n[[rules]]\nglob = "ds/**"\nclass = "dataset"\n'


def config(tmp_path: Path, text: str) -> str:
    p = tmp_path / f"tierfs-{abs(hash(text))}.toml"
    p.write_text(text)
    return str(p)


def seed(s3: SeaweedServer, bucket: str, n: int, size: int, prefix: str = "ds") -> dict[str, bytes]:
    """n objects of about `size` bytes under prefix/ (sizes differ a little)."""
    c = s3.client()
    out = {}
    for i in range(n):
        data = random.Random(i).randbytes(size + i)
        c.put_object(Bucket=bucket, Key=f"{prefix}/img-{i:04d}.jpg", Body=data)
        out[f"img-{i:04d}.jpg"] = data
    return out


def requests(m: TierfsMount) -> dict[str, float]:
    snap = m.status()["metrics"]
    return {k: float(snap.get(k, 0.0)) for k in (GETS, LISTS, HEADS, GET_BYTES)}


def remount(mount_factory: MountFactory, m: TierfsMount, *extra: str) -> TierfsMount:
    """The same source and cache dir, after a clean umount."""
    m.umount()
    return mount_factory(m.source, *extra, cache_dir=m.cache_dir)


def test_small_objects_read_whole_are_kept_in_tier1_across_a_remount(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    objs = seed(s3_server, bucket, 40, 100 * KiB)
    s3_server.client().put_object(Bucket=bucket, Key="ds/tiny.json", Body=b"{}\n")
    objs["tiny.json"] = b"{}\n"
    total = sum(map(len, objs.values()))
    m = mount_factory(f"s3://{bucket}")
    for name, data in objs.items():
        assert (m.mountpoint / "ds" / name).read_bytes() == data
    st = m.status()
    assert st["cache"]["used_bytes"] == total  # counted in cached_bytes, every byte
    assert st["cache"]["objects"] == len(objs)
    res = run_tierfs("cache", "ls", str(m.mountpoint), "--json", env=m.env, check=True)
    listed = {o["key"]: (o["cached_bytes"], o["size"]) for o in json.loads(res.stdout)}
    assert listed == {f"ds/{n}": (len(v), len(v)) for n, v in objs.items()}  # each 100%
    m2 = remount(mount_factory, m)
    for name, data in objs.items():
        assert (m2.mountpoint / "ds" / name).read_bytes() == data
    assert m2.metric(GETS) == 0  # every byte from tier 1


def test_first_small_read_of_a_small_object_fetches_it_whole(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    data = random.Random(9).randbytes(300 * KiB)
    s3_server.client().put_object(Bucket=bucket, Key="ds/clip.wav", Body=data)
    m = mount_factory(f"s3://{bucket}")
    fd = os.open(m.mountpoint / "ds/clip.wav", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 0) == data[:4096]  # a header
        assert m.metric(GETS) == 1 and m.metric(GET_BYTES) == len(data)
        assert os.pread(fd, 4096, 200 * KiB) == data[200 * KiB : 204 * KiB]
    finally:
        os.close(fd)
    assert m.metric(GETS) == 1  # the rest came from tier 1
    assert m.status()["cache"]["used_bytes"] == len(data)


def test_small_objects_are_evicted_like_any_object(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    objs = seed(s3_server, bucket, 80, 100 * KiB)  # 8 MB through a 4 MiB tier 1
    m = mount_factory(f"s3://{bucket}", "--cache-size", "4M")
    for _ in range(2):
        for name, data in objs.items():
            assert (m.mountpoint / "ds" / name).read_bytes() == data
    st = m.status()["cache"]
    assert 0 < st["used_bytes"] <= 4 * MiB
    assert st["evictions"] > 0


def test_listing_is_reused_after_a_remount_within_its_ttl(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    objs = seed(s3_server, bucket, 300, 2 * KiB)
    cfg = config(tmp_path, DATASET)
    m = mount_factory(f"s3://{bucket}", "--config", cfg)
    d = m.mountpoint / "ds"
    assert sorted(os.listdir(d)) == sorted(objs)
    assert m.metric(LISTS) >= 1
    m2 = remount(mount_factory, m, "--config", cfg)
    d = m2.mountpoint / "ds"
    mounted = requests(m2)  # (the mount's own store check lists once)
    assert sorted(os.listdir(d)) == sorted(objs)  # what `ls -l` does: list, then stat each
    assert {n: (d / n).stat().st_size for n in objs} == {n: len(v) for n, v in objs.items()}
    listed = requests(m2)
    assert listed[LISTS] == mounted[LISTS] and listed[HEADS] == mounted[HEADS]
    for name in sorted(objs)[:50]:
        assert (d / name).read_bytes() == objs[name]
    read = requests(m2)
    assert read[HEADS] == mounted[HEADS] and read[LISTS] == mounted[LISTS]  # no HEAD per open
    # The same cache, mounted with a dataset listing TTL of 0: the listing is too old.
    short = config(tmp_path, DATASET + "\n[classes.dataset]\nlist_ttl = 0\n")
    m3 = remount(mount_factory, m2, "--config", short)
    mounted = requests(m3)
    assert sorted(os.listdir(m3.mountpoint / "ds")) == sorted(objs)
    assert m3.metric(LISTS) > mounted[LISTS]


def test_a_kept_listing_never_hides_what_this_mount_changed(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    objs = seed(s3_server, bucket, 20, 1 * KiB)
    cfg = config(tmp_path, DATASET)
    m = mount_factory(f"s3://{bucket}", "--config", cfg)
    d = m.mountpoint / "ds"
    assert sorted(os.listdir(d)) == sorted(objs)
    (d / "new.jpg").write_bytes(b"new")
    os.unlink(d / "img-0000.jpg")
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)
    assert res.returncode == 0, res.stderr
    m2 = remount(mount_factory, m, "--config", cfg)
    names = sorted(os.listdir(m2.mountpoint / "ds"))
    assert names == sorted({*objs, "new.jpg"} - {"img-0000.jpg"})
    assert (m2.mountpoint / "ds/new.jpg").read_bytes() == b"new"


def test_shuffled_read_fetches_about_what_it_reads(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    objs = seed(s3_server, bucket, 400, 100 * KiB)
    m = mount_factory(f"s3://{bucket}", "--config", config(tmp_path, DATASET))
    d = m.mountpoint / "ds"
    listed = sorted(os.listdir(d))
    sample = random.Random(1).sample(listed, 100)
    todo = iter(sample)
    lock = threading.Lock()
    read = 0

    def worker() -> None:  # a DataLoader worker: the next index of a shuffled sampler
        nonlocal read
        while True:
            with lock:
                name = next(todo, None)
            if name is None:
                return
            data = (d / name).read_bytes()
            assert data == objs[name]
            with lock:
                read += len(data)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read == sum(len(objs[n]) for n in sample)
    fetched = m.metric(GET_BYTES)
    assert read <= fetched <= 1.3 * read, (fetched, read)


@pytest.fixture
def slow_gets(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    """A proxy that holds every GET 0.2 s: each round trip costs as much as a
    remote store's, so a walk that waits for one GET per file shows."""
    with FaultProxy(upstream=s3_server.endpoint, seed=0) as p:
        p.set_rules([Rule("latency", ops={"get"}, delay=0.2)])
        yield p


def test_serial_walk_of_a_directory_is_fetched_ahead_in_parallel(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
    slow_gets: FaultProxy,
) -> None:
    objs = seed(s3_server, bucket, 48, 100 * KiB)
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", slow_gets.endpoint,
                      "--config", config(tmp_path, DATASET))
    d = m.mountpoint / "ds"
    listed = sorted(os.listdir(d))
    slow_gets.reset_stats()
    for name in listed:  # cat ds/*
        assert (d / name).read_bytes() == objs[name]
    assert slow_gets.peak_inflight("get") >= 4  # later files were fetched while earlier ones were read
    total = sum(map(len, objs.values()))
    assert m.metric(GET_BYTES) == total  # each object fetched once, nothing beyond the directory
    assert slow_gets.stats()[("get", "total")] == len(objs)


def test_parallel_walkers_each_get_their_files_fetched_ahead(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
    slow_gets: FaultProxy,
) -> None:
    """`xargs -P4 -n16 cat`: four readers, each walking its own run of the listing."""
    objs = seed(s3_server, bucket, 64, 100 * KiB)
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", slow_gets.endpoint,
                      "--config", config(tmp_path, DATASET))
    d = m.mountpoint / "ds"
    listed = sorted(os.listdir(d))
    slow_gets.reset_stats()
    bad: list[str] = []

    def walker(names: list[str]) -> None:
        bad.extend(n for n in names if (d / n).read_bytes() != objs[n])

    threads = [threading.Thread(target=walker, args=(listed[i : i + 16],))
               for i in range(0, len(listed), 16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    # Four walkers alone keep at most 4 GETs in flight; fetched ahead, more.
    assert slow_gets.peak_inflight("get") > 4
    assert m.metric(GET_BYTES) == sum(map(len, objs.values()))  # each object once


def test_ls_l_of_small_objects_heads_only_the_typed_ones(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """`ls -l` of a default-class directory of small objects another tool wrote: no
    HEAD per object (a listing carries no metadata); the symlink and FIFO tierfs
    wrote are typed on a node that never saw them made, by the directory's
    attribute object (one GET), or, before that is written, by HEAD (their ETag
    says they may be typed)."""
    objs = seed(s3_server, bucket, 60, 1 * KiB, prefix="mixed")
    writer = mount_factory(f"s3://{bucket}")
    os.symlink("img-0001.jpg", writer.mountpoint / "mixed/latest")
    os.mkfifo(writer.mountpoint / "mixed/pipe")
    reader = mount_factory(f"s3://{bucket}")  # another node: an empty cache of its own
    before = requests(reader)
    d = reader.mountpoint / "mixed"
    st = {n: os.lstat(d / n) for n in os.listdir(d)}  # what `ls -l` does
    after = requests(reader)
    # None is paid per regular object. The two: by HEAD, or from the attribute
    # object if the writer wrote it already (a second after they were made);
    # `latest`, a manifest-class name, is revalidated at its lookup either way.
    assert after[HEADS] - before[HEADS] <= 3, after[HEADS] - before[HEADS]
    assert after[GETS] - before[GETS] <= 1
    assert os.readlink(d / "latest") == "img-0001.jpg" and stat.S_ISLNK(st["latest"].st_mode)
    assert stat.S_ISFIFO(st["pipe"].st_mode)
    assert all(stat.S_ISREG(st[n].st_mode) and st[n].st_size == len(v) for n, v in objs.items())
    assert (d / "latest").read_bytes() == objs["img-0001.jpg"]
