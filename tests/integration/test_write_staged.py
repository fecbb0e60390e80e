"""Temporary names are staged, write-back after a quiet delay, manifests published
in the background (issue 18), through a real mount of a real SeaweedFS bucket.

The fault proxy sits between the mount and the store only to count and name
the requests (which keys were PUT, was anything copied): no fault is injected
unless a test says so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def put_keys(proxy: FaultProxy, bucket: str) -> list[str]:
    """Keys the mount PUT (whole, or multipart parts and completions), in order."""
    out = []
    for e in proxy.log:
        if e.op in ("put", "multipart") and e.method in ("PUT", "POST"):
            key = e.path.partition("?")[0].lstrip("/").partition("/")[2]
            if key and key not in out and not key.startswith(".tierfs-probe"):  # the mount's
                out.append(key)
    return out


def in_bucket(s3: SeaweedServer, bucket: str, key: str) -> bytes | None:
    try:
        return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.client().exceptions.NoSuchKey:
        return None


def wait_in_bucket(s3: SeaweedServer, bucket: str, key: str, timeout: float) -> None:
    """Until `key` shows in the bucket (polled; `timeout` ends a hang)."""
    deadline = time.monotonic() + timeout
    while in_bucket(s3, bucket, key) is None:
        assert time.monotonic() < deadline, f"{key} not in the bucket after {timeout}s"  # hang guard
        time.sleep(0.05)


def flush(m, *paths: str) -> None:  # type: ignore[no-untyped-def]
    res = run_tierfs("flush", str(m.mountpoint), *paths, env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.fixture
def proxy(s3_server: SeaweedServer):  # type: ignore[no-untyped-def]
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def test_temp_file_left_alone_lands_after_its_grace_period(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "grace.toml"
    cfg.write_text("[classes.staged]\nupload_delay = 6\n")
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg))
    payload = os.urandom(2 * MiB)
    (m.mountpoint / "model.pt.tmp").write_bytes(payload)
    assert in_bucket(s3_server, bucket, "model.pt.tmp") is None  # staged, not uploaded at close
    # Not before its grace period: a checkpoint closed after it (uploaded at once, a
    # few KiB) lands while the temporary file has not even started its upload.
    (m.mountpoint / "after.pt").write_bytes(b"a" * 4096)
    wait_in_bucket(s3_server, bucket, "after.pt", timeout=60)
    assert "model.pt.tmp" not in put_keys(proxy, bucket)
    wait_in_bucket(s3_server, bucket, "model.pt.tmp", timeout=60)  # then, left alone, it lands
    assert in_bucket(s3_server, bucket, "model.pt.tmp") == payload


def test_flush_uploads_a_temp_file_before_its_grace_period(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
) -> None:
    cfg = tmp_path / "grace.toml"  # longer than flush may take (300 s): it cannot wait for it
    cfg.write_text("[classes.staged]\nupload_delay = 3600\n")
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    (m.mountpoint / "notes.txt~").write_bytes(b"backup")
    flush(m)  # waits for no grace period
    assert in_bucket(s3_server, bucket, "notes.txt~") == b"backup"


def test_temp_file_unlinked_or_renamed_costs_no_put_of_its_name(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
) -> None:
    """torch.save-style tmp + fsync + os.replace: one PUT of the final name, no
    PUT of the temporary one, no server-side copy; an unlinked temp file: 0 PUTs."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    mp = m.mountpoint
    os.makedirs(mp / "run")
    proxy.reset_stats()
    (mp / "run/scratch.tmp").write_bytes(os.urandom(MiB))
    os.unlink(mp / "run/scratch.tmp")
    payload = os.urandom(20 * MiB)  # multipart
    with open(mp / "run/model.pt.tmp", "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(mp / "run/model.pt.tmp", mp / "run/model.pt")
    flush(m)
    assert in_bucket(s3_server, bucket, "run/model.pt") == payload
    assert put_keys(proxy, bucket) == ["run/model.pt"]
    assert proxy.stats()[("copy", "total")] == 0
    assert in_bucket(s3_server, bucket, "run/model.pt.tmp") is None
    assert in_bucket(s3_server, bucket, "run/scratch.tmp") is None


def deleted_keys(proxy: FaultProxy) -> list[str]:
    return [e.path.partition("?")[0].lstrip("/").partition("/")[2]
            for e in proxy.log if e.op == "delete"]


def test_a_replace_deletes_the_temporary_name_only_where_the_store_may_hold_it(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
) -> None:
    """os.replace of a temp file created in a directory this mount knows sends no
    DELETE of the temp name (the store never had it: the DELETE was the whole
    rename's time, 0.04-0.28 s while a checkpoint uploaded). Where the store
    may hold an object under that name, it is deleted, as before."""
    s3_server.client().put_object(Bucket=bucket, Key="old/model.pt.tmp", Body=b"stale")
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    mp = m.mountpoint
    os.makedirs(mp / "run")
    proxy.reset_stats()
    for step in range(3):
        with open(mp / "run/model.pt.tmp", "wb") as f:
            f.write(os.urandom(64 * 1024))
        os.replace(mp / "run/model.pt.tmp", mp / f"run/model-{step}.pt")
    assert "run/model.pt.tmp" not in deleted_keys(proxy)
    payload = os.urandom(64 * 1024)
    with open(mp / "old/model.pt.tmp", "wb") as f:  # the name the store holds
        f.write(payload)
    os.replace(mp / "old/model.pt.tmp", mp / "old/model.pt")
    assert "old/model.pt.tmp" in deleted_keys(proxy)
    flush(m)
    assert sorted(os.listdir(mp / "run")) == ["model-0.pt", "model-1.pt", "model-2.pt"]
    assert in_bucket(s3_server, bucket, "run/model.pt.tmp") is None
    assert in_bucket(s3_server, bucket, "old/model.pt.tmp") is None
    assert in_bucket(s3_server, bucket, "old/model.pt") == payload


def test_write_back_waits_a_quiet_delay_and_a_rename_inside_it_costs_no_copy(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "quiet.toml"  # dataset's quiet delay (1 s by default), made plain to see
    cfg.write_text("[classes.dataset]\nupload_delay = 6\n")
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg))
    mp = m.mountpoint
    (mp / "shard-0.tar").write_bytes(b"x" * 4096)  # dataset: write-back after its quiet delay
    assert in_bucket(s3_server, bucket, "shard-0.tar") is None
    os.rename(mp / "shard-0.tar", mp / "shard-000.tar")
    # Not before its quiet delay: a checkpoint closed after it (uploaded at once) lands first.
    (mp / "after.pt").write_bytes(b"a" * 4096)
    wait_in_bucket(s3_server, bucket, "after.pt", timeout=60)
    assert put_keys(proxy, bucket) == ["after.pt"]
    wait_in_bucket(s3_server, bucket, "shard-000.tar", timeout=60)
    assert put_keys(proxy, bucket) == ["after.pt", "shard-000.tar"]
    assert proxy.stats()[("copy", "total")] == 0


