"""S3 adapter against a real SeaweedFS server (through the fault proxy for retries)."""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.support.seaweed import SeaweedServer
from tierfs.store import Listing, S3Store, StoreError, open_store, parse_source
from tierfs.store.base import Received, part_size_for

MiB = 1 << 20


class Recorder:
    """A RequestObserver that keeps every report."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, int]] = []
        self._lock = threading.Lock()

    def __call__(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.events.append((op, outcome, seconds, nbytes))

    def outcomes(self, op: str) -> list[str]:
        return [e[1] for e in self.events if e[0] == op]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def store(s3_env: dict[str, str], bucket: str, recorder: Recorder) -> S3Store:
    s = open_store(f"s3://{bucket}/src", part_size=5 * MiB, observer=recorder)
    assert isinstance(s, S3Store)
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- parse_source / open_store ---------------------------------------------------


def test_parse_source_forms() -> None:
    assert parse_source("s3://my-bucket") == ("s3", "my-bucket", "")
    assert parse_source("s3://my-bucket/") == ("s3", "my-bucket", "")
    assert parse_source("s3://my-bucket/a/b/") == ("s3", "my-bucket", "a/b/")
    assert parse_source("S3://my.bucket/a") == ("s3", "my.bucket", "a/")
    assert parse_source("file:///data/x/") == ("file", "/data/x", "")
    assert parse_source("file://localhost/data") == ("file", "/data", "")


@pytest.mark.parametrize(
    "url",
    ["foo", "s3://", "http://bucket/x", "file://relative/path", "file:/x", "s3:/bucket"],
)
def test_parse_source_malformed(url: str) -> None:
    with pytest.raises(StoreError) as ei:
        parse_source(url)
    assert ei.value.kind == "invalid" and ei.value.errno == errno.EINVAL
    assert "expected s3://bucket[/prefix] or file:///path" in str(ei.value)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "name", ["ab", "x" * 64, "Upper", "under_score", "-dash", "dot.", "a..b", "192.168.1.1"]
)
def test_bucket_name_rules(name: str) -> None:
    with pytest.raises(StoreError, match=f"invalid bucket name '{name}'") as ei:
        parse_source(f"s3://{name}/p")
    assert ei.value.kind == "invalid"


# -- check() -----------------------------------------------------------------------


def test_check_ok(store: S3Store) -> None:
    store.check()
    assert store.identity == f"s3|{store.endpoint}|{store.bucket}|src/"
    assert store.url == f"s3://{store.bucket}/src/"


def test_check_missing_bucket(s3_env: dict[str, str], s3_server: SeaweedServer) -> None:
    with pytest.raises(StoreError) as ei:
        open_store("s3://no-such-bucket-here").check()
    assert ei.value.kind == "no_bucket" and ei.value.errno == errno.ENOENT
    assert str(ei.value) == f"bucket 'no-such-bucket-here' does not exist at {s3_server.endpoint}"


def test_check_wrong_credentials(
    s3_env: dict[str, str], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(StoreError) as ei:
        open_store(f"s3://{bucket}").check()
    assert ei.value.kind == "access_denied" and ei.value.errno == errno.EACCES
    assert str(ei.value) == (
        f"access denied to bucket '{bucket}': check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    )
    assert "wrong-secret-value" not in str(ei.value)


def test_check_unreachable_fails_fast(s3_env: dict[str, str]) -> None:
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        open_store("s3://bucket", endpoint_url=f"http://127.0.0.1:{port}", deadline=1.0).check()
    assert time.monotonic() - t0 < 10 * 1.0  # hang guard: 10x the deadline
    assert ei.value.kind == "unreachable" and ei.value.errno == errno.EIO
    assert str(ei.value) == f"cannot reach http://127.0.0.1:{port}: connection refused"


# -- reads -------------------------------------------------------------------------


def test_head_and_list_nested_under_source_prefix(
    store: S3Store, s3_server: SeaweedServer, bucket: str
) -> None:
    c = s3_server.client()
    for key in ["src/a.txt", "src/d/", "src/d/b", "src/d/e/c", "other/x", "srcx/y", "src"]:
        c.put_object(Bucket=bucket, Key=key, Body=b"data", Metadata={"k": "v"})

    top = store.list_dir("")
    assert [f.key for f in top.files] == ["a.txt"] and top.dirs == ["d"]
    d = store.list_dir("d/")
    assert [f.key for f in d.files] == ["d/b"] and d.dirs == ["e"]  # marker "d/" excluded
    assert store.list_dir("d/e/").files[0].key == "d/e/c"
    assert store.list_dir("missing/") == Listing([], [])  # empty, no error

    info = store.head("d/b")
    raw = c.head_object(Bucket=bucket, Key="src/d/b")
    assert info.size == 4 and info.etag == raw["ETag"].strip('"')
    assert info.mtime == raw["LastModified"].timestamp()
    assert info.metadata == {"k": "v"}
    assert d.files[0].etag == info.etag

    with pytest.raises(StoreError) as ei:
        store.head("nope")
    assert ei.value.kind == "not_found" and ei.value.errno == errno.ENOENT
    with pytest.raises(StoreError, match="must end with '/'"):
        store.list_dir("d")


def test_list_all_pages(store: S3Store) -> None:
    names = [f"many/{i:05d}" for i in range(1005)]  # the server pages at 1000 keys
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put_bytes(k, b""), names))
    listing = store.list_dir("many/")
    assert sorted(f.key for f in listing.files) == names


def test_get_range_clipping_and_changes(store: S3Store, recorder: Recorder) -> None:
    data = bytes(range(256)) * 40
    info = store.put_bytes("obj", data)
    assert store.get_range("obj", 0, len(data)) == data
    assert store.get_range("obj", 100, 50) == data[100:150]
    assert store.get_range("obj", len(data) - 10, 100) == data[-10:]  # clipped at EOF
    assert store.get_range("obj", len(data) + 5, 10) == b""  # past EOF
    assert store.get_range("obj", 3, 0) == b""
    assert store.get_range("obj", 0, 1 << 40) == data  # buffer sized by the response
    assert store.get_range("obj", 0, 10, etag=info.etag) == data[:10]

    buf = bytearray(64)
    assert store.get_range_into("obj", 10, 64, memoryview(buf), info.etag).length == 64
    assert bytes(buf) == data[10:74]

    store.put_bytes("empty", b"")
    assert store.get_range("empty", 0, 4096) == b""

    store.put_bytes("obj", b"new contents")
    with pytest.raises(StoreError) as ei:
        store.get_range("obj", 0, 10, etag=info.etag)
    assert ei.value.kind == "changed" and ei.value.errno == errno.ESTALE
    with pytest.raises(StoreError) as ei:
        store.get_range("gone", 0, 10)
    assert ei.value.kind == "not_found" and ei.value.errno == errno.ENOENT
    assert recorder.outcomes("get")[:3] == ["ok", "ok", "ok"]
    assert ("get", "not_found") in [e[:2] for e in recorder.events]


# -- writes ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["crt", "botocore"])
def test_put_file_single_and_multipart(
    engine: str, s3_env: dict[str, str], s3_server: SeaweedServer, bucket: str, tmp_path: Path,
    recorder: Recorder,
) -> None:
    store = open_store(f"s3://{bucket}/src", part_size=5 * MiB, observer=recorder, engine=engine)
    c = s3_server.client()
    small = tmp_path / "small"
    small.write_bytes(os.urandom(1000))
    info = store.put_file("s/small", str(small), metadata={"Class": "checkpoint"})
    assert c.get_object(Bucket=bucket, Key="src/s/small")["Body"].read() == small.read_bytes()
    assert info.size == 1000 and info.etag == store.head("s/small").etag
    assert store.head("s/small").metadata == {"class": "checkpoint"}
    assert "multipart" not in {e[0] for e in recorder.events}

    big = tmp_path / "big"
    big.write_bytes(os.urandom(20 * MiB + 123))
    sent: list[int] = []
    info = store.put_file("s/big", str(big), metadata={"a": "1"}, progress=sent.append)
    body = c.get_object(Bucket=bucket, Key="src/s/big")["Body"].read()
    assert body == big.read_bytes()
    assert sum(sent) == info.size == big.stat().st_size
    assert info.etag == store.head("s/big").etag and info.etag.endswith("-5")
    assert store.head("s/big").metadata == {"a": "1"}
    assert not c.list_multipart_uploads(Bucket=bucket).get("Uploads")
    head = c.head_object(Bucket=bucket, Key="src/s/big", ChecksumMode="ENABLED")
    if engine == "crt":
        # One request as far as tierfs sees it; the store checked a CRC32C per part.
        assert recorder.outcomes("put") == ["ok", "ok"] and not recorder.outcomes("multipart")
        assert head["ChecksumCRC32C"].endswith("-5")
    else:
        assert len(sent) == 5
        assert recorder.outcomes("multipart").count("ok") == 7  # create + 5 parts + complete
        assert "ChecksumCRC32C" not in head


def test_uploads_do_not_hash_the_payload(boto3_store: S3Store, tmp_path: Path) -> None:
    """SigV4 over plain http would SHA-256 every uploaded byte; botocore's uploads opt
    out (UNSIGNED-PAYLOAD), and the real server accepts it."""
    store = boto3_store
    seen: list[str] = []

    def grab(request: object, **_: object) -> None:
        seen.append(request.headers.get("x-amz-content-sha256", b"").decode())  # type: ignore[attr-defined]

    store._client.meta.events.register("before-send.s3.UploadPart", grab)
    store._client.meta.events.register("before-send.s3.PutObject", grab)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(11 * MiB))
    store.put_file("s/unsigned", str(big))
    store.put_bytes("s/unsigned-small", b"x" * 100)
    assert seen == ["UNSIGNED-PAYLOAD"] * 4  # three parts, one small PUT
    assert store.head("s/unsigned").size == 11 * MiB


def test_part_size_grows_to_fit_10000_parts() -> None:
    assert part_size_for(20 * MiB, 1 * MiB) == 5 * MiB  # S3's minimum part
    assert part_size_for(50 << 30, 8 * MiB) == 8 * MiB
    part = part_size_for(100 << 30, 8 * MiB)
    assert part % MiB == 0 and -(-(100 << 30) // part) <= 10_000 and part < 12 * MiB


def test_conditional_puts(
    store: S3Store, tmp_path: Path, s3_server: SeaweedServer, bucket: str
) -> None:
    assert store.probe_conditional_put() is True
    assert store.supports_conditional_put is True

    first = store.put_bytes("latest", b"step-1", if_none_match=True)
    with pytest.raises(StoreError) as ei:
        store.put_bytes("latest", b"step-x", if_none_match=True)
    assert ei.value.kind == "precondition" and ei.value.errno == errno.ESTALE
    second = store.put_bytes("latest", b"step-2", if_match=first.etag)
    with pytest.raises(StoreError) as ei:
        store.put_bytes("latest", b"step-3", if_match=first.etag)  # stale ETag loses
    assert ei.value.kind == "precondition"
    assert store.get_range("latest", 0, 100) == b"step-2"

    # SeaweedFS honours the conditions on CompleteMultipartUpload too.
    big = tmp_path / "big"
    big.write_bytes(os.urandom(11 * MiB))
    with pytest.raises(StoreError) as ei:
        store.put_file("latest", str(big), if_match="0" * 32)
    assert ei.value.kind == "precondition"
    with pytest.raises(StoreError):
        store.put_file("latest", str(big), if_none_match=True)
    info = store.put_file("latest", str(big), if_match=second.etag)
    assert store.head("latest").etag == info.etag
    assert not s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert [f.key for f in store.list_dir("").files] == ["latest"]  # probe key cleaned up


def test_copy_delete_and_metadata(store: S3Store) -> None:
    src = store.put_bytes("m/src", b"x" * 100, metadata={"owner": "me"})
    out = store.copy("m/src", "m/dst")
    assert out.size == 100 and out.metadata == {"owner": "me"}
    assert store.head("m/dst").metadata == {"owner": "me"}
    assert store.get_range("m/dst", 0, 200) == b"x" * 100
    assert src.etag == out.etag

    # Multipart copy (UploadPartCopy) with the threshold lowered from 5 GiB.
    data = os.urandom(12 * MiB)
    store.put_bytes("m/big", data, metadata={"k": "v"})
    store.multipart_copy_threshold = 8 * MiB
    store.copy_part_size = 5 * MiB
    out = store.copy("m/big", "m/big2")
    assert out.etag.endswith("-3") and out.size == len(data)
    assert store.get_range("m/big2", 0, len(data)) == data
    assert store.head("m/big2").metadata == {"k": "v"}

    store.delete("m/dst")
    store.delete("m/dst")  # missing: not an error
    with pytest.raises(StoreError) as ei:
        store.head("m/dst")
    assert ei.value.kind == "not_found"
    with pytest.raises(StoreError) as ei:
        store.copy("m/nope", "m/x")
    assert ei.value.kind == "not_found"


def test_odd_keys_do_not_crash(store: S3Store) -> None:
    odd = ["a//b", "x/./y", "./x", "line\nbreak", "n/" + "z" * 300, "q/" + "é" * 130, "o", "o/p"]
    accepted = []
    for key in odd:
        try:
            store.put_bytes(key, b"1")
            accepted.append(key)
        except StoreError as exc:  # SeaweedFS refuses some of these; that must map cleanly
            assert exc.kind == "invalid" and exc.errno in (errno.EINVAL, errno.ENAMETOOLONG)
    assert "line\nbreak" in accepted and "o" in accepted

    seen: list[str] = []

    def walk(prefix: str, depth: int) -> None:
        listing = store.list_dir(prefix)
        seen.extend(f.key for f in listing.files)
        for d in listing.dirs:
            if depth < 5:
                walk(prefix + d + "/", depth + 1)

    walk("", 0)
    assert "line\nbreak" in seen and "o" in seen and "o/p" in seen


# -- retries -------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_server.endpoint, seed=3) as p:
        yield p


@pytest.fixture
def via_proxy(s3_env: dict[str, str], bucket: str, proxy: FaultProxy, s3_server: SeaweedServer):
    """(object key, its body, a store factory) for a 100-byte object reached through the proxy."""
    body = bytes(range(100))
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=body)

    def make(**kw: object) -> S3Store:
        s = open_store(f"s3://{bucket}", endpoint_url=proxy.endpoint, **kw)  # type: ignore[arg-type]
        assert isinstance(s, S3Store)
        return s

    return "k", body, make


@pytest.mark.parametrize("engine", ["crt", "botocore"])
def test_throttling_retries_until_deadline(
    engine: str, via_proxy, proxy: FaultProxy, recorder: Recorder
) -> None:
    key, _, make = via_proxy
    store = make(deadline=2.0, observer=recorder, engine=engine)
    proxy.set_rules([Rule("503", ops={"get"})])
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        store.get_range(key, 0, 10)
    assert time.monotonic() - t0 < 10 * 2.0  # hang guard: 10x the deadline
    assert ei.value.kind == "throttled" and ei.value.errno == errno.EIO
    assert "HTTP 503 SlowDown" in str(ei.value) and "gave up after" in str(ei.value)
    # not before the deadline: the retry loop's own clock, as its message reports it
    gave_up = re.search(r"gave up after \d+ attempts in ([0-9.]+)s", str(ei.value))
    assert gave_up is not None and float(gave_up.group(1)) >= 2.0, str(ei.value)
    outcomes = recorder.outcomes("get")
    assert outcomes[-1] == "throttled" and outcomes.count("retry") >= 3
    # The runtime tries each request 3 times (crt._RETRIES) before tierfs sees it fail.
    tries = 3 if engine == "crt" else 1
    assert proxy.stats()[("get", "503")] == tries * len(outcomes)


def test_truncated_body_is_resumed(via_proxy, proxy: FaultProxy, recorder: Recorder) -> None:
    key, body, make = via_proxy
    store = make(observer=recorder, engine="botocore")
    proxy.set_rules([Rule("503", ops={"get"}, count=1), Rule("truncate", ops={"get"}, count=1)])
    assert store.get_range(key, 10, 40) == body[10:50]
    # The retry after the cut asks only for what is still missing.
    gets = [e for e in proxy.log if e.op == "get"]
    assert [e.fault for e in gets] == ["503", "truncate", "none"]
    assert [e.range for e in gets] == ["bytes=10-49", "bytes=10-49", "bytes=30-49"]
    assert recorder.outcomes("get") == ["retry", "retry", "ok"]


def test_truncated_body_is_retried_by_the_runtime(
    via_proxy, proxy: FaultProxy, recorder: Recorder
) -> None:
    """The runtime retries a failed or cut part itself (the whole part again):
    tierfs sees one request that succeeded."""
    key, body, make = via_proxy
    store = make(observer=recorder)
    proxy.set_rules([Rule("503", ops={"get"}, count=1), Rule("truncate", ops={"get"}, count=1)])
    assert store.get_range(key, 10, 40) == body[10:50]
    gets = [e for e in proxy.log if e.op == "get"]
    assert [e.fault for e in gets] == ["503", "truncate", "none"]
    assert {e.range for e in gets} == {"bytes=10-49"}
    assert recorder.outcomes("get") == ["ok"]


# -- the transfer engine (the AWS Common Runtime) against botocore's GETs ----------


@pytest.fixture
def boto3_store(s3_env: dict[str, str], bucket: str) -> S3Store:
    """The same source as `store`, through the fallback engine (botocore)."""
    s = open_store(f"s3://{bucket}/src", part_size=5 * MiB, observer=Recorder(), engine="botocore")
    assert isinstance(s, S3Store) and s.engine is None
    return s


def _failure(s: S3Store, key: str, start: int, length: int, etag: str | None = None) -> tuple:
    with pytest.raises(StoreError) as ei:
        s.get_range(key, start, length, etag=etag)
    e = ei.value
    return e.kind, e.errno, str(e).split(" (gave up")[0]


ODD_KEYS = [
    "a b", "plus+sign", "pct%41%", "q?x=1&y=2", "hash#frag", "é/ü ñ/日本語", "tilde~",
    "star*(p)'!", "semi;colon,comma", "dollar$at@", "brackets[]{}", " lead and trail ",
    "dir/ /x", "back\\slash", 'quo"te', "pipe|caret^`", "a//b", "line\nbreak", "tab\tx",
]


def test_engine_get_reads_odd_keys_byte_identical(store: S3Store, boto3_store: S3Store) -> None:
    assert store.engine is not None
    accepted = []
    for key in ODD_KEYS:
        data = os.urandom(3000) + key.encode()
        try:
            store.put_bytes(key, data)
        except StoreError as exc:  # SeaweedFS refuses a few names; that must map cleanly
            assert exc.kind == "invalid", (key, exc)
            continue
        accepted.append(key)
        buf = bytearray(len(data))
        assert store.get_range_into(key, 0, len(data), memoryview(buf)).length == len(data)
        assert bytes(buf) == data, key
        part = bytearray(100)
        assert store.get_range_into(key, 7, 100, memoryview(part)).length == 100
        assert bytes(part) == data[7:107]
        assert boto3_store.get_range(key, 0, len(data)) == data
    assert len(accepted) >= len(ODD_KEYS) - 3, accepted
    assert store.engine.moved["get"] == sum(3100 + len(k.encode()) for k in accepted)


def test_engine_errors_are_classified_as_botocores(
    store: S3Store, boto3_store: S3Store, recorder: Recorder, s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each kind, produced by the real server, maps the same through either engine."""
    info = store.put_bytes("obj", b"x" * 100)
    missing = _failure(store, "missing", 0, 10)
    assert missing == _failure(boto3_store, "missing", 0, 10)
    assert missing[:2] == ("not_found", errno.ENOENT) and "NoSuchKey" not in missing[2]
    stale = _failure(store, "obj", 0, 10, etag="0" * 32)  # If-Match a wrong ETag: 412
    assert stale == _failure(boto3_store, "obj", 0, 10, etag="0" * 32)
    assert stale[:2] == ("changed", errno.ESTALE)
    assert store.get_range("obj", 0, 10, etag=info.etag) == b"x" * 10
    assert recorder.outcomes("get") == ["not_found", "changed", "ok"]

    nobucket = open_store("s3://no-such-bucket-tierfs")
    plain = open_store("s3://no-such-bucket-tierfs", engine="botocore")
    assert _failure(nobucket, "k", 0, 1) == _failure(plain, "k", 0, 1)
    assert _failure(nobucket, "k", 0, 1)[:2] == ("no_bucket", errno.ENOENT)

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-xyzzy")
    bad = open_store(store.url)
    badplain = open_store(store.url, engine="botocore")
    denied = _failure(bad, "obj", 0, 10)
    assert denied == _failure(badplain, "obj", 0, 10)
    assert denied[:2] == ("access_denied", errno.EACCES) and "xyzzy" not in denied[2]
    with pytest.raises(StoreError) as ei:
        bad.put_file("up", __file__)
    assert ei.value.kind == "access_denied" and ei.value.errno == errno.EACCES


