"""A 1 GiB object through the mount, then the store stopped: tier 1 still serves it.

This module owns its SeaweedFS (it stops it mid-test), separate from the
session server the other tests share.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.mount import TierfsMount, is_mounted
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20
SIZE = 1024 * MiB


def dd_sha(path: Path) -> str:
    """sha256 of what `dd bs=1M` reads from `path`."""
    dd = subprocess.Popen(["dd", f"if={path}", "bs=1M", "status=none"], stdout=subprocess.PIPE)
    assert dd.stdout is not None
    h = hashlib.sha256()
    while chunk := dd.stdout.read(4 * MiB):
        h.update(chunk)
    assert dd.wait() == 0
    return h.hexdigest()


def mmap_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for off in range(0, len(mm), 8 * MiB):
            h.update(mm[off : off + 8 * MiB])
    return h.hexdigest()


@pytest.mark.timeout(600)
def test_1gib_by_dd_and_mmap_then_store_down(own_server: SeaweedServer, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for i in range(SIZE // (64 * MiB)):
            block = hashlib.sha256(str(i).encode()).digest() * (64 * MiB // 32)
            block = bytes(b ^ (i & 0xFF) for b in block[:256]) + block[256:]
            f.write(block)
            h.update(block)
    want = h.hexdigest()
    client = own_server.client()
    own_server.make_bucket("big")
    client.upload_file(str(src), "big", "models/big.bin")
    src.unlink()

    env = {**os.environ, **own_server.env()}
    m = TierfsMount("s3://big", tmp_path / "mnt", tmp_path / "cache", env)
    try:
        m.start()
        path = m.mountpoint / "models/big.bin"
        assert os.stat(path).st_size == SIZE
        assert dd_sha(path) == want
        assert mmap_sha(path) == want
        m.umount()
        assert not is_mounted(m.mountpoint)

        own_server.stop()
        m2 = TierfsMount("s3://big", tmp_path / "mnt", tmp_path / "cache", env)
        m.pid = None
        m = m2
        m.start()
        assert "degraded" in m.stderr
        assert m.status()["degraded"] is True
        assert dd_sha(path) == want
        assert mmap_sha(path) == want
        assert m.metric("tierfs_store_bytes_total{op=get}") == 0
    finally:
        m.cleanup()