def test_manifest_rename_publishes_in_the_background_after_its_barrier(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
) -> None:
    """DCP's commit: `.metadata.tmp` -> `.metadata` returns before the shards are
    uploaded; `.metadata` lands after them, with no copy and no temp-name PUT."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    mp = m.mountpoint
    os.makedirs(mp / "ckpt/step-1")
    # The shard uploads are held (unanswered) until the rules change.
    proxy.set_rules([Rule("blackhole", ops={"put", "multipart"}, path=r"\.distcp")])
    shards = {f"__{i}_0.distcp": os.urandom(MiB) for i in range(2)}
    for name, body in shards.items():
        (mp / "ckpt/step-1" / name).write_bytes(body)
    (mp / "ckpt/step-1/.metadata.tmp").write_bytes(b"meta")
    deadline = time.monotonic() + 60
    while sum(v for (op, f), v in proxy.stats().items() if f == "blackhole") < len(shards):
        assert time.monotonic() < deadline, proxy.stats()  # hang guard
        time.sleep(0.02)
    # returns while both shard uploads are still held: it does not wait for them
    os.rename(mp / "ckpt/step-1/.metadata.tmp", mp / "ckpt/step-1/.metadata")
    assert in_bucket(s3_server, bucket, "ckpt/step-1/.metadata") is None
    assert (mp / "ckpt/step-1/.metadata").read_bytes() == b"meta"  # served here meanwhile
    proxy.clear()  # the held requests are dropped: the uploads retry and land
    flush(m)
    order = put_keys(proxy, bucket)
    assert order.index("ckpt/step-1/.metadata") > max(order.index(f"ckpt/step-1/{n}") for n in shards)
    assert "ckpt/step-1/.metadata.tmp" not in order
    assert proxy.stats()[("copy", "total")] == 0
    assert in_bucket(s3_server, bucket, "ckpt/step-1/.metadata") == b"meta"


def test_a_manifest_does_not_wait_for_temp_files_beside_it(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
) -> None:
    """A temporary file is not a checkpoint file until renamed: the manifest's
    barrier leaves it (waiting would upload it under its temporary name)."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)  # grace: 30 s
    mp = m.mountpoint
    os.makedirs(mp / "run")
    (mp / "run/shard.pt").write_bytes(os.urandom(MiB))
    (mp / "run/next.pt.tmp").write_bytes(os.urandom(MiB))  # a save still in progress
    (mp / "run/latest").write_text("1")  # a manifest: published after its barrier
    wait_in_bucket(s3_server, bucket, "run/latest", timeout=20)
    order = put_keys(proxy, bucket)
    assert order.index("run/latest") > order.index("run/shard.pt")
    assert "run/next.pt.tmp" not in order
    os.replace(mp / "run/next.pt.tmp", mp / "run/next.pt")
    flush(m)
    assert "run/next.pt.tmp" not in put_keys(proxy, bucket)
    assert in_bucket(s3_server, bucket, "run/next.pt") is not None


