"""FaultProxy against a real SeaweedFS: clean relay, each fault, determinism."""

from __future__ import annotations

import contextlib
import http.client
import io
import itertools
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from tests.fault.proxy import FaultProxy, LogEntry, Rule, classify
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer

MiB = 1 << 20
_prefixes = itertools.count()


def s3_client(endpoint: str, **config: Any) -> Any:
    """A boto3 S3 client for `endpoint` that never retries."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1},
            max_pool_connections=40,
            **config,
        ),
    )


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedServer) -> str:
    """One bucket for this module: each SeaweedFS bucket costs volumes, and they run out."""
    return s3_server.make_bucket(f"fault-{os.getpid()}")


@pytest.fixture
def pre() -> str:
    """A key prefix of this test's own."""
    return f"p{next(_prefixes)}/"


@pytest.fixture
def proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_server.endpoint, seed=0) as p:
        yield p


@pytest.fixture
def client(proxy: FaultProxy) -> Any:
    return s3_client(proxy.endpoint)


def _faults(proxy: FaultProxy) -> list[str]:
    return [entry.fault for entry in proxy.log]


def test_classify() -> None:
    h: dict[str, str] = {}
    assert classify("GET", "/b/k", h) == "get"
    assert classify("GET", "/b/dir/k?versionId=1", h) == "get"
    assert classify("GET", "/b?list-type=2&prefix=a", h) == "list"
    assert classify("GET", "/b", h) == "list"
    assert classify("GET", "/", h) == "list"
    assert classify("HEAD", "/b/k", h) == "head"
    assert classify("PUT", "/b/k", h) == "put"
    assert classify("PUT", "/b/k", {"x-amz-copy-source": "/b/j"}) == "copy"
    assert classify("POST", "/b/k?uploads", h) == "multipart"
    assert classify("PUT", "/b/k?partNumber=1&uploadId=x", h) == "multipart"
    assert classify("POST", "/b/k?uploadId=x", h) == "multipart"
    assert classify("DELETE", "/b/k?uploadId=x", h) == "multipart"
    assert classify("DELETE", "/b/k", h) == "delete"
    assert classify("POST", "/b?delete", h) == "delete"
    assert classify("PUT", "/b", h) == "other"
    with pytest.raises(ValueError):
        Rule("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Rule("503", ops={"gett"})


def test_passthrough(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    data = os.urandom(3 * MiB + 17)
    client.put_object(Bucket=bucket, Key=f"{pre}a/bytes", Body=data)
    client.put_object(
        Bucket=bucket, Key=f"{pre}a/file", Body=io.BytesIO(data)
    )  # Expect: 100-continue
    assert client.get_object(Bucket=bucket, Key=f"{pre}a/bytes")["Body"].read() == data
    ranged = client.get_object(Bucket=bucket, Key=f"{pre}a/file", Range="bytes=1000-1999")
    assert ranged["Body"].read() == data[1000:2000]
    assert client.head_object(Bucket=bucket, Key=f"{pre}a/file")["ContentLength"] == len(data)
    client.copy_object(
        Bucket=bucket, Key=f"{pre}a/copy", CopySource={"Bucket": bucket, "Key": f"{pre}a/file"}
    )
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{pre}a/")
    assert [o["Key"] for o in listed["Contents"]] == [
        f"{pre}a/{n}" for n in ("bytes", "copy", "file")
    ]
    client.delete_object(Bucket=bucket, Key=f"{pre}a/copy")
    stats = proxy.stats()
    for op, n in [("put", 2), ("get", 2), ("head", 1), ("copy", 1), ("list", 1), ("delete", 1)]:
        assert stats[(op, "total")] == n == stats[(op, "none")], op
    assert proxy.log[0] == LogEntry("put", "PUT", f"/{bucket}/{pre}a/bytes", "none")


def test_multipart_20mib(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    data = os.urandom(20 * MiB)
    cfg = TransferConfig(
        multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4
    )
    client.upload_fileobj(io.BytesIO(data), bucket, f"{pre}big", Config=cfg)
    out = io.BytesIO()
    client.download_fileobj(bucket, f"{pre}big", out, Config=cfg)
    assert out.getvalue() == data
    stats = proxy.stats()
    assert stats[("multipart", "total")] == 6  # create, 4 parts, complete
    assert stats[("multipart", "none")] == 6


def test_concurrent_connections(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    blobs = {f"{pre}k{i}": os.urandom(64 * 1024 + i) for i in range(40)}
    with ThreadPoolExecutor(40) as pool:
        list(
            pool.map(
                lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), blobs.items()
            )
        )

        def fetch(key: str) -> bytes:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()

        for _ in range(3):
            assert list(pool.map(fetch, blobs)) == list(blobs.values())
    assert proxy.stats()[("get", "none")] == 120


def test_chunked_request_body(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    data = os.urandom(2 * MiB + 5)
    url = urlsplit(
        client.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": f"{pre}c"})
    )
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    pieces = [data[: MiB - 3], data[MiB - 3 : MiB], data[MiB:]]
    conn.request("PUT", f"{url.path}?{url.query}", body=iter(pieces), encode_chunked=True)
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    conn.close()
    assert client.get_object(Bucket=bucket, Key=f"{pre}c")["Body"].read() == data


class _FramingHandler(BaseHTTPRequestHandler):
    """Answers /chunked with a chunked body, anything else with a close-delimited one.

    Idle keep-alive connections are closed after `timeout` seconds.
    """

    protocol_version = "HTTP/1.1"
    timeout = 0.3
    payload = os.urandom(300_000)

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(self.payload), 70_000):
                piece = self.payload[i : i + 70_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(self.payload)
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def test_response_framings() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FramingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as proxy:
            port = int(proxy.endpoint.rsplit(":", 1)[1])
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            for pause in (0, 0, 0.6):  # one keep-alive connection; upstream's goes idle, closes
                time.sleep(pause)
                conn.request("GET", "/chunked")
                assert conn.getresponse().read() == _FramingHandler.payload
            conn.request("GET", "/eof")
            assert conn.getresponse().read() == _FramingHandler.payload
            conn.close()
            proxy.set_rules([Rule("truncate")])
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/chunked")
            with pytest.raises(http.client.IncompleteRead):
                conn.getresponse().read()
            conn.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("fault", "code"), [("503", "SlowDown"), ("500", "InternalError"), ("403", "AccessDenied")])
def test_error_faults(
    proxy: FaultProxy, client: Any, bucket: str, pre: str, fault: str, code: str
) -> None:
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"x" * 1000)
    proxy.set_rules([Rule(fault, ops={"get", "put", "head"})])  # type: ignore[arg-type]
    with pytest.raises(ClientError) as err:
        client.get_object(Bucket=bucket, Key=f"{pre}k")
    assert err.value.response["Error"]["Code"] == code
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == int(fault)
    with pytest.raises(ClientError) as err:  # Expect: 100-continue, body never sent
        client.put_object(Bucket=bucket, Key=f"{pre}k", Body=io.BytesIO(os.urandom(MiB)))
    assert err.value.response["Error"]["Code"] == code
    with pytest.raises(ClientError) as err:
        client.head_object(Bucket=bucket, Key=f"{pre}k")
    assert err.value.response["Error"]["Code"] == fault
    assert client.list_objects_v2(Bucket=bucket, Prefix=pre)["KeyCount"] == 1  # not matched
    proxy.clear()
    assert client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == b"x" * 1000
    stats = proxy.stats()
    assert [stats[(op, fault)] for op in ("get", "put", "head", "list")] == [1, 1, 1, 0]


def test_count_and_path(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    for name in ("hot", "cold"):
        client.put_object(Bucket=bucket, Key=pre + name, Body=name.encode())
    proxy.set_rules([Rule("503", ops={"get"}, path=r"/hot$", count=2)])
    outcomes = []
    for name in ("cold", "hot", "hot", "hot", "cold"):
        try:
            outcomes.append(
                client.get_object(Bucket=bucket, Key=pre + name)["Body"].read().decode()
            )
        except ClientError as exc:
            outcomes.append(exc.response["Error"]["Code"])
    assert outcomes == ["cold", "SlowDown", "SlowDown", "hot", "cold"]
    assert _faults(proxy)[-5:] == ["none", "503", "503", "none", "none"]
    proxy.reset_stats()
    assert proxy.stats() == {} and proxy.log == []


def test_reset(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    data = os.urandom(MiB)
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=data)
    proxy.set_rules([Rule("reset", ops={"get", "head", "put"})])
    response = client.get_object(Bucket=bucket, Key=f"{pre}k")  # status line and headers arrive
    with pytest.raises(ResponseStreamingError, match="reset by peer"):
        response["Body"].read()
    with pytest.raises(ConnectionClosedError):
        client.head_object(Bucket=bucket, Key=f"{pre}k")
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=bucket, Key=f"{pre}k2", Body=data)
    proxy.clear()
    assert client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == data
    # The upload reached upstream before its answer was cut.
    assert client.get_object(Bucket=bucket, Key=f"{pre}k2")["Body"].read() == data


def test_truncate(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    data = os.urandom(MiB)
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=data)
    proxy.set_rules([Rule("truncate", ops={"get", "head"})])
    response = client.get_object(Bucket=bucket, Key=f"{pre}k")
    assert response["ContentLength"] == len(data)
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        response["Body"].read()
    with pytest.raises(ConnectionClosedError):
        client.head_object(Bucket=bucket, Key=f"{pre}k")
    proxy.clear()
    assert client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == data


def test_latency(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    proxy.set_rules([Rule("latency", ops={"get"}, delay=0.2, count=1)])
    assert client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == b"abc"
    assert proxy.stats()[("get", "latency")] == 1
    # A GET held far longer than the test runs: ops not matched go by meanwhile.
    proxy.set_rules([Rule("latency", ops={"get"}, delay=300)])
    def held_get() -> None:
        with contextlib.suppress(ConnectionClosedError):  # the proxy stops, the GET ends
            client.get_object(Bucket=bucket, Key=f"{pre}k")

    held = threading.Thread(target=held_get, daemon=True)
    held.start()
    deadline = time.monotonic() + 30
    while proxy.stats()[("get", "latency")] < 2:
        assert time.monotonic() < deadline, "the GET never reached the proxy"  # hang guard
        time.sleep(0.01)
    assert client.head_object(Bucket=bucket, Key=f"{pre}k")["ContentLength"] == 3
    assert held.is_alive()  # the GET is still held


def test_peak_inflight(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    proxy.set_rules([Rule("latency", ops={"get"}, delay=1.0)])  # each GET in flight >= 1 s
    proxy.reset_stats()
    for _ in range(2):
        client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read()
    assert proxy.peak_inflight("get") == 1  # one after the other
    proxy.reset_stats()
    start = threading.Barrier(4)

    def get(_: int) -> bytes:
        start.wait()
        return bytes(client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read())

    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(get, range(4))) == [b"abc"] * 4
    assert proxy.peak_inflight("get") == 4
    assert proxy.peak_inflight("head") == 0


def test_blackhole(proxy: FaultProxy, bucket: str, pre: str) -> None:
    client = s3_client(proxy.endpoint, read_timeout=1, connect_timeout=1)
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    proxy.set_rules([Rule("blackhole", ops={"get"})])
    with pytest.raises(ReadTimeoutError):  # held, not answered: the client's timeout ends it
        client.get_object(Bucket=bucket, Key=f"{pre}k")
    assert client.head_object(Bucket=bucket, Key=f"{pre}k")["ContentLength"] == 3
    proxy.clear()
    assert client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == b"abc"

    proxy.blackhole_all()
    fresh = s3_client(proxy.endpoint, read_timeout=1, connect_timeout=1)
    for call in (
        lambda: fresh.list_objects_v2(Bucket=bucket),
        lambda: client.head_object(Bucket=bucket, Key=f"{pre}k"),
    ):
        with pytest.raises(ReadTimeoutError):
            call()
    proxy.blackhole_all(False)
    assert fresh.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read() == b"abc"
    stats = proxy.stats()
    assert (stats[("get", "blackhole")], stats[("list", "blackhole")]) == (1, 1)


def test_blackhole_all_stalls_bodies_in_flight(proxy: FaultProxy, bucket: str, pre: str) -> None:
    data = os.urandom(48 * MiB)  # more than loopback socket buffers hold
    s3_client(proxy.endpoint).put_object(Bucket=bucket, Key=f"{pre}big", Body=data)
    client = s3_client(proxy.endpoint, read_timeout=1)
    response = client.get_object(Bucket=bucket, Key=f"{pre}big")
    proxy.blackhole_all()
    with pytest.raises(ReadTimeoutError):
        response["Body"].read()
    proxy.clear()
    ranged = client.get_object(Bucket=bucket, Key=f"{pre}big", Range="bytes=0-9")
    assert ranged["Body"].read() == data[:10]


def test_blackhole_released_by_clear(proxy: FaultProxy, bucket: str, pre: str) -> None:
    client = s3_client(proxy.endpoint, read_timeout=30)
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    proxy.set_rules([Rule("blackhole", ops={"get"})])

    def clear_once_held() -> None:
        deadline = time.monotonic() + 10
        while proxy.stats()[("get", "blackhole")] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.clear()

    releaser = threading.Thread(target=clear_once_held)
    releaser.start()
    # released by clear() (the connection closed), not by the 30 s timeout (ReadTimeoutError)
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=bucket, Key=f"{pre}k")
    releaser.join(10)
    assert proxy.stats()[("get", "blackhole")] == 1


def _fault_sequence(endpoint: str, bucket: str, key: str, seed: int) -> list[str]:
    with FaultProxy(endpoint, seed=seed) as proxy:
        client = s3_client(proxy.endpoint)
        proxy.set_rules(
            [Rule("503", ops={"get"}, probability=0.3), Rule("500", ops={"get"}, probability=0.3)]
        )
        for _ in range(50):
            with contextlib.suppress(ClientError):
                client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return _faults(proxy)


def test_deterministic(s3_server: SeaweedServer, bucket: str, pre: str) -> None:
    s3_server.client().put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    first = _fault_sequence(s3_server.endpoint, bucket, f"{pre}k", seed=7)
    assert len(first) == 50 and {"none", "503", "500"} <= set(first)
    assert _fault_sequence(s3_server.endpoint, bucket, f"{pre}k", seed=7) == first
    assert _fault_sequence(s3_server.endpoint, bucket, f"{pre}k", seed=8) != first


def test_probability(proxy: FaultProxy, client: Any, bucket: str, pre: str) -> None:
    client.put_object(Bucket=bucket, Key=f"{pre}k", Body=b"abc")
    proxy.set_rules([Rule("503", ops={"get"}, probability=0.2)])
    failed = 0
    for _ in range(200):
        try:
            client.get_object(Bucket=bucket, Key=f"{pre}k")["Body"].read()
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "SlowDown"
            failed += 1
    assert 24 <= failed <= 56
    assert proxy.stats()[("get", "503")] == failed
    assert proxy.stats()[("get", "total")] == 200
