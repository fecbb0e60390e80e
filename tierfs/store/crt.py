"""The transfer engine: GETs and file uploads through the AWS Common Runtime.

Two `awscrt.s3.S3Client`s per mount (GETs, uploads) move the bytes in the runtime's own
threads (named `AwsEventLoop...` in /proc/self/task), none of which holds the
GIL while it reads sockets, signs, splits or checksums: an upload is read from
the sealed tier-1 file by the runtime itself (multipart, parts in parallel,
CRC32C per part verified by the store), and a GET hands each part's body to a
Python callback once (a part is tens of MiB). Python keeps the decisions:
which ranges, when, how many at once, retries and the deadline
(retry.call_with_retries around each request, as for botocore's).

What the Python binding (awscrt 0.38) lacks, and the smallest workaround:
- no read timeout: a request still running at its operation's deadline is
  cancelled (`Deadline`), so a stalled store fails the operation in time;
- no way to write a GET at an offset of an existing file (`recv_filepath`
  creates or truncates the file): tierfs carries a small patch of the binding
  (third_party/awscrt: `recv_file_option=WRITE_TO_POSITION`), with which the
  runtime writes a GET's body into the tier-1 file itself (`get_to_file`); with
  the stock binding the body callback gets each part as `bytes` (a copy made by
  the binding) and the caller's sink puts it where it belongs;
- no way to turn the runtime's own retries off: they are kept few and short,
  and the deadline bounds them.

Requests are path-style (`/bucket/key`) with an explicit Host header (the
client takes host and port from it); TLS follows the endpoint's scheme.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from awscrt import auth, http, io, s3
from awscrt.exceptions import AwsCrtError
from botocore.credentials import Credentials
from botocore.exceptions import NoCredentialsError
from botocore.utils import percent_encode

from tierfs.store.retry import time_left
from tierfs.store.s3errors import Deadline

MiB = 1 << 20
# Each client's memory limit (its part buffers, outside tierfs's budget): the
# least the runtime takes. Its GETs are small (RUNTIME_GET_MAX) and its uploads
# at most max_parallel_puts parts; a larger limit (384 MiB) measured no faster:
# a 1 GiB `dd conv=fsync` + `tierfs flush`, 3 runs each on the 2-core VM
# (2026-12-07): 9.15-9.34 s with 256 MiB, 8.64-10.19 s with 384 MiB.
MEMORY_LIMIT = 256 * MiB
# What the runtime's buffer pool keeps for itself out of its memory limit; it
# reuses part buffers only while 16 parts fit in the rest (aws-c-s3
# s3_default_buffer_pool.c), else every part is a fresh allocation.
_POOL_RESERVED = 128 * MiB
_POOL_PARTS = 16
# Which GETs the runtime makes (`runtime_get`): those of at most this many bytes
# (small whole objects, pages of small reads); longer ranges (a big file's
# tier-1 fills, readahead) go through botocore's pool, which read them faster
# here even with the runtime writing into tier 1 itself. bench/engine.py --size
# 1G --runs 3 --files 2000 --botocore, 2026-12-07, load 7-9 (docs/benchmarks.md):
# a cold 1 GiB read 8.04 s through the runtime, 5.25 s through botocore (a bare
# runtime GET 8.75 s); 2,000 x 100 KiB, 8 readers: 7.97 s vs 12.84 s.
RUNTIME_GET_MAX = 4 * MiB
CHECKSUM = s3.S3ChecksumConfig(
    algorithm=s3.S3ChecksumAlgorithm.CRC32C, location=s3.S3ChecksumLocation.TRAILER
)
# The runtime's own retries (per part): few and short; retry.py owns the rest.
_RETRIES = s3.S3RetryConfig(max_retries=2, backoff_scale_factor_ms=25, max_backoff_secs=1)
# A request may run this long past its operation's deadline: the last attempt,
# started at the deadline (retry.py), still gets the store's answer (a 503's
# kind, not "timeout"), as botocore's requests get at least 0.05 s of read time.
GRACE = 0.25

Sink = Callable[[int, bytes], None]  # (object offset, body piece): called in a runtime thread
# The patched binding's way to write a GET's body into an existing file at a
# position (third_party/awscrt); None with the stock binding.
_RECV_FILE = getattr(s3, "S3RecvFileOption", None)
# The runtime's failures to write the file a GET goes into, as the errno a
# pwrite of tierfs's own would have raised (a full cache disk must stay ENOSPC).
_FILE_ERRNO = {
    "AWS_ERROR_NO_SPACE": errno.ENOSPC,
    "AWS_ERROR_FILE_WRITE_FAILURE": errno.EIO,
    "AWS_ERROR_FILE_INVALID_PATH": errno.ENOENT,
    "AWS_ERROR_S3_RECV_FILE_NOT_FOUND": errno.ENOENT,
    "AWS_ERROR_MAX_FDS_EXCEEDED": errno.EMFILE,
    "AWS_ERROR_NO_PERMISSION": errno.EACCES,
}


@dataclass
class Answer:
    """What a request's first response said (headers), and the body bytes it gave."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # names lowercased
    received: int = 0

    def on_headers(self, status_code: int, headers: list[tuple[str, str]], **_: object) -> None:
        self.status = status_code
        self.headers = {k.lower(): v for k, v in headers}


