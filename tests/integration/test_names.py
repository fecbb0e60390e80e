"""Names too long for POSIX or for the store: ENAMETOOLONG, before anything is written.

A component over 255 bytes is ENAMETOOLONG on lookup as on create. A path
whose object key would pass the store's limit (1,024 bytes on S3 and
SeaweedFS, which refuses 1,025 with KeyTooLongError; `[store]
max_key_length` in the config) is refused by create, mkdir and rename, so no
file is accepted that could never be uploaded.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.errnos import errno_of
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

LIMIT = 1024


def keys(s3: SeaweedServer, bucket: str) -> list[str]:
    return s3.keys(bucket)


def deep_dir(mp: Path, total: int) -> tuple[Path, int]:
    """Directories of 200-byte names under `mp`, made through the mount, whose
    key prefix is close to `total` bytes; returns (dir, bytes its children's
    names may have before the key reaches `total`)."""
    d, used = mp, 0
    while total - used > 255:
        d = d / ("d" * 199 + str(len(d.parts) % 10))
        d.mkdir()
        used += 201
    return d, total - used


def test_component_over_255_bytes_is_enametoolong_on_lookup(
    mount_factory: MountFactory, bucket: str
) -> None:
    m = mount_factory(f"s3://{bucket}")
    long = "x" * 256
    assert errno_of(lambda: os.stat(m.mountpoint / long)) == errno.ENAMETOOLONG
    assert errno_of(lambda: os.stat(m.mountpoint / ("y" * 300))) == errno.ENAMETOOLONG
    assert errno_of(lambda: (m.mountpoint / long).write_bytes(b"")) == errno.ENAMETOOLONG
    assert errno_of(lambda: os.stat(m.mountpoint / ("x" * 255))) == errno.ENOENT


def test_key_over_store_limit_refused_before_anything_is_written(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    d, room = deep_dir(mp, LIMIT)
    ok, too_long = "f" * room, "f" * (room + 1)
    # exactly at the limit: written and uploaded
    (d / ok).write_bytes(b"fits")
    # one byte more: every way of making the name fails at once
    assert errno_of(lambda: (d / too_long).write_bytes(b"no")) == errno.ENAMETOOLONG
    assert errno_of(lambda: os.mkdir(d / ("g" * room))) == errno.ENAMETOOLONG  # + "/" of the marker
    assert errno_of(lambda: os.rename(d / ok, d / too_long)) == errno.ENAMETOOLONG
    assert errno_of(lambda: os.stat(d / too_long)) == errno.ENOENT
    res = run_tierfs("flush", str(mp), env=m.env, timeout=60)
    assert res.returncode == 0, res.stderr
    stored = keys(s3_server, bucket)
    assert [k for k in stored if not k.endswith("/")] == [str((d / ok).relative_to(mp))]
    assert max(len(k.encode()) for k in stored) == LIMIT
    st = m.status()
    assert st["pending"]["count"] == 0 and st["pending"].get("open_for_write", 0) == 0
    assert (d / ok).read_bytes() == b"fits"


def test_directory_rename_refused_if_a_key_below_would_be_too_long(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    d, room = deep_dir(mp, LIMIT - 10)
    (d / ("f" * room)).write_bytes(b"deep")
    top = d.relative_to(mp).parts[0]
    res = run_tierfs("flush", str(mp), env=m.env, timeout=60)
    assert res.returncode == 0, res.stderr
    before = keys(s3_server, bucket)
    # the renamed top directory's own key fits; the deep file's would be 11 bytes over
    assert errno_of(lambda: os.rename(mp / top, mp / (top + "z" * 11))) == errno.ENAMETOOLONG
    assert keys(s3_server, bucket) == before
    assert (d / ("f" * room)).read_bytes() == b"deep"
    os.rename(mp / top, mp / (top + "z" * 10))  # exactly at the limit: fine
    assert len(keys(s3_server, bucket)) == len(before)


@pytest.mark.parametrize("prefix", ["", "some/prefix"])
def test_key_limit_is_configurable_and_counts_the_source_prefix(
    mount_factory: MountFactory, bucket: str, tmp_path: Path, prefix: str
) -> None:
    cfg = tmp_path / "keys.toml"
    cfg.write_text("[store]\nmax_key_length = 64\n")
    source = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    m = mount_factory(source, "--config", str(cfg))
    room = 64 - len(f"{prefix}/" if prefix else "")
    (m.mountpoint / ("a" * room)).write_bytes(b"1")
    assert errno_of(lambda: (m.mountpoint / ("a" * (room + 1))).write_bytes(b"1")) == \
        errno.ENAMETOOLONG
