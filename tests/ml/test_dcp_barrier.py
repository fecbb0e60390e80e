"""Two mounts of one bucket: a reader on mount B never sees a DCP checkpoint's
`.metadata` before every shard it names is complete, and can load it then.

Real `torch.distributed.checkpoint.save` on mount A (four writer threads, so
four shards written at once). The publish of `.metadata` runs in the
background (the default): dcp.save returns before the shards are uploaded. Mount A talks to the store through the fault
proxy, which holds every shard upload request for a while, so that shard
uploads are still running when DCP renames `.metadata.tmp` to `.metadata`
(its commit point). Mount B (direct to the store) polls for each step's `.metadata`; the first time it
is visible, B reads the metadata, checks every shard it names has the bytes
it points at, and loads the checkpoint, compared tensor by tensor.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.fault.conftest import proxy  # noqa: F401 (fixture)
from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.integration.test_consistency import NO_BARRIER
from tests.ml.conftest import assert_same, empty_like, flush, state_dict
from tests.support.seaweed import SeaweedServer

STEPS = 20
MIB_PER_STEP = 32
# Every request that uploads shard bytes waits this long at the proxy.
SLOW_SHARDS = [Rule("latency", ops={"put", "multipart"}, path=r"\.distcp", delay=0.5)]
# Mount B sees new directories and files at once (no cached listing or attributes
# hides a step from it), so a `.metadata` published early is seen early.
EAGER_READER = "".join(f"[classes.{c}]\nattr_ttl = 0\nlist_ttl = 0\n" for c in ("default", "checkpoint"))

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: no process group


def check_step(step_dir: Path, step: int) -> list[str]:
    """What B sees once `.metadata` is visible: each named shard complete, the load right."""
    bad = []
    meta = FileSystemReader(str(step_dir)).read_metadata()
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        try:
            size = os.stat(step_dir / name).st_size
        except FileNotFoundError:
            bad.append(f"{step_dir.name}/{name}: missing")
            continue
        if size < end:
            bad.append(f"{step_dir.name}/{name}: {size} bytes, metadata points at {end}")
    if not bad:
        want = state_dict(MIB_PER_STEP, seed=step)
        got = empty_like(want)
        try:
            dcp.load(got, checkpoint_id=str(step_dir))
            assert_same(got, want)
        except Exception as exc:  # reported with the others, the poller keeps going
            bad.append(f"{step_dir.name}: load failed: {type(exc).__name__}: {exc}")
    return bad


def poll(b: Path, writer_done: threading.Event, out: list[str], steps: int) -> None:
    seen: set[int] = set()
    deadline: float | None = None
    while len(seen) < steps:
        if writer_done.is_set():
            deadline = deadline or time.monotonic() + 120
            if time.monotonic() > deadline:
                out.append(f"B never saw .metadata of steps {sorted(set(range(steps)) - seen)}")
                return
        for step in range(steps):
            d = b / f"ckpt/step-{step}"
            if step not in seen and os.path.exists(d / ".metadata"):
                seen.add(step)
                out.extend(check_step(d, step))
        time.sleep(0.01)


def reader_mount(mount_factory: MountFactory, bucket: str, tmp_path: Path) -> Path:
    cfg = tmp_path / "eager-reader.toml"
    cfg.write_text(EAGER_READER)
    return mount_factory(f"s3://{bucket}", "--config", str(cfg)).mountpoint


def save(a: Path, step: int) -> None:
    writer = FileSystemWriter(str(a / f"ckpt/step-{step}"), thread_count=4)
    dcp.save(state_dict(MIB_PER_STEP, seed=step), storage_writer=writer)


def run_workload(a: Path, b: Path, steps: int = STEPS) -> list[str]:
    violations: list[str] = []
    done = threading.Event()
    poller = threading.Thread(target=poll, args=(b, done, violations, steps))
    poller.start()
    try:
        for step in range(steps):
            save(a, step)
    finally:
        done.set()
        poller.join(timeout=300)
    assert not poller.is_alive(), "the reader on mount B did not finish"
    return violations


@pytest.mark.timeout(600)
def test_dcp_metadata_never_visible_before_its_shards(
    mount_factory: MountFactory, bucket: str, proxy: FaultProxy, tmp_path: Path  # noqa: F811
) -> None:
    proxy.set_rules(SLOW_SHARDS)
    a = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    b = reader_mount(mount_factory, bucket, tmp_path)
    violations = run_workload(a.mountpoint, b)
    proxy.clear()
    flush(a)
    assert violations == []
    assert any(e.fault == "latency" for e in proxy.log), "the shard uploads were not slowed"


@pytest.mark.timeout(600)
def test_kill9_right_after_dcp_save_publishes_after_the_shards_on_remount(
    mount_factory: MountFactory, bucket: str, proxy: FaultProxy, tmp_path: Path,  # noqa: F811
    s3_server: SeaweedServer,
) -> None:
    """dcp.save returns with `.metadata` and its barrier journaled only; the daemon
    dies (kill -9) before anything landed. The next mount resumes the shard
    uploads and publishes `.metadata` once they landed: B never sees it early."""
    cache = tmp_path / "cache-writer"
    # nothing of the checkpoint lands before the kill
    proxy.set_rules([Rule("latency", ops={"put", "multipart"}, path=r"\.distcp|\.metadata",
                          delay=10)])
    a = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, cache_dir=cache)
    save(a.mountpoint, 0)
    a.kill9()
    assert not [k for k in s3_server.keys(bucket, "ckpt/step-0/") if not k.endswith("/")], \
        "something landed before the kill: the test shows nothing"
    b = reader_mount(mount_factory, bucket, tmp_path)
    violations: list[str] = []
    done = threading.Event()
    poller = threading.Thread(target=poll, args=(b, done, violations, 1))
    poller.start()
    try:
        proxy.set_rules(SLOW_SHARDS)  # shards still slow: .metadata would overtake them
        a2 = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, cache_dir=cache,
                           mountpoint=a.mountpoint)
        flush(a2)
    finally:
        done.set()
        poller.join(timeout=300)
    assert violations == []
    assert "resuming the publish of 'ckpt/step-0/.metadata'" in (cache / "tierfs.log").read_text()
    names = sorted(os.listdir(a2.mountpoint / "ckpt/step-0"))
    for name in names:  # byte-identical in the bucket and on the writer's disk
        assert (b / "ckpt/step-0" / name).read_bytes() == (a2.mountpoint / "ckpt/step-0" / name).read_bytes()
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 4
    assert check_step(b / "ckpt/step-0", 0) == []


@pytest.mark.timeout(600)
def test_without_the_barrier_b_sees_metadata_first(
    mount_factory: MountFactory, bucket: str, proxy: FaultProxy, tmp_path: Path  # noqa: F811
) -> None:
    """The control experiment: with manifests written back like any file, the
    same workload shows B a `.metadata` whose shards are not there yet."""
    cfg = tmp_path / "no-barrier.toml"
    cfg.write_text(NO_BARRIER)
    proxy.set_rules(SLOW_SHARDS)
    a = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg))
    b = reader_mount(mount_factory, bucket, tmp_path)
    violations = run_workload(a.mountpoint, b, steps=4)
    proxy.clear()
    flush(a)  # the held uploads land: a quick teardown
    assert any("missing" in v or "bytes, metadata points at" in v for v in violations), violations