def runtime_get(length: int) -> bool:
    """Whether a GET of `length` bytes goes through the runtime (RUNTIME_GET_MAX)."""
    return length <= RUNTIME_GET_MAX


def pool_part_size(part_size: int, memory_limit: int) -> int:
    """The runtime client's part size: tierfs's `part_size`, or less where its
    buffer pool could not reuse buffers of that size within `memory_limit`. GETs
    split into parts of this size; uploads keep `part_size` (each request says
    so). Measured here: 1 GiB of 16 MiB ranged GETs, 4 at a time, with the
    default 256 MiB limit cost the runtime 2.05 CPU-s with 16 MiB parts (every
    part buffer freshly mapped and zeroed) and 1.42 with 8 MiB ones."""
    fits = (memory_limit - _POOL_RESERVED) // _POOL_PARTS
    return max(MiB, min(part_size, fits - fits % MiB))


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds of a process's threads (this one's by default), split into the
    runtime's (named `AwsEventLoop...`) and every other ("python"), with their
    counts, from /proc/PID/task."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"python": 0.0, "runtime": 0.0, "python_threads": 0, "runtime_threads": 0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        kind = "runtime" if comm.startswith("AwsEventLoop") else "python"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
        out[kind + "_threads"] += 1
    return out


def transfer_status(engine: CrtEngine | None) -> dict[str, object]:
    """For `tierfs status`: which engine moves the bytes, what it moved, and the
    daemon's CPU split into the runtime's threads and the Python ones."""
    return {
        "engine": "crt" if engine is not None else "botocore",
        "runtime_bytes": dict(engine.moved) if engine is not None else {},
        "cpu_seconds": thread_cpu(),
    }


