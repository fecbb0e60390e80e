"""The transfer engine through a real mount: the runtime moves the bytes of cold
reads and uploads, `[store] engine = "botocore"` moves none, and an object
replaced in the store while a reader is half way through it is never served
as a mix of versions (If-Match on every ranged GET)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def _config(tmp_path: Path, engine: str) -> str:
    path = tmp_path / f"{engine}.toml"
    path.write_text(f'[store]\nengine = "{engine}"\n')
    return str(path)


def _flush(m) -> None:  # type: ignore[no-untyped-def]
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("engine", ["crt", "botocore"])
def test_reads_and_uploads_go_through_the_chosen_engine(
    engine: str, mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer,
    tmp_path: Path,
) -> None:
    data, small = os.urandom(40 * MiB + 3), os.urandom(300 * 1024 + 1)
    s3_server.client().put_object(Bucket=bucket, Key="in/shard.tar", Body=data)
    s3_server.client().put_object(Bucket=bucket, Key="in/img.jpg", Body=small)
    m = mount_factory(f"s3://{bucket}", "--config", _config(tmp_path, engine))
    assert (m.mountpoint / "in/shard.tar").read_bytes() == data
    assert (m.mountpoint / "in/img.jpg").read_bytes() == small
    out = os.urandom(37 * MiB + 11)  # multipart: 3 parts of 16 MiB
    (m.mountpoint / "out.pt").write_bytes(out)
    _flush(m)
    got = s3_server.client().get_object(Bucket=bucket, Key="out.pt", ChecksumMode="ENABLED")
    assert got["Body"].read() == out
    store = m.status()["store"]
    assert store["engine"] == engine
    threads = store["cpu_seconds"]
    if engine == "crt":
        # Small objects through the runtime, a big file's long ranges through botocore
        # (crt.runtime_get).
        assert len(small) <= store["runtime_bytes"]["get"] < len(data)
        assert store["runtime_bytes"]["put"] == len(out)
        assert threads["runtime_threads"] >= 1
        assert got["ChecksumCRC32C"].endswith("-3")  # one CRC32C per part, checked by the store
    else:
        assert store["runtime_bytes"] == {} and threads["runtime_threads"] == 0
        assert "ChecksumCRC32C" not in got
    assert threads["python_threads"] >= 1


def test_etag_change_mid_read_is_never_served_as_a_mix(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path,
) -> None:
    """Replace an object after the first MiB of a sequential read: every later GET
    is pinned to the old ETag (412), so the reader gets the old bytes or an errno,
    never the new object's."""
    old, new = os.urandom(160 * MiB), os.urandom(160 * MiB)
    c = s3_server.client()
    c.put_object(Bucket=bucket, Key="big.tar", Body=old)
    cfg = tmp_path / "small-readahead.toml"
    cfg.write_text('[store]\nengine = "crt"\n[read]\nreadahead = "16M"\n')
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    failed = None
    with open(m.mountpoint / "big.tar", "rb", buffering=0) as f:
        assert f.read(MiB) == old[:MiB]
        c.put_object(Bucket=bucket, Key="big.tar", Body=new)
        pos = MiB
        try:
            while chunk := f.read(MiB):
                assert chunk == old[pos : pos + len(chunk)], pos
                pos += len(chunk)
        except OSError as exc:
            failed = exc.errno
    assert failed in (errno.ESTALE, errno.EIO), (failed, pos)
    assert m.metric("tierfs_store_requests_total{op=get,status=changed}") >= 1