def test_engine_invalid_and_precondition_uploads(store: S3Store, tmp_path: Path) -> None:
    """A refused upload through the runtime: 412 on a failed condition (the runtime
    passes it to CompleteMultipartUpload), 400 KeyTooLong-like refusals as invalid."""
    big = tmp_path / "big"
    big.write_bytes(os.urandom(11 * MiB))
    first = store.put_file("cond", str(big), if_none_match=True)
    with pytest.raises(StoreError) as ei:
        store.put_file("cond", str(big), if_none_match=True)
    assert (ei.value.kind, ei.value.errno) == ("precondition", errno.ESTALE)
    with pytest.raises(StoreError) as ei:
        store.put_file("cond", str(big), if_match="0" * 32)
    assert ei.value.kind == "precondition"
    assert store.put_file("cond", str(big), if_match=first.etag).etag != ""
    with pytest.raises(StoreError) as ei:
        store.put_file("x" * 1100, str(big))
    assert ei.value.kind == "invalid"


def test_engine_get_returns_the_responses_metadata(store: S3Store, boto3_store: S3Store) -> None:
    """A GET returns what its answer said of the object (ETag, user metadata): the
    runtime's GETs and botocore's alike."""
    meta = {"Class": "checkpoint", "owner": "Me", "x-y": "1"}
    info = store.put_bytes("m", b"abc" * 100, metadata=meta)
    plain = store.put_bytes("plain", b"abc")
    for s in (store, boto3_store):
        buf = memoryview(bytearray(10))
        got = s.get_range_into("m", 5, 10, buf)
        assert bytes(buf) == (b"abc" * 100)[5:15]
        assert got == Received(10, info.etag, {"class": "checkpoint", "owner": "Me", "x-y": "1"})
        assert s.get_range_into("plain", 0, 10, buf) == Received(3, plain.etag, None)