class CrtEngine:
    """GETs and file PUTs of one bucket through one runtime S3 client."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        region: str,
        credentials: Credentials | None,
        part_size: int,
        max_connections: int,
        connect_timeout: float,
        ca_file: str | None = None,
    ) -> None:
        parts = urlsplit(endpoint)
        self.host = parts.netloc
        self.bucket_path = f"{parts.path.rstrip('/')}/{percent_encode(bucket, safe='')}/"
        self.part_size = part_size
        self._credentials = credentials
        self._lock = threading.Lock()
        self.moved = {"get": 0, "put": 0}  # bytes, for status and metrics
        provider = _provider(credentials, self._frozen)
        signing = s3.create_default_s3_signing_config(region=region, credential_provider=provider)
        tls = None
        if parts.scheme == "https":
            options = io.TlsContextOptions()
            if ca_file:
                options.override_default_trust_store_from_path(ca_filepath=ca_file)
            tls = io.ClientTlsContext(options).new_connection_options()
            tls.set_server_name(parts.hostname or "")
        def client() -> s3.S3Client:
            return s3.S3Client(
                region=region,
                tls_mode=s3.S3RequestTlsMode.ENABLED if tls else s3.S3RequestTlsMode.DISABLED,
                tls_connection_options=tls,
                signing_config=signing,
                part_size=pool_part_size(part_size, MEMORY_LIMIT),
                multipart_upload_threshold=part_size,
                memory_limit=MEMORY_LIMIT,
                max_active_connections_override=max_connections,
                retry_config=_RETRIES,
                connect_timeout_ms=max(1, round(connect_timeout * 1000)),
            )

        # Two clients, as botocore's path has two pools of workers: a client's
        # connections are shared by all its requests, so uploads stalled at the
        # store (parts unanswered) would hold every connection and queue the
        # reads behind them until the runtime gives up on the stall (~90 s).
        self._client = client()
        self._uploads = client()

    @property
    def writes_files(self) -> bool:
        """Whether a GET's body can go into an existing file by the runtime's own
        writes (`get_to_file`: the patched binding, third_party/awscrt)."""
        return _RECV_FILE is not None

    def _frozen(self) -> auth.AwsCredentials:
        """The client's credentials, asked for by the runtime as it signs (botocore's
        own credentials object: refreshed in place when they expire)."""
        if self._credentials is None:
            raise NoCredentialsError()
        c = self._credentials.get_frozen_credentials()
        return auth.AwsCredentials(c.access_key, c.secret_key, c.token)

    def _request(self, method: str, full: str, headers: list[tuple[str, str]]) -> http.HttpRequest:
        path = self.bucket_path + percent_encode(full, safe="/~")
        return http.HttpRequest(method, path, http.HttpHeaders([("Host", self.host), *headers]))

    def get(
        self, full: str, start: int, end: int, etag: str | None, sink: Sink, answer: Answer,
        *, in_caller: bool = False,
    ) -> None:
        """GET bytes [start, end] (inclusive) of `full`; each body piece goes to
        `sink(object offset, bytes)` in order, after `answer` got the first
        response's headers: in the runtime's thread, or (`in_caller`) in this
        thread, for a sink that does I/O or drops the GIL (a runtime thread
        waiting for the GIL stalls every connection of its event loop).
        If-Match `etag` (quoted) where given. Raises what the runtime raised
        (s3errors.classify maps it), or Deadline."""
        headers = _range(start, end, etag)
        pieces: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()

        def on_body(chunk: bytes, offset: int, **_: object) -> None:
            if in_caller:
                pieces.put((offset, chunk))
                return
            sink(offset, chunk)
            answer.received += len(chunk)

        request = self._client.make_request(
            type=s3.S3RequestType.GET_OBJECT,
            request=self._request("GET", full, headers),
            on_headers=answer.on_headers,
            on_body=on_body,
            on_done=lambda **_: pieces.put(None),
        )
        try:
            if in_caller:
                try:
                    while (item := _next(request, pieces)) is not None:
                        sink(*item)
                        answer.received += len(item[1])
                except BaseException:
                    _stop(request)
                    raise
            _wait(request)
        finally:
            self._count("get", answer.received)

    def get_to_file(
        self, full: str, start: int, end: int, etag: str | None, fd: int, answer: Answer
    ) -> None:
        """GET bytes [start, end] (inclusive) of `full` into the file behind `fd`
        at the same offsets: the runtime opens the file itself (by its
        /proc/self/fd name, of a dup that keeps it the same file whatever the
        caller's fd does meanwhile) and pwrites each part as it completes, in its
        own threads: no body byte reaches Python. A retried part is written
        once, when it is whole; a failed or cancelled request leaves some of
        its parts written and returns once no write is left running.
        `answer` gets the first response's headers. Raises what the runtime
        raised, OSError for its failures to write the file, or Deadline."""
        assert _RECV_FILE is not None, "get_to_file needs the patched binding (writes_files)"
        headers = _range(start, end, etag)
        dup = os.dup(fd)
        try:
            request = self._client.make_request(
                type=s3.S3RequestType.GET_OBJECT,
                request=self._request("GET", full, headers),
                recv_filepath=f"/proc/self/fd/{dup}",
                recv_file_option=_RECV_FILE.WRITE_TO_POSITION,
                recv_file_position=start,
                on_headers=answer.on_headers,
            )
            _wait(request)
        except AwsCrtError as exc:
            code = _FILE_ERRNO.get(exc.name)
            if code is None:
                raise
            raise OSError(code, f"writing a GET into tier 1: {exc.name}") from exc
        finally:
            os.close(dup)
        answer.received = int(answer.headers.get("content-length", "0"))
        self._count("get", answer.received)

    def put_file(
        self, full: str, path: str, size: int, headers: list[tuple[str, str]],
        progress: Callable[[int], None] | None,
    ) -> Answer:
        """PUT the file at `path` (`size` bytes) as `full`: the runtime reads it,
        one PutObject up to part_size, else a multipart upload of parts in
        parallel, each with a CRC32C the store verifies. `headers`: user metadata
        and conditions (the runtime sends conditions with CompleteMultipartUpload).
        `progress(n)` is called from a runtime thread as bytes are acknowledged."""
        answer = Answer()

        def on_progress(n: int) -> None:
            if progress is not None:
                progress(n)

        request = self._uploads.make_request(
            type=s3.S3RequestType.PUT_OBJECT,
            request=self._request("PUT", full, [("Content-Length", str(size)), *headers]),
            send_filepath=path,
            part_size=self.part_size,
            multipart_upload_threshold=self.part_size,
            checksum_config=CHECKSUM,
            on_headers=answer.on_headers,
            on_progress=on_progress,
        )
        _wait(request)
        self._count("put", size)
        return answer

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self.moved[what] += n


def _provider(
    credentials: Credentials | None, frozen: Callable[[], auth.AwsCredentials]
) -> auth.AwsCredentialsProvider:
    """Where the runtime's signer takes credentials: fixed ones (keys from the
    config or the environment, botocore's plain `Credentials`) given to it once;
    refreshable ones (a role, SSO, a credentials process) asked for as each
    request is signed (`frozen`), a call into Python from the runtime's thread,
    which waits for the GIL: in a walk through small objects, 6% of the GIL's
    busy time in worker threads went to it."""
    if credentials is not None and type(credentials) is Credentials:
        c = credentials.get_frozen_credentials()
        return auth.AwsCredentialsProvider.new_static(c.access_key, c.secret_key, c.token)
    return auth.AwsCredentialsProvider.new_delegate(frozen)


def _range(start: int, end: int, etag: str | None) -> list[tuple[str, str]]:
    """A ranged GET's headers: bytes [start, end], If-Match `etag` (quoted) if given."""
    return [("Range", f"bytes={start}-{end}"), *([("If-Match", etag)] if etag is not None else [])]


def _next(
    request: s3.S3Request, pieces: queue.SimpleQueue[tuple[int, bytes] | None]
) -> tuple[int, bytes] | None:
    """The next body piece of `request`, None once it is done; at the operation's
    deadline (and GRACE) it is cancelled and Deadline raised. A caller that fails
    meanwhile cancels it too (its pieces must not outlive the caller's sink)."""
    left = time_left()
    try:
        return pieces.get(timeout=None if left is None else max(0.0, left) + GRACE)
    except queue.Empty:
        _stop(request)
        raise Deadline() from None


def _stop(request: s3.S3Request) -> None:
    """Cancel `request` and wait until it is over (its callbacks with it)."""
    request.cancel()
    with suppress(Exception):
        request.finished_future.result()


def _wait(request: s3.S3Request) -> None:
    """Wait for `request`, at most until the running operation's deadline (and
    GRACE): then it is cancelled, and waited for (its callbacks must be over
    before the caller's buffers are reused), and Deadline raised unless it
    failed otherwise meanwhile."""
    future = request.finished_future
    left = time_left()
    try:
        future.result(timeout=None if left is None else max(0.0, left) + GRACE)
    except FutureTimeout:
        request.cancel()
        try:
            future.result()
        except AwsCrtError as exc:
            if exc.name != "AWS_ERROR_S3_CANCELED":
                raise
        raise Deadline() from None
