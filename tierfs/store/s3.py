"""S3 adapter (boto3) for any S3-compatible service.

One botocore client is shared by all worker threads (clients are thread-safe;
sessions are not, so the session is only used at construction). botocore's own
retries are off: every attempt goes through `retry.call_with_retries`, which
reports it to the metrics observer and bounds the operation by one deadline.

Conditional writes: PutObject takes If-Match / If-None-Match: *, and so does
CompleteMultipartUpload (checked against SeaweedFS 4.48, which honours both on
complete: 412 when the condition fails). A conditional multipart upload only
checks the condition at completion, after all parts are sent. As with any S3
client, a conditional PUT retried after a lost response can see its own write
and report a spurious precondition failure.

GETs of byte ranges skip boto3's request machinery where they can: a "lean" GET
signed as botocore's SigV4 signer would sign it (sigv4.py) and sent by the
store's own urllib3 pool, with every answer and failure mapped as boto3's would
be (S3Store._plan_lean says where it is used, S3Store._get how).
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from email.utils import parsedate_to_datetime
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import boto3
import urllib3
import urllib3.exceptions as u3
from botocore.awsrequest import AWSRequest, HeadersDict
from botocore.client import BaseClient
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ProxyConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from botocore.exceptions import (
    SSLError as BotoSSLError,
)
from botocore.httpsession import ProxyConfiguration, create_urllib3_context, get_cert_path
from botocore.parsers import create_parser
from botocore.response import StreamingBody
from botocore.utils import get_environ_proxies, percent_encode

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
    RequestObserver,
    StoreError,
    key_too_long,
    part_size_for,
)
from tierfs.store.retry import Failure, call_with_retries, time_left
from tierfs.store.sigv4 import GetSigner

log = logging.getLogger("tierfs.store")
TYPED_MAX = 1 << 20  # a multipart source up to this size may be typed: copied as multipart

_READ_SLICE = 1 << 20  # largest readinto() per call on a response body (see _get)
CHECK_DEADLINE = 5.0  # check() gives up on an unreachable endpoint after about this long

_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)
_TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "RequestTimeout", "ConditionalRequestConflict"}
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchUpload"})


class _ShortBody(Exception):
    """A response body shorter or longer than its range promised: retried."""


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


def _strip_etag(etag: str) -> str:
    return etag.strip('"')


def _lower(metadata: dict[str, str] | None) -> dict[str, str]:
    """User metadata as S3 returns it: names lowercased."""
    return {k.lower(): v for k, v in (metadata or {}).items()}


def _quote_etag(etag: str) -> str:
    return f'"{_strip_etag(etag)}"'


def _safe_endpoint(url: str) -> str:
    """The endpoint for messages: scheme://host:port, never userinfo or a path query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


def _connect_reason(exc: Exception) -> str:
    """A short cause from a connection failure, without echoing URLs or proxies."""
    text = str(getattr(exc, "kwargs", {}).get("error", "")) or str(exc)
    for needle, reason in (
        ("refused", "connection refused"),
        ("Name or service not known", "cannot resolve host"),
        ("nodename nor servname", "cannot resolve host"),
        ("Temporary failure in name resolution", "cannot resolve host"),
        ("No route to host", "no route to host"),
        ("Network is unreachable", "network unreachable"),
        ("reset by peer", "connection reset"),
    ):
        if needle in text:
            return reason
    return "connection failed"


def _cap_read_timeout(read_timeout: float, context: dict[str, Any], **_: Any) -> None:
    """botocore before-call hook: a request sent by an operation with a deadline
    (retry.call_with_retries) waits at most the time left to that deadline for
    each read, so a stalled store (accepted connection, no answer) fails the
    operation at its deadline instead of one read_timeout after it."""
    left = time_left()
    if left is not None:
        context["read_timeout"] = max(0.05, min(read_timeout, left))


# -- the lean GET path (S3Store._get) ------------------------------------------------

# Key of the dry-run GetObject (never sent) that shows the URL boto3 would use: odd
# on purpose, so that the quoting of keys is checked too.
_PROBE_KEY = "tierfs probe/é +%?#~!*'()[]&=;,$@"
_LEAN_HEADERS = frozenset({"range", "if-match", "user-agent"})  # all boto3 signs for a GET
# Answers a lean GET leaves to boto3 (redone there): S3's wrong-region redirects (3xx,
# 400 AuthorizationHeaderMalformed), which the botocore client follows by itself.
_REDO_STATUSES = frozenset({301, 302, 307, 400})
_META_PREFIX = "x-amz-meta-"


