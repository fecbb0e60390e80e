"""GETs the runtime writes into an existing file itself (the patched binding,
third_party/awscrt: `recv_file_option=WRITE_TO_POSITION`), the body-piece path
a stock binding leaves, and the read-back of such a fill's checksums."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import xxhash
from awscrt import auth, http
from botocore.credentials import Credentials, RefreshableCredentials

from tests.support.marks import needs_root
from tierfs.cache.fileio import file_digests
from tierfs.store import S3Store, StoreError, crt, open_store

MiB = 1 << 20
FILL = b"\xa5"  # what the file held before a GET: bytes outside its range keep it


@pytest.fixture
def store(s3_env: dict[str, str], bucket: str) -> S3Store:
    s = open_store(f"s3://{bucket}/src", part_size=5 * MiB)
    assert isinstance(s, S3Store) and s.engine is not None
    if not s.engine.writes_files:
        pytest.skip("stock awscrt: third_party/awscrt's build fell back (see its log)")
    return s


def _file(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.pwrite(fd, FILL * size, 0)
    return fd


def test_ranges_land_at_their_object_offsets(store: S3Store, tmp_path: Path) -> None:
    """Ranged GETs (one part, several parts at once, one clipped at EOF) into one file:
    each range's first byte at its object offset, nothing written outside it."""
    data = os.urandom(13 * MiB + 7)
    store.put_bytes("obj", data)
    fd = _file(tmp_path / "t1", len(data))
    expect = bytearray(FILL * len(data))
    try:
        for start, length in ((MiB, 2 * MiB), (4 * MiB, 7 * MiB + 3), (12 * MiB, 4 * MiB)):
            got = store.get_range_to_file("obj", start, length, fd, None)
            n = min(length, len(data) - start)
            assert (got.length, got.etag) == (n, store.head("obj").etag)
            expect[start : start + n] = data[start : start + n]
            assert os.pread(fd, len(data) + 1, 0) == expect, (start, length)
    finally:
        os.close(fd)
    assert store.engine is not None and store.engine.moved["get"] == 2 * MiB + 7 * MiB + 3 + MiB + 7


def test_the_file_is_the_fds_even_once_unlinked(store: S3Store, tmp_path: Path) -> None:
    """The runtime opens the caller's file by its /proc/self/fd name: an unlinked
    tier-1 file (dropped by eviction meanwhile) still gets the bytes, and a new
    file at the old path none."""
    data = os.urandom(3 * MiB)
    store.put_bytes("obj", data)
    path = tmp_path / "t1"
    fd = _file(path, len(data))
    try:
        path.unlink()
        other = _file(path, len(data))
        os.close(other)
        store.get_range_to_file("obj", 0, len(data), fd, None)
        assert os.pread(fd, len(data), 0) == data
        assert path.read_bytes() == FILL * len(data)
    finally:
        os.close(fd)


def test_a_changed_object_writes_nothing(store: S3Store, tmp_path: Path) -> None:
    """A GET pinned to an ETag the object no longer has fails as `changed` (412),
    and none of the new version's bytes reach the file."""
    store.put_bytes("obj", os.urandom(MiB))
    old = store.head("obj").etag
    store.put_bytes("obj", os.urandom(MiB))
    fd = _file(tmp_path / "t1", MiB)
    try:
        with pytest.raises(StoreError) as ei:
            store.get_range_to_file("obj", 0, MiB, fd, old)
        assert ei.value.kind == "changed"
        assert os.pread(fd, MiB, 0) == FILL * MiB
        with pytest.raises(StoreError) as ei:
            store.get_range_to_file("missing", 0, MiB, fd, None)
        assert ei.value.kind == "not_found"
    finally:
        os.close(fd)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "tiny"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@needs_root