def test_background_publish_that_loses_its_race_is_reported(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
) -> None:
    """Another writer changes `latest` while this mount's publish waits for its
    barrier: the conditional PUT gets 412. Bytes kept in conflicts/, one error
    line, a metric, status, and flush fails naming the path."""
    s3_server.client().put_object(Bucket=bucket, Key="run/latest", Body=b"100")
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    mp = m.mountpoint
    assert (mp / "run/latest").read_bytes() == b"100"
    proxy.set_rules([Rule("latency", ops={"put", "multipart"}, path=r"model\.pt", delay=2.0)])
    (mp / "run/model.pt").write_bytes(b"w" * 4096)  # the barrier: held 2 s at the proxy
    with open(mp / "run/latest", "r+b") as f:  # If-Match the version read: "100"
        f.write(b"200")
    s3_server.client().put_object(Bucket=bucket, Key="run/latest", Body=b"300 elsewhere")
    res = run_tierfs("flush", str(mp), env=m.env, timeout=300)
    assert res.returncode != 0 and "run/latest" in res.stdout + res.stderr
    assert in_bucket(s3_server, bucket, "run/latest") == b"300 elsewhere"
    kept = [p for p in (m.cache_dir / "conflicts").iterdir() if not p.name.endswith(".json")]
    assert [p.read_bytes() for p in kept] == [b"200"]
    note = json.loads(next((m.cache_dir / "conflicts").glob("*.json")).read_text())
    assert (note["key"], note["kind"]) == ("run/latest", "conflict")
    log = (m.cache_dir / "tierfs.log").read_text()
    assert "manifest 'run/latest' changed in the store before its background publish" in log
    snap = m.status()
    assert [(f["key"], f["kind"]) for f in snap["quarantined"]["files"]] == [("run/latest", "conflict")]
    assert m.metric("tierfs_writeback_total{event=publish_conflict}") == 1
    # settled by hand: discard, and flush is clean again
    res = run_tierfs("pending", "discard", str(mp), "run/latest", env=m.env, timeout=60)
    assert res.returncode == 0, res.stderr
    flush(m)


def test_publish_wait_keeps_estale_at_close(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
) -> None:
    cfg = tmp_path / "wait.toml"
    cfg.write_text('[classes.manifest]\npublish = "wait"\n')
    s3_server.client().put_object(Bucket=bucket, Key="latest", Body=b"1")
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    fd = os.open(m.mountpoint / "latest", os.O_RDWR)
    assert os.read(fd, 10) == b"1"
    os.pwrite(fd, b"2", 0)
    s3_server.client().put_object(Bucket=bucket, Key="latest", Body=b"3")
    with pytest.raises(OSError) as exc:
        os.close(fd)
    assert exc.value.errno == 116  # ESTALE
    assert in_bucket(s3_server, bucket, "latest") == b"3"