class _DryRun(Exception):
    """Stops the dry-run GetObject of `S3Store._plan_lean` before it is signed."""


@dataclass(frozen=True)
class _Lean:
    """What a lean GET needs, fixed when the store is made (`S3Store._plan_lean`)."""

    origin: str  # scheme://host[:port]
    path: str  # the bucket's path, ending in '/': the request target is this + quoted key
    credentials: Credentials | None  # the client's own (refreshable) credentials
    signer: GetSigner  # as the client's S3SigV4Auth signs (its s3 options: UNSIGNED-PAYLOAD)
    pool: urllib3.HTTPConnectionPool
    timeout: urllib3.Timeout  # connect and read timeouts, both capped by the store deadline
    read_timeout: float  # as configured: a request in an operation gets min(this, time left)


def _metadata(headers: Any) -> dict[str, str]:
    """User metadata from x-amz-meta-* headers, as botocore parses them: the name
    after the prefix as the server spelled it, repeated headers joined by ', '."""
    cut = len(_META_PREFIX)
    return {name[cut:]: headers[name] for name in headers if name.lower().startswith(_META_PREFIX)}


def _need(etag: str | None) -> str:
    if etag is None:  # as boto3's response dict without one: resp["ETag"]
        raise KeyError("ETag")
    return etag


def _as_botocore(exc: u3.HTTPError, endpoint: str) -> Exception:
    """The botocore exception the botocore client raises for this urllib3 one (as
    botocore.httpsession.URLLib3Session.send and StreamingBody wrap them), so that
    a lean GET's failure is classified exactly as the same failure under boto3."""
    if isinstance(exc, u3.SSLError):
        return BotoSSLError(endpoint_url=endpoint, error=exc)
    if isinstance(exc, u3.NewConnectionError):  # (a subclass of ConnectTimeoutError)
        return EndpointConnectionError(endpoint_url=endpoint, error=exc)
    if isinstance(exc, u3.ProxyError):
        return ProxyConnectionError(proxy_url="proxy", error=exc)
    if isinstance(exc, u3.ConnectTimeoutError):
        return ConnectTimeoutError(endpoint_url=endpoint, error=exc)
    if isinstance(exc, u3.ReadTimeoutError):
        return ReadTimeoutError(endpoint_url=endpoint, error=exc)
    if isinstance(exc, u3.ProtocolError):
        return ConnectionClosedError(endpoint_url=endpoint, error=exc, request=None)
    return HTTPClientError(error=exc)