def test_engine_get_past_eof_and_empty(
    store: S3Store, boto3_store: S3Store, recorder: Recorder
) -> None:
    data = os.urandom(1000)
    store.put_bytes("obj", data)
    store.put_bytes("empty", b"")
    for s in (store, boto3_store):
        assert s.get_range("obj", 1000, 10) == b""  # starts at EOF: 416
        assert s.get_range("obj", 5000, 10) == b""
        assert s.get_range("obj", 990, 100) == data[990:]  # clipped at EOF
        assert s.get_range("empty", 0, 4096) == b""
        buf = bytearray(10)
        assert s.get_range_into("obj", 2000, 10, memoryview(buf)).length == 0
    assert recorder.outcomes("get") == ["ok"] * 5


def test_engine_get_spans_parts(store: S3Store) -> None:
    """A range over several parts: the runtime sends them at once, the body pieces
    land in order at their offsets."""
    data = os.urandom(13 * MiB + 7)
    store.put_bytes("multi", data)
    assert store.get_range("multi", 3, len(data)) == data[3:]
    buf = bytearray(12 * MiB)
    assert store.get_range_into("multi", MiB + 1, 12 * MiB, memoryview(buf)).length == 12 * MiB
    assert bytes(buf) == data[MiB + 1 : 13 * MiB + 1]


