"""Data safety of the write path through a real mount (issue 15, items 1, 2, 4, 5).

Nothing acknowledged is lost, a close never both fails and succeeds, and
flush/umount never wait silently: each test here failed on the code before
its fix (named in the docstring).
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def keys(s3: SeaweedServer, bucket: str) -> list[str]:
    return s3.keys(bucket)


def obj(s3: SeaweedServer, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def flush(m: TierfsMount, timeout: float = 120) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=timeout)
    assert res.returncode == 0, res.stderr


def wait_open_for_write_zero(m: TierfsMount, timeout: float = 10.0) -> dict:
    """RELEASE reaches the daemon after close(2) returns: poll briefly."""
    deadline = time.monotonic() + timeout
    while True:
        pending = m.status()["pending"]
        if pending.get("open_for_write") == 0 or time.monotonic() > deadline:
            return pending
        time.sleep(0.05)


def uploads(m: TierfsMount) -> float:
    """PUT and multipart requests the daemon has made so far."""
    reqs = m.status()["store"]["requests"]
    return sum(sum(by.values()) for op, by in reqs.items() if op in ("put", "multipart"))


def test_flush_after_safetensors_saves_is_a_barrier(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """Item 1. safetensors.save_file creates `.tmpXXXXXX`, truncates, writes and
    renames it before close. After every save `tierfs flush` returns once the
    file is in the bucket, and once every file is closed the mount counts none
    open for writing. Before: a write the kernel sent back during the rename
    re-created the temp name's record, which stayed `open_for_write` for good
    (about one every two saves)."""
    np = pytest.importorskip("numpy")
    save_file = pytest.importorskip("safetensors.numpy").save_file
    m = mount_factory(f"s3://{bucket}")
    for i in range(10):
        save_file({"w": np.full((32 * MiB) // 4, i, dtype=np.float32)},
                  str(m.mountpoint / "model.safetensors"))
        flush(m)
        tail = s3_server.client().get_object(
            Bucket=bucket, Key="model.safetensors", Range="bytes=-4")["Body"].read()
        assert np.frombuffer(tail, np.float32)[0] == i, f"save {i}: flush returned before it landed"
    pending = wait_open_for_write_zero(m)
    assert pending["open_for_write"] == 0 and pending["count"] == 0, pending
    assert keys(s3_server, bucket) == ["model.safetensors"]


def test_unlinked_while_open_stays_usable_and_is_never_uploaded(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    """Item 2. POSIX: a file unlinked while open stays readable and writable
    through its descriptors until the last close, then disappears; nothing is
    uploaded. Before: close failed with EIO ('... was removed from the cache')."""
    s3_server.client().put_object(Bucket=bucket, Key="stored.txt", Body=b"stored bytes")
    m = mount_factory(f"s3://{bucket}")
    mp = m.mountpoint
    before = uploads(m)
    # write -> unlink -> close, write-back (checkpoint) and write-through (default) classes
    for name in ("wb.pt", "wt.txt"):
        fd = os.open(mp / name, os.O_CREAT | os.O_RDWR)
        try:
            os.write(fd, b"a" * (3 * MiB))
            os.unlink(mp / name)
            assert not (mp / name).exists()
            assert os.pread(fd, 4, 0) == b"aaaa"
            os.pwrite(fd, b"b", 5)
            assert os.pread(fd, 7, 0) == b"aaaaaba"
            assert os.fstat(fd).st_size == 3 * MiB
        finally:
            os.close(fd)
    # create -> unlink -> write -> close
    fd = os.open(mp / "c.pt", os.O_CREAT | os.O_EXCL | os.O_RDWR)
    try:
        os.unlink(mp / "c.pt")
        assert os.write(fd, b"written after the unlink") == 24
        assert os.pread(fd, 7, 0) == b"written"
    finally:
        os.close(fd)
    # open rw a stored object -> unlink -> read and write -> close
    fd = os.open(mp / "stored.txt", os.O_RDWR)
    try:
        os.unlink(mp / "stored.txt")
        assert os.pread(fd, 6, 0) == b"stored"
        os.pwrite(fd, b"S", 0)
        assert os.pread(fd, 6, 0) == b"Stored"
    finally:
        os.close(fd)
    # what sqlite and tempfile users do
    with tempfile.TemporaryFile(dir=mp) as f:
        f.write(b"t" * MiB)
        f.seek(0)
        assert f.read() == b"t" * MiB
    assert sorted(os.listdir(mp)) == []
    flush(m)
    assert keys(s3_server, bucket) == []
    assert uploads(m) == before
    pending = wait_open_for_write_zero(m)
    assert pending["open_for_write"] == 0 and pending["count"] == 0, pending
    assert m.status()["quarantined"]["files"] == []


def test_refused_upload_is_quarantined_and_flush_umount_fail_fast(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """Item 4. A file written with read-only credentials: the store refuses the
    upload (AccessDenied). It is not retried: it is quarantined with a note,
    status lists it, flush and umount exit non-zero naming it within seconds
    (umount with the --no-flush hint and the mount left up), and `tierfs
    pending` lists and discards it. Before: retried forever, flush and umount
    hung without a word."""
    cache = tmp_path / "cache-ro"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache, env=s3_server.readonly_env())
    data = os.urandom(3 * MiB)
    (m.mountpoint / "model.pt").write_bytes(data)  # write-back: acknowledged once journaled
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)  # hang guard
    assert res.returncode != 0 and "model.pt" in res.stderr, res
    st = m.status()
    puts = st["store"]["requests"]["put"]
    assert puts.get("retry", 0) == 0, puts  # a permanent error: not retried
    assert st["pending"]["count"] == 0
    [note] = st["quarantined"]["files"]
    assert note["key"] == "model.pt" and "access denied" in note["reason"].lower(), note
    assert note["when"] and note["size"] == len(data)
    assert (cache / "quarantine" / note["file"]).read_bytes() == data
    listed = run_tierfs("pending", "list", str(m.mountpoint), env=m.env, timeout=30)
    assert listed.returncode == 0 and "model.pt" in listed.stdout, listed
    res = run_tierfs("umount", str(m.mountpoint), env=m.env, timeout=120)  # hang guard
    assert res.returncode != 0, res
    assert "model.pt" in res.stderr and "--no-flush" in res.stderr, res.stderr
    assert is_mounted(m.mountpoint) and m.status()["pid"] == m.pid
    res = run_tierfs("pending", "discard", str(m.mountpoint), "model.pt", env=m.env, timeout=30)
    assert res.returncode == 0, res
    assert m.status()["quarantined"]["files"] == []
    assert not list((cache / "quarantine").iterdir())
    assert m.umount().returncode == 0
    assert keys(s3_server, bucket) == []


def test_key_too_long_for_the_store_is_not_retried_forever(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """Item 4. Every component fits NAME_MAX but the key exceeds the store's
    1,024 bytes (the mount is told the store takes more, so the name passes its
    own check at create): the store answers KeyTooLongError, a permanent error:
    flush names the file and fails within seconds. Before: retried forever."""
    cfg = tmp_path / "long-keys.toml"
    cfg.write_text("[store]\nmax_key_length = 4096\n")
    m = mount_factory(f"s3://{bucket}", "--config", str(cfg))
    d = m.mountpoint
    for part in ("d", "e", "f", "g"):
        d = d / (part * 250)
        os.mkdir(d)
    (d / ("x" * 40 + ".pt")).write_bytes(b"too long a key")  # write-back class
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=120)  # hang guard
    assert res.returncode != 0 and "x" * 40 + ".pt" in res.stderr, res
    puts = m.status()["store"]["requests"]["put"]
    assert puts.get("retry", 0) == 0, puts  # a permanent error: not retried
    [note] = m.status()["quarantined"]["files"]
    assert note["key"].endswith("x" * 40 + ".pt")


def write_through(tmp_path: Path) -> Path:
    """A config making the default class write-through (a per-class option)."""
    cfg = tmp_path / "through.toml"
    cfg.write_text('[classes.default]\nwrite_mode = "writethrough"\n')
    return cfg


def test_write_through_close_with_another_writer_open_is_uploaded(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """Item 5. A write-through close returns once the store has the bytes, also
    while another descriptor still has the file open for writing. Before: it
    returned success with nothing uploaded."""
    m = mount_factory(f"s3://{bucket}", "--config", str(write_through(tmp_path)))
    p = m.mountpoint / "shared.txt"  # default class, made write-through
    a = os.open(p, os.O_CREAT | os.O_WRONLY)
    b = os.open(p, os.O_WRONLY)
    try:
        os.write(a, b"first")
        os.close(a)
        assert obj(s3_server, bucket, "shared.txt") == b"first"
        os.pwrite(b, b"SECOND", 0)
    finally:
        os.close(b)
    assert obj(s3_server, bucket, "shared.txt") == b"SECOND"
    assert (m.mountpoint / "shared.txt").read_bytes() == b"SECOND"
    pending = wait_open_for_write_zero(m)
    assert pending["open_for_write"] == 0 and pending["count"] == 0, pending


def test_write_through_close_refused_by_the_store_fails_and_nothing_lands(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    """Item 5. A write-through close the store refuses (read-only credentials)
    fails with the store's errno, and the bytes are never uploaded later: flush
    succeeds (nothing acknowledged is pending) and the name is gone."""
    m = mount_factory(f"s3://{bucket}", "--config", str(write_through(tmp_path)),
                      env=s3_server.readonly_env())
    with pytest.raises(OSError) as exc:
        (m.mountpoint / "notes.txt").write_bytes(b"not allowed")  # default class
    assert exc.value.errno == errno.EACCES
    flush(m, timeout=30)
    assert "notes.txt" not in os.listdir(m.mountpoint)
    assert m.status()["pending"]["count"] == 0
    assert keys(s3_server, bucket) == []
