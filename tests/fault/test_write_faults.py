"""Store failures during uploads, injected by the fault proxy (issue 15, items 4 and 5).

A permanent refusal is quarantined, not retried; an outage never makes umount
wait silently or forever; a write-through close either lands or fails, never
both.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.fault.conftest import store_config
from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
# Listings and attributes of default-class names stay cached, so
# that a create during the outage is decided by the listing taken before it.
CACHED_NAMES = '[classes.default]\nlist_ttl = "inf"\nattr_ttl = "inf"\n'


def keys(s3: SeaweedServer, bucket: str) -> list[str]:
    return s3.keys(bucket)


def flush(m: TierfsMount, timeout: float = 120) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=timeout)
    assert res.returncode == 0, res.stderr


def wait_not_degraded(m: TierfsMount, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # the probe runs every 5 s
    while m.status()["degraded"]:
        assert time.monotonic() < deadline, "never left degraded mode"  # hang guard
        time.sleep(0.2)


def test_refused_upload_is_quarantined_then_retried_on_request(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """Item 4. The store refuses every upload (403 AccessDenied): the multipart
    upload is tried once, the file quarantined with a note, flush fails within
    seconds naming it; once the store accepts writes, `tierfs pending retry`
    uploads it. Before: retried forever, flush never returned."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=5)))
    proxy.set_rules([Rule("403", ops={"put", "multipart"})])
    data = os.urandom(20 * MiB)  # above the part size: a multipart upload
    (m.mountpoint / "a.pt").write_bytes(data)
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)  # hang guard
    assert res.returncode != 0 and "a.pt" in res.stderr, res
    refused = sum(v for (op, fault), v in proxy.stats().items() if fault == "403")
    assert 1 <= refused <= 3, proxy.stats()  # tried, not retried
    [note] = m.status()["quarantined"]["files"]
    assert note["key"] == "a.pt" and "access denied" in note["reason"].lower()
    proxy.clear()
    res = run_tierfs("pending", "retry", str(m.mountpoint), "a.pt", env=m.env, timeout=60)
    assert res.returncode == 0, res
    flush(m)
    assert s3_server.client().get_object(Bucket=bucket, Key="a.pt")["Body"].read() == data
    assert m.status()["quarantined"]["files"] == []
    assert (m.mountpoint / "a.pt").read_bytes() == data


def test_umount_shows_what_it_waits_for_and_gives_up(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """Item 4. With the store away an upload cannot land: umount says what it
    waits for (a line every few seconds when not on a terminal), gives up once
    nothing moved for --timeout seconds with the --no-flush hint, and leaves the
    mount serving. Before: umount hung without a word."""
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=5, extra=CACHED_NAMES)))
    assert os.listdir(m.mountpoint) == []  # known absent: a create needs no store
    proxy.blackhole_all(True)
    data = os.urandom(4 * MiB)
    (m.mountpoint / "ckpt.pt").write_bytes(data)  # write-back: acknowledged locally
    # hang guard: run_tierfs's timeout (10x the 6 s of no progress umount waits for)
    res = run_tierfs("umount", str(m.mountpoint), "--timeout", "6", env=m.env, timeout=120)
    assert res.returncode != 0, res
    assert "ckpt.pt" in res.stderr and "--no-flush" in res.stderr, res.stderr
    assert res.stderr.count("waiting for") >= 2, res.stderr
    assert is_mounted(m.mountpoint) and m.status()["pid"] == m.pid
    assert (m.mountpoint / "ckpt.pt").read_bytes() == data
    proxy.clear()
    flush(m)
    assert s3_server.client().get_object(Bucket=bucket, Key="ckpt.pt")["Body"].read() == data
    assert m.umount().returncode == 0


def test_write_through_close_in_an_outage_fails_and_nothing_lands_later(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """Item 5. Write-through (the default class, made so): with the store away,
    close fails with EIO within the store deadline, and the file is not
    uploaded once the store is back. Before: close failed after the deadline,
    and the upload was retried behind it and landed anyway."""
    deadline = 5.0
    through = CACHED_NAMES + 'write_mode = "writethrough"\n'
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint,
                      "--config", str(store_config(tmp_path, deadline=deadline, extra=through)))
    assert os.listdir(m.mountpoint) == []  # the root listing is cached from here on
    proxy.blackhole_all(True)
    t0 = time.monotonic()
    with pytest.raises(OSError) as exc:
        (m.mountpoint / "notes.txt").write_bytes(b"x" * 1000)
    took = time.monotonic() - t0
    assert exc.value.errno == errno.EIO, exc.value
    assert took < 10 * deadline, took  # hang guard
    proxy.clear()
    wait_not_degraded(m)
    flush(m)
    assert keys(s3_server, bucket) == []
    assert m.status()["pending"]["count"] == 0
