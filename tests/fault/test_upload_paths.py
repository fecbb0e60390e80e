"""Uploads seen through the fault proxy: `tierfs flush PATH` waits for that
subtree only, and an upload whose result does not verify is never marked
landed (it is sent again)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.fault.conftest import store_config
from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def keys(s3: SeaweedServer, bucket: str) -> set[str]:
    return set(s3.keys(bucket))


def obj(s3: SeaweedServer, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def test_flush_path_waits_for_its_subtree_only(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=60, read_timeout=60)))
    mp = m.mountpoint
    (mp / "slow").mkdir()
    (mp / "fast").mkdir()
    # The upload of slow/a.pt hangs (until the rules change).
    proxy.set_rules([Rule("blackhole", ops={"put", "multipart"}, path=r"/slow/a\.pt")])
    slow, fast = os.urandom(2 * MiB), os.urandom(2 * MiB)
    (mp / "slow/a.pt").write_bytes(slow)
    (mp / "fast/b.pt").write_bytes(fast)
    res = run_tierfs("flush", str(mp), "fast", env=m.env, timeout=60)
    assert res.returncode == 0, res.stderr
    # it returned before slow/a.pt was done: that one is still held, below
    assert obj(s3_server, bucket, "fast/b.pt") == fast
    assert "slow/a.pt" not in keys(s3_server, bucket)
    assert m.status()["pending"]["count"] == 1  # slow/a.pt, still held
    proxy.clear()  # the held request is dropped: the upload retries and lands
    res = run_tierfs("flush", str(mp), str(mp / "slow"), env=m.env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert obj(s3_server, bucket, "slow/a.pt") == slow


def test_an_upload_that_does_not_verify_is_sent_again(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """Between our PUT and the HEAD that verifies it, another writer replaces the
    object (the proxy holds that HEAD while it does): size and digest disagree,
    so the file stays pending and is uploaded again, then verifies."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint)
    mine = os.urandom(3 * MiB)
    proxy.set_rules([Rule("latency", ops={"head"}, path=r"/ckpt/model\.pt", delay=2.0, count=1)])
    (m.mountpoint / "ckpt").mkdir()
    (m.mountpoint / "ckpt/model.pt").write_bytes(mine)  # write-back: the upload follows
    deadline = time.monotonic() + 60
    while proxy.stats()[("head", "latency")] < 1:  # our PUT is done; its HEAD is held
        assert time.monotonic() < deadline, "the upload's HEAD never came"  # hang guard
        time.sleep(0.01)
    s3_server.client().put_object(Bucket=bucket, Key="ckpt/model.pt", Body=b"someone else")
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert obj(s3_server, bucket, "ckpt/model.pt") == mine
    log = (m.cache_dir / "tierfs.log").read_text()
    assert "did not verify" in log
    assert m.metric("tierfs_store_requests_total{op=put,status=ok}") >= 2  # sent twice
