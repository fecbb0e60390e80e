"""Bad input: one clear line, non-zero exit, never a hang, nothing left mounted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer


def mount_fails(args: list[str], env: dict[str, str], mountpoint: Path) -> str:
    res = run_tierfs("mount", *args, env=env, timeout=60)  # hang guard: TimeoutExpired
    assert res.returncode != 0, res
    err = res.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tierfs: error: ")
    assert not is_mounted(mountpoint)
    return err


@pytest.fixture
def env(s3_server: SeaweedServer) -> dict[str, str]:
    return {**os.environ, **s3_server.env()}


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("http://bucket/x", "invalid source"),
        ("s3://", "invalid source"),
        ("s3://ab", "bucket"),
        ("s3://Bad_Bucket", "bucket"),
        ("bucket-without-scheme", "invalid source"),
    ],
)
def test_malformed_source(source: str, expect: str, env: dict[str, str], tmp_path: Path) -> None:
    err = mount_fails([source, str(tmp_path), "--cache-dir", str(tmp_path / "c")], env, tmp_path)
    assert expect in err


def test_missing_bucket(env: dict[str, str], tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    err = mount_fails(["s3://no-such-bucket-here", str(mp), "--cache-dir", str(tmp_path / "c")],
                      env, mp)
    assert "no-such-bucket-here" in err and "does not exist" in err


def test_wrong_credentials(env: dict[str, str], tmp_path: Path, bucket: str) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    bad = {**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    err = mount_fails([f"s3://{bucket}", str(mp), "--cache-dir", str(tmp_path / "c")], bad, mp)
    assert "access denied" in err.lower() or "credentials" in err.lower()
    assert "wrong-secret" not in err


def test_unreachable_endpoint_without_cache(env: dict[str, str], tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    err = mount_fails(["s3://some-bucket", str(mp), "--cache-dir", str(tmp_path / "c"),
                       "--endpoint-url", "http://127.0.0.1:9"], env, mp)
    assert "127.0.0.1:9" in err


def test_mountpoint_missing_not_dir_busy(
    env: dict[str, str], tmp_path: Path, bucket: str, mount_factory: MountFactory
) -> None:
    src = f"s3://{bucket}"
    err = mount_fails([src, str(tmp_path / "missing"), "--cache-dir", str(tmp_path / "c")],
                      env, tmp_path / "missing")
    assert "does not exist" in err
    f = tmp_path / "file"
    f.write_text("x")
    err = mount_fails([src, str(f), "--cache-dir", str(tmp_path / "c")], env, f)
    assert "not a directory" in err
    m = mount_factory(src)
    res = run_tierfs("mount", src, str(m.mountpoint), "--cache-dir", str(tmp_path / "c2"), env=env)
    assert res.returncode != 0 and "already mounted" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert is_mounted(m.mountpoint)  # the first mount is untouched


def test_cache_dir_unwritable(env: dict[str, str], tmp_path: Path, bucket: str) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    blocker = tmp_path / "plainfile"
    blocker.write_text("x")  # root ignores modes, so use a path under a regular file
    err = mount_fails([f"s3://{bucket}", str(mp), "--cache-dir", str(blocker / "cache")], env, mp)
    assert "cache dir" in err


def test_cache_dir_in_use(
    env: dict[str, str], tmp_path: Path, bucket: str, mount_factory: MountFactory
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = tmp_path / "other"
    mp.mkdir()
    err = mount_fails([f"s3://{bucket}", str(mp), "--cache-dir", str(m.cache_dir)], env, mp)
    assert "in use" in err


def test_file_source_missing(env: dict[str, str], tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    err = mount_fails([f"file://{tmp_path}/nope", str(mp), "--cache-dir", str(tmp_path / "c")],
                      env, mp)
    assert "nope" in err


def test_umount_of_a_killed_daemon_cleans_the_stale_mount(
    mount_factory: MountFactory, bucket: str, env: dict[str, str]
) -> None:
    m = mount_factory(f"s3://{bucket}")
    m.kill9()
    assert is_mounted(m.mountpoint)
    res = run_tierfs("umount", str(m.mountpoint), env=env)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.mountpoint)
    res = run_tierfs("umount", str(m.mountpoint), env=env)
    assert res.returncode != 0 and "not mounted" in res.stderr
