"""Parts of a write-back file go up while it is written (writeback/streaming.py).

Each test runs twice: on the daemon path (every write(2) a FUSE request the
daemon sees) and with FUSE passthrough (the kernel writes the tier-1 file; the
daemon follows its length), the default where the kernel has it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import PASSTHROUGH_OFF, kill_daemon_with_open_writer, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
PART = 16 * MiB  # the default part size


def obj(s3: SeaweedServer, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def open_uploads(s3: SeaweedServer, bucket: str) -> list[dict]:
    return s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def parts_up(s3: SeaweedServer, bucket: str, key: str) -> list[int]:
    """Part numbers already in the store for the open upload(s) of `key`."""
    out: list[int] = []
    c = s3.client()
    for up in open_uploads(s3, bucket):
        if up["Key"] == key:
            got = c.list_parts(Bucket=bucket, Key=key, UploadId=up["UploadId"])
            out += [p["PartNumber"] for p in got.get("Parts", [])]
    return sorted(out)


def wait_for_parts(s3: SeaweedServer, bucket: str, key: str, want: set[int],
                   timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not want <= set(parts_up(s3, bucket, key)):
        # hang guard
        assert time.monotonic() < deadline, f"parts {want} never went up: {parts_up(s3, bucket, key)}"
        time.sleep(0.05)


# Off by default (config.py says why); these mounts turn it on where files land.
STREAM = "".join(f"[classes.{c}]\nstream_parts = true\n" for c in ("default", "checkpoint", "dataset"))


@pytest.fixture(params=["daemon", "passthrough"])
def streaming(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    cfg = tmp_path / "stream.toml"
    cfg.write_text(STREAM)
    if request.param == "daemon":
        return ["--config", str(cfg), "--no-passthrough"]
    if PASSTHROUGH_OFF:
        pytest.skip("TIERFS_TEST_PASSTHROUGH=0: mounts without passthrough")
    return ["--config", str(cfg)]


def flush(m) -> None:  # type: ignore[no-untyped-def]
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


def check_path(m, streaming: list[str]) -> None:  # type: ignore[no-untyped-def]
    """The writes took the path the test is about (passthrough: the kernel has it)."""
    kernel = m.metric("tierfs_opens_total{mode=passthrough,why=writable}")
    if "--no-passthrough" in streaming:
        assert kernel == 0
    elif not m.status()["passthrough"]["enabled"]:
        pytest.skip(f"no FUSE passthrough here: {m.status()['passthrough']['reason']}")
    else:
        assert kernel >= 1


def test_parts_go_up_while_the_file_is_written(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer,
    streaming: list[str],
) -> None:
    m = mount_factory(f"s3://{bucket}", *streaming)
    data = os.urandom(6 * PART + 12345)
    with open(m.mountpoint / "ckpt.pt", "wb", buffering=0) as f:
        f.write(data[: 4 * PART])
        # The writer is a whole part past parts 1 and 2: they go up before close.
        wait_for_parts(s3_server, bucket, "ckpt.pt", {1, 2})
        assert "ckpt.pt" not in [o["Key"] for o in s3_server.client().list_objects_v2(
            Bucket=bucket).get("Contents", [])]
        f.write(data[4 * PART:])
    check_path(m, streaming)
    flush(m)
    assert obj(s3_server, bucket, "ckpt.pt") == data
    assert open_uploads(s3_server, bucket) == []
    tags = s3_server.client().get_object_tagging(Bucket=bucket, Key="ckpt.pt")["TagSet"]
    assert [t["Key"] for t in tags] == ["tierfs-xxh3tree"] and len(tags[0]["Value"]) == 32
    assert m.metric("tierfs_writeback_total{event=streamed_parts}") >= 2
    # Attributes known when the upload began (mode) went with it.
    head = s3_server.client().head_object(Bucket=bucket, Key="ckpt.pt")
    assert int(head["Metadata"]["mode"]) & 0o777 == os.stat(m.mountpoint / "ckpt.pt").st_mode & 0o777


def test_a_part_written_again_after_it_went_up_is_sent_again(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer,
    streaming: list[str],
) -> None:
    m = mount_factory(f"s3://{bucket}", *streaming)
    local = bytearray(os.urandom(5 * PART))
    fd = os.open(m.mountpoint / "rewritten.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, local[: 4 * PART])
        wait_for_parts(s3_server, bucket, "rewritten.pt", {1, 2})
        patch = os.urandom(4096)
        os.pwrite(fd, patch, PART + 100)  # behind the writer, into part 2 (sent)
        local[PART + 100: PART + 100 + len(patch)] = patch
        os.lseek(fd, 4 * PART, os.SEEK_SET)
        os.write(fd, local[4 * PART:])
    finally:
        os.close(fd)
    check_path(m, streaming)
    flush(m)
    assert obj(s3_server, bucket, "rewritten.pt") == bytes(local)
    assert (m.mountpoint / "rewritten.pt").read_bytes() == bytes(local)
    assert open_uploads(s3_server, bucket) == []
    # Part 1 went up as it is now and was kept (3 and 4 too, if they went up before
    # the close); part 2 was patched after it went up: sent again at the seal.
    assert 1 <= m.metric("tierfs_writeback_total{event=streamed_parts}") <= 3


def test_kill9_mid_streamed_write_aborts_the_upload_and_quarantines(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
    streaming: list[str],
) -> None:
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", *streaming, cache_dir=cache)
    # 512 MiB of a file written and never closed: its first parts are up when the
    # daemon dies.
    kill_daemon_with_open_writer(m, m.mountpoint / "big.pt", 512 * MiB,
                                 before=lambda: wait_for_parts(s3_server, bucket, "big.pt", {1}))
    assert len(open_uploads(s3_server, bucket)) == 1
    assert list((cache / "streams").glob("*.json")), "the upload id was not journaled"
    m2 = mount_factory(f"s3://{bucket}", *streaming, cache_dir=cache, mountpoint=m.mountpoint)
    flush(m2)
    assert open_uploads(s3_server, bucket) == []
    assert "big.pt" not in [o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=bucket).get("Contents", [])]
    assert not list((cache / "streams").glob("*.json"))
    assert [e["key"] for e in m2.status()["quarantined"]["files"]] == ["big.pt"]


def test_a_temporary_name_sends_nothing_before_its_rename(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer,
    streaming: list[str],
) -> None:
    """torch.save to a temp name then os.replace: no upload under the temp name."""
    m = mount_factory(f"s3://{bucket}", *streaming)
    data = os.urandom(4 * PART)
    with open(m.mountpoint / "model.pt.tmp", "wb") as f:
        f.write(data)
        assert open_uploads(s3_server, bucket) == []
    os.replace(m.mountpoint / "model.pt.tmp", m.mountpoint / "model.pt")
    flush(m)
    assert obj(s3_server, bucket, "model.pt") == data
    assert open_uploads(s3_server, bucket) == []


def test_times_set_after_the_write_go_up_with_the_object(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer,
    streaming: list[str],
) -> None:
    """cp -a, tar x: utimens after the bytes. An upload created before the seal
    cannot carry them, so the file goes up the usual way with its times."""
    m = mount_factory(f"s3://{bucket}", *streaming)
    data = os.urandom(4 * PART)
    path = m.mountpoint / "copied.bin"
    with open(path, "wb") as f:
        f.write(data)
        wait_for_parts(s3_server, bucket, "copied.bin", {1, 2})
    os.utime(path, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    flush(m)
    assert obj(s3_server, bucket, "copied.bin") == data
    head = s3_server.client().head_object(Bucket=bucket, Key="copied.bin")
    # (to the microsecond: the journal keeps a file's mtime as a float)
    assert abs(float(head["Metadata"]["mtime"]) - 1_500_000_000.987654321) < 1e-6
    assert abs(os.stat(path).st_mtime_ns - 1_500_000_000_987_654_321) < 1000
    assert open_uploads(s3_server, bucket) == []


def test_off_by_default_nothing_goes_up_before_the_seal(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    data = os.urandom(4 * PART)
    with open(m.mountpoint / "ckpt.pt", "wb", buffering=0) as f:
        f.write(data)
        os.fsync(f.fileno())
        assert open_uploads(s3_server, bucket) == []
    flush(m)
    assert obj(s3_server, bucket, "ckpt.pt") == data
    assert m.metric("tierfs_writeback_total{event=streamed_parts}") == 0
