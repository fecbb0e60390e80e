"""The store adapter (S3Store) under the fault proxy: retries, deadline, errno mapping, metrics."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.fault.conftest import flaky_rules
from tests.fault.proxy import FaultProxy, Rule
from tests.support.seaweed import SeaweedServer
from tierfs.metrics import Metrics
from tierfs.store.base import StoreError
from tierfs.store.s3 import S3Store

MiB = 1 << 20


@pytest.fixture(scope="module")
def sbucket(s3_server: SeaweedServer) -> str:
    return s3_server.make_bucket(f"sfault-{os.getpid()}")


def make_store(proxy: FaultProxy, bucket: str, metrics: Metrics, prefix: str = "s/",
               **kw: float | str) -> S3Store:
    args: dict = {"deadline": 20.0, "connect_timeout": 1.0, "read_timeout": 2.0, "part_size": 5 * MiB}
    args.update(kw)
    return S3Store(bucket, prefix, endpoint_url=proxy.endpoint, observer=metrics.store_request, **args)


@pytest.mark.parametrize("engine", ["crt", "botocore"])
def test_flaky_store_every_op_succeeds_and_retries_are_counted(
    s3_env: dict[str, str], s3_server: SeaweedServer, proxy: FaultProxy, sbucket: str,
    tmp_path: Path, engine: str,
) -> None:
    metrics = Metrics()
    store = make_store(proxy, sbucket, metrics, f"flaky-{engine}/", engine=engine)
    data = os.urandom(24 * MiB)
    src = tmp_path / "src"
    src.write_bytes(data)
    proxy.set_rules(flaky_rules(0.2))
    for i in range(3):  # multipart (5 parts), with retries of parts, create and complete
        info = store.put_file(f"obj{i}", str(src))
        assert info.size == len(data)
    assert store.head("obj0").size == len(data)
    assert sorted(f.key for f in store.list_dir("").files) == ["obj0", "obj1", "obj2"]
    for i in range(3):
        got = bytearray()
        for off in range(0, len(data), 4 * MiB):
            got += store.get_range(f"obj{i}", off, 4 * MiB)
        assert bytes(got) == data
    small = os.urandom(1000)
    store.put_bytes("small", small)
    for _ in range(40):
        off = int.from_bytes(os.urandom(2), "little") % 900
        assert store.get_range("small", off, 50) == small[off : off + 50]
    stats = proxy.stats()
    injected = sum(v for (op, f), v in stats.items() if f in ("503", "reset", "truncate"))
    assert injected >= 10, stats
    snap = metrics.snapshot()
    retries = sum(v for k, v in snap.items() if k.startswith("tierfs_store_requests_total") and "status=retry" in k)
    # Every injected fault is one failed attempt, and every one was retried (nothing failed
    # for good). The runtime retries its requests (GETs, file uploads) itself, first:
    # tierfs counts only the faults of the requests it sends through botocore.
    if engine == "crt":
        injected = sum(v for (op, f), v in stats.items()
                       if f in ("503", "reset", "truncate") and op in ("head", "list", "put"))
        assert store.engine is not None and store.engine.moved["put"] == 3 * len(data)
    assert retries == injected, (retries, stats)
    assert not [k for k in snap if k.startswith("tierfs_store_requests_total")
                and "status=" in k and k.split("status=")[1].rstrip("}") not in ("ok", "retry")]


def test_non_retryable_errors_map_to_errnos(
    s3_env: dict[str, str], proxy: FaultProxy, sbucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = Metrics()
    store = make_store(proxy, sbucket, metrics)
    with pytest.raises(StoreError) as exc:
        store.head("missing")
    assert exc.value.errno == errno.ENOENT and exc.value.kind == "not_found"
    with pytest.raises(StoreError) as exc:
        store.get_range("missing", 0, 10)
    assert exc.value.errno == errno.ENOENT
    info = store.put_bytes("cond", b"1")
    with pytest.raises(StoreError) as exc:
        store.put_bytes("cond", b"2", if_none_match=True)
    assert exc.value.errno == errno.ESTALE and exc.value.kind == "precondition"
    with pytest.raises(StoreError) as exc:
        store.get_range("cond", 0, 1, etag="0" * 32)
    assert exc.value.errno == errno.ESTALE and exc.value.kind == "changed"
    assert store.get_range("cond", 0, 1, etag=info.etag) == b"1"
    # non-retryable errors are not retried: one request each
    assert not [k for k in metrics.snapshot() if "status=retry" in k], metrics.snapshot()
    assert proxy.stats()[("head", "total")] == 1 and proxy.stats()[("get", "total")] == 3
    # Wrong secret: EACCES at once, and the secret appears in no message.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-xyzzy")
    bad = make_store(proxy, sbucket, metrics)
    with pytest.raises(StoreError) as exc:
        bad.head("cond")
    assert exc.value.errno == errno.EACCES and exc.value.kind == "access_denied"
    assert "xyzzy" not in str(exc.value) and "tierfssecret" not in str(exc.value)
    assert "status=retry" not in " ".join(k for k in metrics.snapshot() if "op=head" in k)


@pytest.mark.parametrize("fault", ["503", "reset", "blackhole"])
def test_persistent_fault_gives_eio_within_the_deadline(
    s3_env: dict[str, str], proxy: FaultProxy, sbucket: str, fault: str
) -> None:
    metrics = Metrics()
    # read_timeout (600 s) is far longer than the deadline: the attempt is still cut at
    # the deadline, or the test would hang until its own timeout.
    store = make_store(proxy, sbucket, metrics, deadline=3.0, read_timeout=600.0)
    store.put_bytes("k", b"x" * 100)
    proxy.set_rules([Rule(fault)])  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(StoreError) as exc:
        store.get_range("k", 0, 100)
    took = time.monotonic() - t0
    assert exc.value.errno == errno.EIO
    assert took < 10 * 3.0, took  # hang guard: 10x the deadline
    snap = metrics.snapshot()
    if fault == "blackhole":  # one attempt stalls until the deadline, and is cut there
        assert snap.get("tierfs_store_requests_total{op=get,status=timeout}", 0) == 1
    else:
        assert snap.get("tierfs_store_requests_total{op=get,status=retry}", 0) >= 3
    proxy.clear()
    assert store.get_range("k", 0, 100) == b"x" * 100
