"""S3 adapter for any S3-compatible service: botocore for the control calls,
the AWS Common Runtime (crt.py) for the bytes.

Engines: by default (`engine="crt"`) every GET and every file upload
(`put_file`) goes through one runtime client per store; HEAD, LIST, DELETE,
COPY, tags, small PUTs from memory and the multipart calls of streamed parts
stay on botocore. `engine="botocore"` sends everything through botocore (the
fallback, and the way to reach a store the runtime cannot talk to).

One botocore client is shared by all worker threads (clients are thread-safe;
sessions are not, so the session is only used at construction). Neither
engine retries on its own beyond a few quick tries: every attempt goes
through `retry.call_with_retries`, which reports it to the metrics observer
and bounds the operation by one deadline.

Conditional writes: PutObject takes If-Match / If-None-Match: *, and so does
CompleteMultipartUpload (checked against SeaweedFS 4.48, which honours both on
complete: 412 when the condition fails; the runtime passes both on to it). A
conditional multipart upload only checks the condition at completion, after
all parts are sent. As with any S3 client, a conditional PUT retried after a
lost response can see its own write and report a spurious precondition failure.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from functools import partial
from typing import Any

import boto3
from botocore.client import BaseClient

import tierfs.store.s3client as s3client
import tierfs.store.s3writes as s3writes
from tierfs.config import (
    CONNECT_TIMEOUT,
    DEADLINE,
    MAX_CONNECTIONS,
    MAX_KEY_BYTES,
    PART_SIZE,
    READ_TIMEOUT,
)
from tierfs.store.base import (
    Listing,
    ObjectInfo,
    Received,
    RequestObserver,
    StoreError,
    key_too_long,
)
from tierfs.store.crt import CrtEngine, runtime_get
from tierfs.store.retry import Failure, call_with_retries
from tierfs.store.s3errors import classify
from tierfs.store.s3get import (
    META_PREFIX,
    RangedGet,
    file_writer,
    lower_metadata,
    quote_etag,
    strip_etag,
)

log = logging.getLogger("tierfs.store")

ENGINES = ("crt", "botocore")


class _BufferBody:
    """A request body read straight out of a buffer the caller owns (an upload part
    buffer of the memory budget): botocore takes any file-like object, and sends
    it without a copy. (A file-like body is announced with Expect: 100-continue.)"""

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return len(self._view) - self._pos

    def read(self, n: int = -1) -> memoryview:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        chunk = self._view[self._pos : end]
        self._pos = end
        return chunk

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos


def _body(data: bytes | memoryview) -> bytes | bytearray | _BufferBody:
    """A request body without a copy: a view of a whole bytearray is sent as the
    bytearray (in one piece), any other view through `_BufferBody`."""
    if not isinstance(data, memoryview):
        return data
    whole = data.obj
    if isinstance(whole, bytearray) and len(whole) == data.nbytes and data.contiguous:
        return whole
    return _BufferBody(data)


class S3Store:
    """`Store` over one bucket and key prefix of an S3-compatible service."""

    streams_parts = True  # uploads can be listed and aborted by id; objects take tags

    @property
    def uploads_files(self) -> bool:
        """The runtime reads files for put_file (botocore's put_file sends parts one by one)."""
        return self.engine is not None

    # Server-side copy switches to UploadPartCopy above this size (S3's CopyObject limit).
    multipart_copy_threshold: int = 5 << 30
    copy_part_size: int = 512 << 20

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        part_size: int = PART_SIZE,
        max_connections: int = MAX_CONNECTIONS,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        deadline: float = DEADLINE,
        observer: RequestObserver | None = None,
        max_key_bytes: int = MAX_KEY_BYTES,
        engine: str = "crt",
        session: boto3.session.Session | None = None,
    ) -> None:
        """`engine`: "crt" or "botocore" (module docstring).
        `session`: where credentials and region come from (default: the standard
        chain); the shared tier passes one with its own profile or keys."""
        if engine not in ENGINES:
            raise StoreError(f"unknown store engine {engine!r}: expected one of {', '.join(ENGINES)}",
                             errno_=errno.EINVAL, kind="invalid")
        if part_size <= 0 or max_connections <= 0 or deadline <= 0:
            raise StoreError(
                "part_size, max_connections and deadline must be positive",
                errno_=errno.EINVAL,
                kind="invalid",
            )
        self.bucket = bucket
        self.prefix = prefix
        self.max_key_bytes = max_key_bytes
        self.part_size = part_size
        self.max_connections = max_connections
        self.deadline = deadline
        self.observer = observer
        self._endpoint_arg = endpoint_url
        self._connect_timeout = connect_timeout
        self._session = session or boto3.session.Session()
        self._session_lock = threading.Lock()  # sessions are not thread-safe; clients are
        try:
            self._client = self._make_client(connect_timeout, read_timeout)
        except ValueError as exc:  # e.g. AWS_ENDPOINT_URL=host:port, without a scheme
            where = endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "the AWS configuration")
            raise StoreError(
                f"invalid S3 endpoint {where!r} ({exc}): it must start with http:// or https://",
                errno_=errno.EINVAL,
                kind="invalid",
            ) from None
        self.endpoint = s3client.safe_endpoint(self._client.meta.endpoint_url)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.identity = f"s3|{self.endpoint}|{bucket}|{prefix}"
        self._conditional: bool | None = None
        self._probe_lock = threading.Lock()
        self.engine: CrtEngine | None = None
        if engine == "crt":
            with self._session_lock:
                self.engine = s3client.crt_engine(
                    self._session, self._client, self.bucket, part_size=self.part_size,
                    max_connections=self.max_connections,
                    connect_timeout=min(connect_timeout, self.deadline))

    def _make_client(self, connect_timeout: float, read_timeout: float) -> BaseClient:
        with self._session_lock:
            return s3client.botocore_client(
                self._session, self._endpoint_arg, max_connections=self.max_connections,
                connect_timeout=min(connect_timeout, self.deadline),
                read_timeout=min(read_timeout, self.deadline))

    # -- plumbing ---------------------------------------------------------------

    def _full(self, key: str) -> str:
        if not key:
            raise StoreError("empty object key", errno_=errno.EINVAL, kind="invalid")
        self.check_key(key)
        return self.prefix + key

    def check_key(self, key: str) -> None:
        err = key_too_long(self.url, key, self.prefix + key, self.max_key_bytes)
        if err is not None:
            raise err

    def _what(self, op: str, key: str) -> str:
        return f"{op} '{self.url.rstrip('/')}/{key}'"

    def _classify(
        self, exc: Exception, *, precondition_kind: str = "precondition"
    ) -> Failure | None:
        return classify(exc, self.bucket, self.endpoint, precondition_kind=precondition_kind)

    def _call(
        self,
        op: str,
        key: str,
        attempt: Callable[[], tuple[Any, int]],
        *,
        precondition_kind: str = "precondition",
    ) -> Any:
        return call_with_retries(
            op,
            self._what(op, key),
            attempt,
            deadline=self.deadline,
            classify=partial(self._classify, precondition_kind=precondition_kind),
            observer=self.observer,
        )

    def _simple(
        self,
        op: str,
        key: str,
        method: Callable[..., dict[str, Any]],
        nbytes: int = 0,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One request with retries; the response dict."""
        return self._call(op, key, lambda: (method(**kwargs), nbytes))

    def _with_body(
        self, op: str, key: str, method: Callable[..., dict[str, Any]], data: bytes | memoryview,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One request sending `data`, with retries: each attempt gets a body of its
        own (a file-like body is spent by the attempt that sent it)."""
        return self._call(op, key, lambda: (method(Body=_body(data), **kwargs), len(data)))

    @staticmethod
    def _response_time(resp: dict[str, Any]) -> float:
        """Server time of a write response (its Date header): the new object's mtime without a HEAD."""
        return _date(resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"))

    # -- Store protocol ---------------------------------------------------------

    def check(self) -> None:
        """List one key under the prefix with a short deadline: proves endpoint, bucket, credentials."""
        s3client.check(
            self._make_client(min(self._connect_timeout, 2.0), 5.0), self.url, self.endpoint,
            self.bucket, self.prefix, deadline=self.deadline, classify=self._classify,
            observer=self.observer)

    def head(self, key: str) -> ObjectInfo:
        resp = self._simple(
            "head", key, self._client.head_object, Bucket=self.bucket, Key=self._full(key)
        )
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            etag=strip_etag(resp["ETag"]),
            mtime=resp["LastModified"].timestamp(),
            metadata=dict(resp.get("Metadata", {})),
        )

    def list_dir(self, prefix: str) -> Listing:
        if prefix and not prefix.endswith("/"):
            raise StoreError(
                f"list prefix {prefix!r} must end with '/'", errno_=errno.EINVAL, kind="invalid"
            )
        full = self.prefix + prefix
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._simple("list", prefix, self._client.list_objects_v2, **kwargs)
            for obj in page.get("Contents", ()):
                if obj["Key"] == full:
                    continue  # the directory marker itself
                files.append(
                    ObjectInfo(
                        key=obj["Key"][len(self.prefix) :],
                        size=int(obj["Size"]),
                        etag=strip_etag(obj.get("ETag", "")),
                        mtime=obj["LastModified"].timestamp(),
                    )
                )
            dirs.extend(p["Prefix"][len(full) : -1] for p in page.get("CommonPrefixes", ()))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return Listing(files=files, dirs=dirs)

    def get_range(self, key: str, start: int, length: int, etag: str | None = None) -> bytes:
        """As get_range_into, with a buffer sized by the response (a huge `length` is safe)."""
        held: list[bytearray] = []

        def alloc(size: int) -> memoryview:
            held.append(bytearray(size))
            return memoryview(held[0])

        n = self._get(key, start, length, etag, alloc).length
        if not held:
            return b""
        return bytes(held[0]) if n == len(held[0]) else bytes(memoryview(held[0])[:n])

    def get_range_into(
        self, key: str, start: int, length: int, buf: memoryview, etag: str | None = None
    ) -> Received:
        if len(buf) < length:
            raise StoreError(
                f"buffer of {len(buf)} bytes for a {length}-byte range",
                errno_=errno.EINVAL,
                kind="invalid",
            )
        return self._get(key, start, length, etag, lambda _size: buf)

    def get_range_to_file(
        self, key: str, start: int, length: int, fd: int, etag: str | None,
        on_piece: Callable[[int, bytes], None] | None = None,
    ) -> Received:
        """As get_range_into, but into the file `fd` at the object's offsets. Where
        `engine.writes_files`, the runtime writes them itself (OSError where it could not);
        else its body pieces are written from the caller's thread and each is then
        shown to `on_piece(object offset, piece)`. The crt engine only."""
        if self.engine is None:
            raise StoreError("get_range_to_file needs the crt engine", errno_=errno.EINVAL,
                             kind="invalid")
        direct = self.engine.writes_files
        put = None if direct else file_writer(fd, start, on_piece or (lambda _o, _p: None))
        return self._get(key, start, length, etag, lambda _size: memoryview(b""), put,
                         fd=fd if direct else None)

    def _get(
        self, key: str, start: int, length: int, etag: str | None,
        alloc: Callable[[int], memoryview], put: Callable[[int, bytes], None] | None = None,
        *, fd: int | None = None,
    ) -> Received:
        """Read [start, start+length) clipped at EOF into alloc(clipped length) (or the
        runtime into `fd`); the byte count, ETag and first answer's user metadata. A retry
        resumes after the bytes received, pinned with If-Match to the first answer's ETag."""
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length}", errno_=errno.EINVAL,
                             kind="invalid")
        full = self._full(key)
        if length == 0:
            return Received(0, etag or "")
        read = RangedGet(key, full, start, length, etag, alloc, put)
        to_file = fd is not None or put is not None  # get_range_to_file: the runtime's
        if (engine := self.engine) is not None and (to_file or runtime_get(length)):
            attempt = partial(read.via_crt_file, engine, fd) if fd is not None else partial(
                read.via_crt, engine)
        else:  # botocore: the fallback engine, and long ranges (crt.RUNTIME_GET_MAX)
            attempt = partial(read.via_botocore, self._client, self.bucket)
        done: int = self._call("get", key, attempt, precondition_kind="changed")
        return Received(done, read.pinned or "", read.metadata)

    def put_bytes(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        metadata: dict[str, str] | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
        typed: bool = False,
    ) -> ObjectInfo:
        if typed:
            return s3writes.put_typed(self, key, data, metadata or {}, if_match, if_none_match)
        kwargs = {
            "Bucket": self.bucket,
            "Key": self._full(key),
            "Metadata": metadata or {},
            **_conditions(if_match, if_none_match),
        }
        resp = self._with_body("put", key, self._client.put_object, data, **kwargs)
        return ObjectInfo(
            key, len(data), strip_etag(resp["ETag"]), self._response_time(resp), lower_metadata(metadata)
        )

    def may_be_typed(self, etag: str) -> bool:
        """Only a multipart ETag: a typed put makes one, and a copy keeps it one."""
        return "-" in etag

    def create_upload(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        created = self._simple(
            "multipart",
            key,
            self._client.create_multipart_upload,
            Bucket=self.bucket,
            Key=self._full(key),
            Metadata=metadata or {},
        )
        return str(created["UploadId"])

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes | memoryview,
        *, content_md5: str | None = None,
    ) -> str:
        extra = {"ContentMD5": content_md5} if content_md5 else {}
        resp = self._with_body(
            "multipart",
            key,
            self._client.upload_part,
            data,
            Bucket=self.bucket,
            Key=self._full(key),
            UploadId=upload_id,
            PartNumber=number,
            **extra,
        )
        return str(resp["ETag"])

    def complete_upload(
        self,
        key: str,
        upload_id: str,
        parts: list[tuple[int, str]],
        size: int,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> ObjectInfo:
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._full(key),
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]},
            **_conditions(if_match, if_none_match),
        }
        resp = self._simple("multipart", key, self._client.complete_multipart_upload, **kwargs)
        return ObjectInfo(key, size, strip_etag(resp["ETag"]), self._response_time(resp))

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self._simple(
                "multipart",
                key,
                self._client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=self._full(key),
                UploadId=upload_id,
            )
        except StoreError as exc:
            log.warning("could not abort multipart upload of %s: %s", key, exc)

    def put_tags(self, key: str, tags: dict[str, str]) -> None:
        self._simple(
            "tagging", key, self._client.put_object_tagging, Bucket=self.bucket,
            Key=self._full(key),
            Tagging={"TagSet": [{"Key": k, "Value": v} for k, v in tags.items()]},
        )

    def get_tags(self, key: str) -> dict[str, str]:
        resp = self._simple("tagging", key, self._client.get_object_tagging,
                            Bucket=self.bucket, Key=self._full(key))
        return {t["Key"]: t["Value"] for t in resp.get("TagSet", [])}

    def put_file(
        self,
        key: str,
        path: str,
        *,
        metadata: dict[str, str] | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> ObjectInfo:
        """Upload the file at `path`. Through the runtime: it reads the file itself,
        one PUT up to part_size, else parts in parallel, each with a CRC32C the
        store checks; `progress(n)` is called (from a runtime thread) as bytes
        are acknowledged. Through botocore: s3writes.put_file_parts."""
        engine = self.engine
        if engine is None:
            return s3writes.put_file_parts(self, key, path, metadata, if_match, if_none_match,
                                           progress)
        full = self._full(key)
        headers = [(META_PREFIX + k, v) for k, v in (metadata or {}).items()]
        headers += list(_conditions(if_match, if_none_match, header=True).items())
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            answer = self._call("put", key, lambda: (
                engine.put_file(full, path, st.st_size, headers, progress), st.st_size))
            after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise StoreError(f"{key}: local file changed while uploading", errno_=errno.EIO,
                             kind="io")
        etag = answer.headers.get("etag")
        if etag is None:
            raise StoreError(f"put '{key}': answer without an ETag", errno_=errno.EIO, kind="io")
        return ObjectInfo(key, st.st_size, strip_etag(etag),
                          _date(answer.headers.get("date")), lower_metadata(metadata))

    def copy(self, src: str, dst: str, *, metadata: dict[str, str] | None = None) -> ObjectInfo:
        """Server-side copy pinned to the source's current ETag (412 if it moves
        meanwhile); the source's user metadata, or `metadata` in its place."""
        info = self.head(src)
        return s3writes.copy_version(self, info, dst, metadata)

    def replace_metadata(
        self, key: str, update: dict[str, str], *, etag: str, typed: bool = False
    ) -> ObjectInfo:
        """CopyObject onto itself with metadata REPLACE (multipart copy above the copy
        limit): `update` over the object's user metadata, bytes untouched. Pinned to
        `etag`: StoreError(kind='precondition', ESTALE) if the object moved on."""
        info = self.head(key)
        if info.etag != etag:
            raise StoreError(f"'{key}': changed in the store (ETag {info.etag}, not {etag})",
                             errno_=errno.ESTALE, kind="precondition")
        return s3writes.copy_version(self, info, key, {**info.metadata, **update}, typed=typed)

    def delete(self, key: str) -> None:
        try:
            self._simple(
                "delete", key, self._client.delete_object, Bucket=self.bucket, Key=self._full(key)
            )
        except StoreError as exc:
            if exc.kind != "not_found":
                raise

    # -- conditional PUT support --------------------------------------------------

    @property
    def supports_conditional_put(self) -> bool:
        """Probed on first use (blocking: call probe_conditional_put() from a worker first)."""
        if self._conditional is None:
            return self.probe_conditional_put()
        return self._conditional

    @supports_conditional_put.setter
    def supports_conditional_put(self, value: bool) -> None:
        """Skip the probe (e.g. a config that knows the server)."""
        self._conditional = value

    def probe_conditional_put(self) -> bool:
        """PUT a probe key with If-None-Match: * twice; the second must get 412.

        A store that accepts the second PUT ignores conditions, so manifest
        writes there cannot be made safe against concurrent writers.
        """
        with self._probe_lock:
            if self._conditional is None:
                self._conditional = s3writes.conditions_enforced(self)
            return self._conditional

def _date(value: str | None) -> float:
    """Server time from a response's Date header (the new object's mtime without
    a HEAD); the local clock where there is none."""
    if value:
        try:
            return parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
            pass
    return time.time()


def _conditions(
    if_match: str | None, if_none_match: bool, *, header: bool = False
) -> dict[str, str]:
    """The condition as botocore parameters, or (`header`) as HTTP headers."""
    if if_match is not None and if_none_match:
        raise StoreError(
            "if_match and if_none_match are exclusive", errno_=errno.EINVAL, kind="invalid"
        )
    if if_match is not None:
        return {"If-Match" if header else "IfMatch": quote_etag(if_match)}
    return {"If-None-Match" if header else "IfNoneMatch": "*"} if if_none_match else {}
