"""A store outage never turns into a false "No such file or directory".

tierfs must not answer ENOENT for a name it cannot know is absent: a training
script that sees `ckpt/latest` missing starts over from scratch. While the
store is away, names this mount listed before stay, names it never saw are
EIO (at once once degraded), and `tierfs status` says degraded as soon as an
operation failed for an unreachable store.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from tests.fault.conftest import store_config
from tests.fault.proxy import FaultProxy
from tests.integration.conftest import MountFactory
from tests.support.errnos import errno_of
from tests.support.seaweed import SeaweedServer

# No class rule matches *.dat: the default class, whose TTLs are set to 0 below
# so that every lookup asks the store (the outage is then seen at once).
ZERO_TTL = "[classes.default]\nattr_ttl = 0\nlist_ttl = 0\n"


def test_outage_answers_eio_not_enoent_for_what_it_cannot_know(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    client = s3_server.client()
    for key in ("data/a.dat", "data/b.dat", "cold/x.dat", "ckpt/step-1/model.dat"):
        client.put_object(Bucket=bucket, Key=key, Body=b"x" * 4096)
    client.put_object(Bucket=bucket, Key="ckpt/latest", Body=b"step-1")
    deadline = 3.0
    cfg = store_config(tmp_path, deadline=deadline, read_timeout=1.0, extra=ZERO_TTL)
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg))
    mp = m.mountpoint
    assert sorted(os.listdir(mp)) == ["ckpt", "cold", "data"]
    assert sorted(os.listdir(mp / "data")) == ["a.dat", "b.dat"]
    assert m.status()["degraded"] is False

    proxy.blackhole_all(True)
    # The first operation waits for the store's deadline; the file it looks up was
    # listed by this mount, so it still exists (uncached: its bytes are EIO).
    t0 = time.monotonic()
    assert os.stat(mp / "data/a.dat").st_size == 4096
    assert time.monotonic() - t0 < 10 * deadline  # hang guard
    st = m.status()
    assert st["degraded"] is True, "status must say degraded once an operation failed"
    assert "internal" not in st["errors"], st["errors"]

    def errno_asking_nothing(fn, name: str) -> int | None:
        """The errno of fn(), which must send the store no request about `name`:
        known degraded, the answer comes at once instead of at the deadline."""
        asked = len(proxy.log)
        code = errno_of(fn)
        assert not [e for e in proxy.log[asked:] if name in e.path], proxy.log[asked:]
        return code

    # Known degraded: every answer comes at once, none of them a false ENOENT.
    assert errno_asking_nothing((mp / "data/b.dat").read_bytes, "b.dat") == errno.EIO
    # never listed, nothing cached
    assert errno_asking_nothing(lambda: os.listdir(mp / "cold"), "cold") == errno.EIO
    assert errno_asking_nothing(lambda: os.stat(mp / "cold/x.dat"), "cold") == errno.EIO
    # a manifest: a HEAD is needed
    assert errno_asking_nothing(lambda: os.stat(mp / "ckpt/latest"), "ckpt") == errno.EIO
    assert sorted(os.listdir(mp / "data")) == ["a.dat", "b.dat"]  # what this mount listed
    # A name the store's last whole listing of data/ did not have stays absent.
    assert errno_of(lambda: os.stat(mp / "data/never.dat")) == errno.ENOENT
    assert "internal" not in m.status()["errors"]

    proxy.clear()
    until = time.monotonic() + 60  # the probe runs every 5 s
    while errno_of(lambda: os.listdir(mp / "cold")) is not None:
        assert time.monotonic() < until, "never left degraded mode"  # hang guard
        time.sleep(0.2)
    assert os.listdir(mp / "cold") == ["x.dat"]
    assert (mp / "data/b.dat").read_bytes() == b"x" * 4096
    assert (mp / "ckpt/latest").read_bytes() == b"step-1"


def test_degraded_at_mount_unknown_names_are_eio(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """A mount made while the store is down (from a cache that holds one file)
    knows nothing else: other names are EIO, not absent."""
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="data/warm.dat", Body=b"w" * (1 << 20))
    client.put_object(Bucket=bucket, Key="data/cold.dat", Body=b"c" * 1000)
    client.put_object(Bucket=bucket, Key="other/y.dat", Body=b"y")
    cfg = store_config(tmp_path, deadline=2.0, read_timeout=1.0)
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg),
                      cache_dir=cache)
    assert (m.mountpoint / "data/warm.dat").read_bytes() == b"w" * (1 << 20)
    m.umount()
    proxy.blackhole_all(True)
    m = mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint, "--config", str(cfg),
                      cache_dir=cache, mountpoint=m.mountpoint)
    mp = m.mountpoint
    assert m.status()["degraded"] is True
    assert (mp / "data/warm.dat").read_bytes() == b"w" * (1 << 20)
    assert errno_of(lambda: os.stat(mp / "data/cold.dat")) == errno.EIO
    assert errno_of(lambda: os.listdir(mp / "other")) == errno.EIO