def test_a_full_disk_is_enospc(store: S3Store, tiny_disk: Path) -> None:
    """The runtime's failed writes come back as the OSError a pwrite would raise:
    the read path's full-cache handling (read through memory) depends on it."""
    store.put_bytes("obj", os.urandom(4 * MiB))
    fd = os.open(tiny_disk / "t1", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4 * MiB)  # sparse: the blocks are allocated as written
        with pytest.raises(OSError) as ei:
            store.get_range_to_file("obj", 0, 4 * MiB, fd, None)
        assert ei.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_the_stock_binding_passes_the_pieces_through_python(
    store: S3Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failed third_party build leaves: the body pieces are written from the
    caller's thread and shown to `on_piece`. Simulated (this venv holds the
    patched binding; a second venv per test run would cost a build)."""
    monkeypatch.setattr(crt, "_RECV_FILE", None)
    assert store.engine is not None and not store.engine.writes_files
    data = os.urandom(11 * MiB + 5)
    store.put_bytes("obj", data)
    fd = _file(tmp_path / "t1", len(data))
    pieces: list[tuple[int, int]] = []
    try:
        got = store.get_range_to_file("obj", MiB, len(data), fd, None,
                                      lambda off, piece: pieces.append((off, len(piece))))
        assert got.length == len(data) - MiB
        assert os.pread(fd, len(data), 0) == FILL * MiB + data[MiB:]
    finally:
        os.close(fd)
    assert pieces[0][0] == MiB and sum(n for _, n in pieces) == len(data) - MiB


def test_runtime_part_size_fits_its_buffer_pool() -> None:
    """The runtime reuses part buffers only where 16 parts fit in its memory limit
    less 128 MiB: the client's part size shrinks to fit, whole MiB, 1 MiB at least."""
    assert crt.pool_part_size(16 * MiB, 256 * MiB) == 8 * MiB
    assert crt.pool_part_size(16 * MiB, 1 << 30) == 16 * MiB
    assert crt.pool_part_size(5 * MiB, 256 * MiB) == 5 * MiB
    assert crt.pool_part_size(16 * MiB, 300 * MiB) == 10 * MiB
    assert crt.pool_part_size(64 * MiB, 130 * MiB) == MiB


@pytest.mark.parametrize("chunk", [64, 1000, 4096, MiB, 3 * MiB])
def test_fill_digests_read_back_match_the_bytes(tmp_path: Path, chunk: int) -> None:
    """The checksums a fill's commit reads back (mapped, not pread) are each chunk's
    xxh3-64, whatever the chunk size and start; a file shorter than the fill fails."""
    data = os.urandom(3 * MiB + 17)
    fd = os.open(tmp_path / "t1", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        for start in (0, 2 * chunk):
            assert list(file_digests(fd, start, len(data), chunk)) == [
                xxhash.xxh3_64_digest(data[a : a + chunk]) for a in range(start, len(data), chunk)
            ]
        with pytest.raises(OSError) as ei:
            list(file_digests(fd, 0, len(data) + 1, chunk))
        assert ei.value.errno == errno.EIO
    finally:
        os.close(fd)


def _signed_with(provider: auth.AwsCredentialsProvider) -> str:
    """The Authorization header of a request the runtime signs with `provider`."""
    config = auth.AwsSigningConfig(algorithm=auth.AwsSigningAlgorithm.V4,
                                   signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
                                   credentials_provider=provider, region="us-east-1",
                                   service="s3")
    request = http.HttpRequest("GET", "/b/k", http.HttpHeaders([("Host", "127.0.0.1")]))
    return auth.aws_sign_request(request, config).result(10).headers.get("Authorization")


def test_fixed_keys_are_given_to_the_runtime_once_refreshable_ones_asked_per_request() -> None:
    """Fixed keys need no call into Python as each request is signed (a runtime
    thread waiting for the GIL); keys that expire are asked for every time."""
    asked: list[int] = []

    def frozen() -> auth.AwsCredentials:
        asked.append(1)
        return auth.AwsCredentials("AKIDROTATED", "secret2")

    fixed = crt._provider(Credentials("AKIDFIXED", "secret"), frozen)
    assert "Credential=AKIDFIXED/" in _signed_with(fixed)
    assert asked == []
    refreshing = RefreshableCredentials("AKIDOLD", "secret", None, datetime.now(UTC),
                                        lambda: {}, "test")
    assert "Credential=AKIDROTATED/" in _signed_with(crt._provider(refreshing, frozen))
    assert asked == [1]