class S3Store:
    """`Store` over one bucket and key prefix of an S3-compatible service."""

    streams_parts = True  # uploads can be listed and aborted by id; objects take tags

    # Server-side copy switches to UploadPartCopy above this size (S3's CopyObject limit).
    multipart_copy_threshold: int = 5 << 30
    copy_part_size: int = 512 << 20
    # Told (key, ETag, user metadata) of each GET's first response: the read path's
    # GETs teach the namespace attributes a listing does not carry. Called in the
    # worker thread making the request: must be cheap and thread-safe.
    on_metadata: Callable[[str, str, dict[str, str]], None] | None = None

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
        session: boto3.session.Session | None = None,
    ) -> None:
        """`session`: where credentials and region come from (default: the standard
        chain); the shared tier passes one with its own profile or keys."""
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
        self.endpoint = _safe_endpoint(self._client.meta.endpoint_url)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.identity = f"s3|{self.endpoint}|{bucket}|{prefix}"
        self._conditional: bool | None = None
        self._probe_lock = threading.Lock()
        self._lean: _Lean | None = self._plan_lean(connect_timeout, read_timeout)

    def _make_client(self, connect_timeout: float, read_timeout: float) -> BaseClient:
        config = Config(
            region_name=self._session.region_name or "us-east-1",
            # No SHA-256 of every uploaded byte for SigV4 (over plain http botocore
            # signs the payload unless told not to): it cost 0.7 CPU-s per GiB
            # uploaded (1.25 vs 0.54, 64 x 16 MiB parts to SeaweedFS), CPU the
            # server and the training job need. TLS (or TCP's checksum on a
            # loopback/LAN endpoint) guards the bytes; uploads check sizes.
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            retries={"total_max_attempts": 1, "mode": "standard"},  # ours: retry.py
            max_pool_connections=self.max_connections,
            # Neither timeout may outlast the operation's deadline; the read timeout
            # is further cut per request to the time left (_cap_read_timeout).
            connect_timeout=min(connect_timeout, self.deadline),
            read_timeout=min(read_timeout, self.deadline),
            tcp_keepalive=True,
            # Checksums only where the API demands them: S3-compatible servers
            # differ in their support for the newer default trailing checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        with self._session_lock:
            client = self._session.client("s3", endpoint_url=self._endpoint_arg, config=config)
        client.meta.events.register("before-call.s3", partial(_cap_read_timeout, read_timeout))
        return client

    def _plan_lean(self, connect_timeout: float, read_timeout: float) -> _Lean | None:
        """The lean GET path of this store, or None where GETs go through boto3.

        A dry-run GetObject (stopped at botocore's before-sign event: nothing is
        signed or sent) shows what the client would send. The lean path is used
        only where that is a plain SigV4 ('s3v4') GET of
        `<endpoint>/<bucket>/<percent_encode(key, safe='/~')>` (path-style, no
        query) over http or https, signing nothing but Range, If-Match and the
        user agent, and where no proxy applies to the endpoint (HTTP(S)_PROXY /
        NO_PROXY as botocore reads them; the store sets no proxy or client
        certificate config). Anything else (an access point, another signer,
        a dry run that fails, e.g. on an invalid bucket name) keeps boto3.
        """
        client = self._client
        config = client.meta.config
        if config.proxies or config.proxies_config or config.client_cert:
            return None
        seen: dict[str, Any] = {}

        def grab(request: AWSRequest, signing_name: str, region_name: str,
                 signature_version: str, **_: Any) -> None:
            signing = request.context.get("signing", {})
            seen.update(
                url=request.url,
                headers={k.lower() for k in request.headers},
                version=signature_version,
                name=signing.get("signing_name") or signing_name,
                region=signing.get("region") or region_name,
            )
            raise _DryRun

        probe = self.prefix + _PROBE_KEY
        event, uid = "before-sign.s3.GetObject", f"tierfs-lean-{id(self)}"
        client.meta.events.register(event, grab, unique_id=uid)
        try:
            client.get_object(Bucket=self.bucket, Key=probe, Range="bytes=0-0", IfMatch='"0"')
        except _DryRun:
            pass
        except Exception as exc:
            log.debug("GETs through boto3: the dry run failed (%s)", type(exc).__name__)
            return None
        finally:
            client.meta.events.unregister(event, unique_id=uid)
        url: str = seen["url"]
        quoted = percent_encode(probe, safe="/~")
        parts = urlsplit(url)
        if (
            seen["version"] != "s3v4"
            or seen["name"] != "s3"
            or not seen["headers"] <= _LEAN_HEADERS
            or parts.scheme not in ("http", "https")
            or "@" in parts.netloc
            or parts.query
            or parts.fragment
            or not url.endswith(f"/{self.bucket}/{quoted}")
            # The proxy botocore's http session picks: from the environment
            # (HTTP(S)_PROXY, NO_PROXY) for the endpoint, read when the client was made.
            or ProxyConfiguration(get_environ_proxies(client.meta.endpoint_url)).proxy_url_for(url)
        ):
            log.debug("GETs through boto3 (%s %s)", seen["version"], sorted(seen["headers"]))
            return None
        origin = f"{parts.scheme}://{parts.netloc}"
        timeout = urllib3.Timeout(
            connect=min(connect_timeout, self.deadline), read=min(read_timeout, self.deadline)
        )
        # As botocore.args / botocore.httpsession set up the client's pool.
        options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        if config.tcp_keepalive:
            options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
        tls: dict[str, Any] = {}
        if parts.scheme == "https":
            # The verify value session.client() gives botocore: ca_bundle (AWS_CA_BUNDLE
            # or the profile's), else REQUESTS_CA_BUNDLE, else botocore's own bundle.
            with self._session_lock:
                verify = self._session._session.get_config_variable("ca_bundle")
            if verify is None:
                verify = os.environ.get("REQUESTS_CA_BUNDLE", True)
            tls = {
                "ssl_context": create_urllib3_context(),
                "cert_reqs": "CERT_REQUIRED",
                "ca_certs": get_cert_path(verify),
            }
        pool = urllib3.connection_from_url(
            origin,
            maxsize=self.max_connections,
            block=False,
            timeout=timeout,
            retries=False,
            socket_options=options,
            **tls,
        )
        with self._session_lock:  # the object the client signs with: refreshed in place
            credentials = self._session.get_credentials()
        return _Lean(
            origin=origin,
            path=url[len(origin) : len(url) - len(quoted)],
            credentials=credentials,
            signer=GetSigner(url, seen["region"], sign_payload=(config.s3 or {}).get(
                "payload_signing_enabled", True) is not False),
            pool=pool,
            timeout=timeout,
            read_timeout=read_timeout,
        )

    def _lean_send(
        self, lean: _Lean, full: str, headers: dict[str, str]
    ) -> urllib3.BaseHTTPResponse:
        """One signed GET of `full` with `headers`, its response's body unread."""
        if lean.credentials is None:
            raise NoCredentialsError()
        path = lean.path + percent_encode(full, safe="/~")
        creds = lean.credentials.get_frozen_credentials()
        signed = lean.signer.sign(path, headers, creds.access_key, creds.secret_key, creds.token)
        timeout = lean.timeout
        left = time_left()
        if left is not None:  # as _cap_read_timeout does for boto3's requests
            read = max(0.05, min(lean.read_timeout, left))
            timeout = urllib3.Timeout(connect=timeout.connect_timeout, read=read)
        try:
            return lean.pool.urlopen(
                "GET",
                path,
                headers=signed,
                retries=False,
                redirect=False,
                assert_same_host=False,
                preload_content=False,
                decode_content=False,
                enforce_content_length=False,
                timeout=timeout,
            )
        except u3.HTTPError as exc:  # raised as the botocore client would raise it
            raise _as_botocore(exc, lean.origin + path) from exc
        except Exception as exc:
            raise HTTPClientError(error=exc) from exc

    def _get_error(self, status: int, headers: Any, body: bytes) -> ClientError:
        """The ClientError the botocore client raises for this GetObject answer:
        botocore's own parser and exception classes, not a copy of them."""
        model = self._client.meta.service_model
        parsed = create_parser(model.protocol).parse(
            {
                "status_code": status,
                "headers": HeadersDict(headers),
                "body": body,
                "context": {"operation_name": "GetObject"},
            },
            model.operation_model("GetObject").output_shape,
        )
        error = parsed.get("Error", {})
        code = error.get("QueryErrorCode") or error.get("Code")
        cls: type[ClientError] = self._client.exceptions.from_code(code)
        return cls(parsed, "GetObject")

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
        if isinstance(exc, StoreError):  # raised by an attempt itself: already classified
            return Failure(exc.kind, exc.errno, str(exc), False)
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            reason = f"HTTP {status} {code}".rstrip()
            if status == 503 or status == 429 or code in _THROTTLE_CODES:
                return Failure("throttled", errno.EIO, reason, True)
            if status >= 500 or code in _TRANSIENT_CODES:
                return Failure("io", errno.EIO, reason, True)
            if code == "NoSuchBucket":
                return Failure(
                    "no_bucket", errno.ENOENT, f"bucket '{self.bucket}' does not exist", False
                )
            if status == 404 or code in _NOT_FOUND_CODES:
                return Failure("not_found", errno.ENOENT, "no such object", False)
            if status == 403 or code in _DENIED_CODES:
                return Failure("access_denied", errno.EACCES, f"access denied ({code})", False)
            if status == 412 or code == "PreconditionFailed":
                return Failure(precondition_kind, errno.ESTALE, "precondition failed", False)
            if code == "KeyTooLongError":
                return Failure("invalid", errno.ENAMETOOLONG, reason, False)
            if status == 400 or status == 405 or status == 501:
                return Failure("invalid", errno.EINVAL, reason, False)
            return Failure("io", errno.EIO, reason, False)
        if isinstance(exc, u3.HTTPError):  # a lean GET's body read: as botocore would wrap it
            botocore_exc = _as_botocore(exc, self.endpoint)
            return self._classify(botocore_exc, precondition_kind=precondition_kind)
        if isinstance(exc, ConnectTimeoutError):
            return Failure(
                "unreachable", errno.EIO, f"cannot reach {self.endpoint}: connect timeout", True
            )
        if isinstance(exc, EndpointConnectionError | BotoConnectionError):
            return Failure(
                "unreachable",
                errno.EIO,
                f"cannot reach {self.endpoint}: {_connect_reason(exc)}",
                True,
            )
        if isinstance(exc, ReadTimeoutError):
            return Failure("timeout", errno.EIO, f"read timeout from {self.endpoint}", True)
        if isinstance(exc, ConnectionClosedError | ResponseStreamingError | IncompleteReadError):
            return Failure("io", errno.EIO, "connection closed mid-response", True)
        if isinstance(exc, _ShortBody):
            return Failure("io", errno.EIO, f"truncated response: {exc}", True)
        # Raw socket errors: a body read straight from the socket (`_socket_readinto`).
        if isinstance(exc, TimeoutError):
            return Failure("timeout", errno.EIO, f"read timeout from {self.endpoint}", True)
        if isinstance(exc, ConnectionError | http.client.HTTPException):
            return Failure("io", errno.EIO, "connection closed mid-response", True)
        if isinstance(exc, NoCredentialsError):
            return Failure(
                "access_denied",
                errno.EACCES,
                "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
                False,
            )
        if isinstance(exc, BotoCoreError):
            return Failure("io", errno.EIO, type(exc).__name__, False)
        return None

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
    def _conditions(if_match: str | None, if_none_match: bool) -> dict[str, str]:
        if if_match is not None and if_none_match:
            raise StoreError(
                "if_match and if_none_match are exclusive", errno_=errno.EINVAL, kind="invalid"
            )
        if if_match is not None:
            return {"IfMatch": _quote_etag(if_match)}
        return {"IfNoneMatch": "*"} if if_none_match else {}

    @staticmethod
    def _response_time(resp: dict[str, Any]) -> float:
        """Server time of a write response (its Date header): the new object's mtime without a HEAD."""
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if date:
            try:
                return parsedate_to_datetime(date).timestamp()
            except (TypeError, ValueError):
                pass
        return time.time()

    # -- Store protocol ---------------------------------------------------------

    def check(self) -> None:
        """List one key under the prefix with a short deadline: proves endpoint, bucket, credentials."""
        client = self._make_client(min(self._connect_timeout, 2.0), 5.0)
        try:
            call_with_retries(
                "list",
                f"check {self.url}",
                lambda: (
                    client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1),
                    0,
                ),
                deadline=min(self.deadline, CHECK_DEADLINE),
                classify=self._classify,
                observer=self.observer,
            )
        except StoreError as exc:
            kind = exc.kind
            if kind in ("no_bucket", "not_found"):  # some servers send a bare 404
                kind = "no_bucket"
                msg = f"bucket '{self.bucket}' does not exist at {self.endpoint}"
            elif exc.kind == "access_denied" and isinstance(exc.__cause__, ClientError):
                msg = f"access denied to bucket '{self.bucket}': check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            else:
                cause = exc.__cause__
                failure = self._classify(cause) if isinstance(cause, Exception) else None
                msg = failure.reason if failure is not None else str(exc)
            raise StoreError(msg, errno_=exc.errno, kind=kind) from exc.__cause__
        finally:
            client.close()

    def head(self, key: str) -> ObjectInfo:
        resp = self._simple(
            "head", key, self._client.head_object, Bucket=self.bucket, Key=self._full(key)
        )
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            etag=_strip_etag(resp["ETag"]),
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
                        etag=_strip_etag(obj.get("ETag", "")),
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

        n = self._get(key, start, length, etag, alloc)
        if not held:
            return b""
        return bytes(held[0]) if n == len(held[0]) else bytes(memoryview(held[0])[:n])

    def get_range_into(
        self, key: str, start: int, length: int, buf: memoryview, etag: str | None = None
    ) -> int:
        if len(buf) < length:
            raise StoreError(
                f"buffer of {len(buf)} bytes for a {length}-byte range",
                errno_=errno.EINVAL,
                kind="invalid",
            )
        return self._get(key, start, length, etag, lambda _size: buf)

    def _get(
        self,
        key: str,
        start: int,
        length: int,
        etag: str | None,
        alloc: Callable[[int], memoryview],
    ) -> int:
        """Read [start, start+length) clipped at EOF into alloc(clipped length); the byte count.

        A retry resumes after the bytes already received, pinned with If-Match
        to the ETag of the first response so versions are never mixed.

        Each attempt is one lean GET where the store has a lean path (`_plan_lean`
        says where): signed as botocore's S3SigV4Auth signs it (sigv4.py, with the
        signing key kept for the day), sent by the store's own urllib3 pool, its
        body read straight into the caller's buffer. That is
        half the client CPU of boto3's get_object, whose request machinery (events,
        serializing, endpoint rules, parsing) was a third of the daemon's CPU on
        a directory of small files. It is handled as boto3's response would be:
        2xx by the code below, 416 as the end of the object, any other error
        status parsed by botocore's parser into the ClientError boto3 raises,
        urllib3 exceptions classified as the botocore ones boto3 turns them
        into. Only a possible wrong-region redirect (301/302/307/400) is redone
        through boto3, which follows it; if that works, the lean path is dropped.
        """
        if start < 0 or length < 0:
            raise StoreError(
                f"bad range start={start} length={length}", errno_=errno.EINVAL, kind="invalid"
            )
        full = self._full(key)
        if length == 0:
            return 0
        end = start + length - 1
        done = 0
        pinned = etag
        target: memoryview | None = None

        def receive(
            size: int,
            content_range: str | None,
            etag: str | None,
            metadata: Callable[[], dict[str, str] | None],
            direct: Callable[[memoryview], int] | None,
            sliced: Callable[[memoryview], int],
        ) -> tuple[int, int]:
            """A 2xx answer of `size` body bytes: checked, and its body read; (done, got)."""
            nonlocal done, pinned, target
            pos = start + done
            if content_range:
                total = content_range.rsplit("/", 1)[1]
                expect = max(0, min(end + 1, int(total)) - pos) if total != "*" else size
            elif pos == 0:  # server ignored Range and sent the whole object
                expect = min(length, size)
                size = expect
            else:
                raise StoreError("server ignored the Range header", errno_=errno.EIO, kind="io")
            if size != expect:
                raise _ShortBody(f"{size} bytes for a {expect}-byte range")
            if pinned is None:
                pinned = _strip_etag(_need(etag))
            if not done and self.on_metadata is not None:
                meta = metadata()
                if meta:
                    self.on_metadata(key, _strip_etag(_need(etag)), meta)
            if target is None:
                target = alloc(done + size)
            view = target[done : done + size]
            got = 0
            while got < size:
                if direct is not None:
                    n = direct(view[got:])
                else:
                    # Bounded slices: urllib3's readinto() allocates a temporary of the
                    # requested size (two, with http.client); 8 MiB ones are fresh mmaps
                    # (page faults, zeroing) per GET, 1 MiB ones are reused heap memory.
                    n = sliced(view[got : got + _READ_SLICE])
                if not n:
                    raise _ShortBody(f"body ended after {got} of {size} bytes")
                got += n
                done += n
            return done, got

        def lean_attempt(lean: _Lean, headers: dict[str, str]) -> tuple[int, int] | None:
            """One attempt as a lean GET; None: redo it through boto3."""
            resp = self._lean_send(lean, full, headers)
            status = resp.status
            if status >= 300:
                body = resp.read()  # (a complete read gives the connection back to the pool)
                resp.release_conn()
                if status == 416:
                    return done, 0  # range starts at or past EOF (e.g. a zero-size object)
                if status in _REDO_STATUSES:
                    return None
                raise self._get_error(status, resp.headers, body)
            released = False
            try:
                hdrs = resp.headers
                size = int(hdrs["content-length"])
                fp = getattr(resp, "_fp", None)  # the http.client response: see _socket_readinto
                direct = None
                if (
                    isinstance(fp, http.client.HTTPResponse)
                    and hdrs.get("content-encoding", "identity") == "identity"
                ):
                    direct = fp.readinto
                out = receive(
                    size, hdrs.get("content-range"), hdrs.get("etag"),
                    lambda: _metadata(hdrs), direct, resp.readinto,
                )
                if out[1] == size:  # all of the body: the connection can serve another GET
                    resp.release_conn()
                    released = True
                return out
            finally:
                if not released:  # unread bytes may follow: the connection is not reused
                    resp.close()
                    resp.release_conn()

        def attempt() -> tuple[int, int]:
            pos = start + done
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": full,
                "Range": f"bytes={pos}-{end}",
            }
            if pinned:
                kwargs["IfMatch"] = _quote_etag(pinned)
            lean = self._lean
            if lean is not None:
                headers = {"Range": kwargs["Range"]}
                if pinned:
                    headers["If-Match"] = kwargs["IfMatch"]
                out = lean_attempt(lean, headers)
                if out is not None:
                    return out
            try:
                resp = self._client.get_object(**kwargs)
            except ClientError as exc:
                if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                    return done, 0  # range starts at or past EOF (e.g. a zero-size object)
                raise
            if lean is not None and self._lean is lean:
                log.info("GETs of %s through boto3 from now on: it followed a redirect", self.url)
                self._lean = None
            body = resp["Body"]
            try:
                size = int(resp["ContentLength"])
                direct = _socket_readinto(body)
                out = receive(
                    size, resp.get("ContentRange"), resp.get("ETag"),
                    lambda: resp.get("Metadata"), direct, body.readinto,
                )
                if direct is not None and out[1] == size:
                    body._raw_stream.release_conn()  # what urllib3 does at the end of a body
                return out
            finally:
                body.close()

        return self._call("get", key, attempt, precondition_kind="changed")

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
            return self._put_typed(key, data, metadata or {}, if_match, if_none_match)
        kwargs = {
            "Bucket": self.bucket,
            "Key": self._full(key),
            "Metadata": metadata or {},
            **self._conditions(if_match, if_none_match),
        }
        resp = self._with_body("put", key, self._client.put_object, data, **kwargs)
        return ObjectInfo(
            key, len(data), _strip_etag(resp["ETag"]), self._response_time(resp), _lower(metadata)
        )

    def _put_typed(
        self, key: str, data: bytes | memoryview, metadata: dict[str, str],
        if_match: str | None, if_none_match: bool,
    ) -> ObjectInfo:
        """A one-part multipart upload: its ETag ('<md5>-1') is what a listing shows
        of it (ListObjectsV2 carries no user metadata). Three requests, for objects
        that are made rarely and listed often."""
        upload_id = self.create_upload(key, metadata=metadata)
        try:
            part = self.upload_part(key, upload_id, 1, 0, data)
            info = self.complete_upload(key, upload_id, [(1, part)], len(data),
                                        if_match=if_match, if_none_match=if_none_match)
        except BaseException:
            self.abort_upload(key, upload_id)
            raise
        return replace(info, metadata=_lower(metadata))

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
            **self._conditions(if_match, if_none_match),
        }
        resp = self._simple("multipart", key, self._client.complete_multipart_upload, **kwargs)
        return ObjectInfo(key, size, _strip_etag(resp["ETag"]), self._response_time(resp))

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
        """Upload `path`: one PUT up to part_size, else a multipart upload of one
        part at a time (the daemon's uploader sends parts in parallel itself:
        writeback/uploader.py). `progress(n)` is called once per acknowledged part."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size <= self.part_size:
                data = f.read()
                if len(data) != st.st_size:
                    raise StoreError(
                        f"{path}: changed while uploading", errno_=errno.EIO, kind="io"
                    )
                info = self.put_bytes(
                    key, data, metadata=metadata, if_match=if_match, if_none_match=if_none_match
                )
                if progress is not None:
                    progress(len(data))
                return info
            size = st.st_size
            part = part_size_for(size, self.part_size)
            upload_id = self.create_upload(key, metadata=metadata)
            try:
                parts = []
                for number, offset in enumerate(range(0, size, part), 1):
                    data = os.pread(f.fileno(), min(part, size - offset), offset)
                    if len(data) != min(part, size - offset):
                        raise StoreError(
                            f"{key}: local file shrank while uploading", errno_=errno.EIO, kind="io"
                        )
                    parts.append((number, self.upload_part(key, upload_id, number, offset, data)))
                    if progress is not None:
                        progress(len(data))
                after = os.fstat(f.fileno())
                if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    raise StoreError(
                        f"{key}: local file changed while uploading", errno_=errno.EIO, kind="io"
                    )
                info = self.complete_upload(key, upload_id, parts, size, if_match=if_match,
                                            if_none_match=if_none_match)
            except BaseException:
                self.abort_upload(key, upload_id)
                raise
        return ObjectInfo(key, size, info.etag, info.mtime, _lower(metadata))

    def copy(self, src: str, dst: str, *, metadata: dict[str, str] | None = None) -> ObjectInfo:
        """Server-side copy pinned to the source's current ETag (412 if it moves
        meanwhile); the source's user metadata, or `metadata` in its place."""
        info = self.head(src)
        return self._copy_version(info, dst, metadata)

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
        return self._copy_version(info, key, {**info.metadata, **update}, typed=typed)

    def _copy_version(
        self, info: ObjectInfo, dst: str, metadata: dict[str, str] | None, *, typed: bool = False
    ) -> ObjectInfo:
        source = {"Bucket": self.bucket, "Key": self._full(info.key)}
        full = self._full(dst)
        meta = dict(info.metadata) if metadata is None else _lower(metadata)
        as_multipart = info.size > self.multipart_copy_threshold or (
            info.size <= TYPED_MAX and (typed or self.may_be_typed(info.etag)))
        if not as_multipart:
            extra: dict[str, Any] = {}
            if metadata is not None:
                extra = {"MetadataDirective": "REPLACE", "Metadata": metadata}
            resp = self._simple(
                "copy",
                dst,
                self._client.copy_object,
                Bucket=self.bucket,
                Key=full,
                CopySource=source,
                CopySourceIfMatch=_quote_etag(info.etag),
                **extra,
            )
            result = resp["CopyObjectResult"]
            mtime = (
                result["LastModified"].timestamp()
                if isinstance(result.get("LastModified"), datetime)
                else self._response_time(resp)
            )
            return ObjectInfo(dst, info.size, _strip_etag(result["ETag"]), mtime, meta)

        # A small multipart source stays multipart (CopyObject would give it a plain
        # MD5 ETag and hide from listings that it may be typed: see may_be_typed).
        part = part_size_for(info.size, self.copy_part_size)
        count = max(1, -(-info.size // part))

        def send(number: int) -> dict[str, Any]:
            first = (number - 1) * part
            last = min(first + part, info.size) - 1
            # (an empty source has no byte range: its one part is the whole of it)
            whole: dict[str, Any] = {} if last < first else {"CopySourceRange": f"bytes={first}-{last}"}
            resp = self._simple(
                "copy",
                dst,
                self._client.upload_part_copy,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceIfMatch=_quote_etag(info.etag),
                **whole,
            )
            return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

        created = self._simple(
            "copy",
            dst,
            self._client.create_multipart_upload,
            Bucket=self.bucket,
            Key=full,
            Metadata=meta,
        )
        upload_id: str = created["UploadId"]
        try:
            parts = [send(n) for n in range(1, count + 1)]
            resp = self._simple(
                "copy",
                dst,
                self._client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self.abort_upload(dst, upload_id)
            raise
        return ObjectInfo(dst, info.size, _strip_etag(resp["ETag"]), self._response_time(resp), meta)

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
            if self._conditional is not None:
                return self._conditional
            key = f".tierfs-probe-{uuid.uuid4().hex}"
            try:
                self.put_bytes(key, b"", if_none_match=True)
                try:
                    self.put_bytes(key, b"", if_none_match=True)
                    supported = False
                except StoreError as exc:
                    if exc.kind != "precondition":
                        raise
                    supported = True
            except StoreError as exc:
                if exc.kind != "invalid":  # 400/501: the server rejects the header outright
                    raise
                supported = False
            finally:
                self.delete(key)
            self._conditional = supported
            return supported


def _socket_readinto(body: Any) -> Callable[[memoryview], int] | None:
    """`readinto` of the http.client response under a plain botocore body: the bytes
    go from the socket straight into the caller's buffer. urllib3's own readinto
    reads into a temporary and copies it: in a profile of a cold 1 GiB read that
    was a second memcpy of every byte plus a fresh allocation per call (CPU the
    2-core bench machine did not have). None where urllib3 must see the bytes (an
    encoded body, a checksum-validating wrapper, an unknown urllib3)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if (
        type(body) is not StreamingBody
        or raw is None
        or fp is None
        or not hasattr(fp, "readinto")
        or not hasattr(raw, "release_conn")
        or raw.headers.get("content-encoding", "identity") != "identity"
    ):
        return None
    readinto: Callable[[memoryview], int] = fp.readinto
    return readinto