def test_engine_unreachable_as_botocore(s3_env: dict[str, str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    crt = S3Store("bkt", endpoint_url=url, deadline=2.0, connect_timeout=0.2)
    plain = S3Store("bkt", endpoint_url=url, deadline=2.0, connect_timeout=0.2, engine="botocore")
    failure = _failure(crt, "k", 0, 1)
    assert failure == _failure(plain, "k", 0, 1)
    assert failure[:2] == ("unreachable", errno.EIO) and "connection refused" in failure[2]


def test_engine_is_thread_safe(store: S3Store) -> None:
    data = os.urandom(300_000)
    store.put_bytes("big", data)

    def one(i: int) -> bool:
        off = (i * 7919) % len(data)
        return store.get_range("big", off, 65536) == data[off : off + 65536]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(200)))


def test_unknown_engine_is_a_clear_error(s3_env: dict[str, str]) -> None:
    with pytest.raises(StoreError) as ei:
        open_store("s3://bkt", engine="curl")
    assert ei.value.kind == "invalid" and "expected one of crt, botocore" in str(ei.value)


@pytest.mark.parametrize("name, kind, retry", [
    ("AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE", "timeout", True),  # a stalled part
    ("AWS_ERROR_HTTP_CONNECTION_CLOSED", "io", True),
    ("AWS_IO_SOCKET_CONNECTION_REFUSED", "unreachable", True),
    ("AWS_ERROR_S3_FILE_MODIFIED", "io", False),
])
def test_runtime_transport_failures_classified(name: str, kind: str, retry: bool) -> None:
    """The runtime's own error names (a stall below its minimum throughput is one
    the fault proxy's held parts produce) map onto the kinds retries act on: a
    stalled upload is retried to the deadline, not an EIO at close."""
    import awscrt.exceptions

    from tierfs.store.s3errors import classify

    f = classify(awscrt.exceptions.AwsCrtError(0, name, "x"), "b", "http://127.0.0.1:1")
    assert f is not None and (f.kind, f.retryable) == (kind, retry)


@pytest.mark.parametrize("value", [
    "2026-12-07T03:18:55.123Z", "2026-12-07T03:18:55Z", "2026-12-07T03:18:55+02:00",
    "Mon, 07 Dec 2026 03:18:55 GMT", "1796614294", "2026-12-07T03:18:55",
])
def test_timestamps_read_as_botocores_own_parser_reads_them(value: str) -> None:
    """The listing's and the headers' timestamps without dateutil (s3client.timestamp):
    the same instants as botocore's default parser, whatever the form."""
    from botocore.utils import parse_timestamp

    from tierfs.store.s3client import timestamp

    assert timestamp(value).timestamp() == parse_timestamp(value).timestamp()


def test_listing_and_head_agree_on_mtime(store: S3Store) -> None:
    store.put_bytes("d/a", b"x")
    (listed,) = store.list_dir("d/").files
    assert listed.mtime == store.head("d/a").mtime > 0
