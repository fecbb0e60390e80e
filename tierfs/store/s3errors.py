"""How an S3 failure is classified, whichever engine met it (botocore or the
AWS Common Runtime): one table of HTTP statuses and S3 error codes, and the
transport failures of each engine mapped onto the same StoreError kinds, so
that retries, degraded mode and errnos do not depend on the engine."""

from __future__ import annotations

import errno
import http.client
import re

import awscrt.exceptions
from awscrt.s3 import S3ResponseError
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from tierfs.store.base import StoreError
from tierfs.store.retry import Failure

THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)
TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "RequestTimeout", "ConditionalRequestConflict"}
)
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
    }
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchUpload"})
NO_CREDENTIALS = "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"

# The runtime's transport errors (awscrt.exceptions.AwsCrtError.name).
_CRT_UNREACHABLE = {
    "AWS_IO_SOCKET_CONNECTION_REFUSED": "connection refused",
    "AWS_IO_SOCKET_NO_ROUTE_TO_HOST": "no route to host",
    "AWS_IO_SOCKET_NETWORK_DOWN": "network unreachable",
    "AWS_IO_DNS_INVALID_NAME": "cannot resolve host",
    "AWS_IO_DNS_QUERY_FAILED": "cannot resolve host",
    "AWS_IO_DNS_NO_ADDRESS_FOR_HOST": "cannot resolve host",
    "AWS_IO_SOCKET_TIMEOUT": "connect timeout",
    "AWS_ERROR_HTTP_CONNECTION_MANAGER_VENDED_CONNECTION_UNDERFLOW": "connection failed",
}
_CRT_CLOSED = frozenset(
    {
        "AWS_ERROR_HTTP_CONNECTION_CLOSED",
        "AWS_IO_SOCKET_CLOSED",
        "AWS_IO_BROKEN_PIPE",
        "AWS_ERROR_HTTP_SERVER_CLOSED",
        "AWS_ERROR_HTTP_PROTOCOL_ERROR",
        "AWS_ERROR_S3_INVALID_CONTENT_LENGTH_HEADER",
        "AWS_ERROR_S3_INCORRECT_CONTENT_LENGTH",
        "AWS_ERROR_S3_RESPONSE_CHECKSUM_MISMATCH",
        "AWS_ERROR_S3_REQUEST_TIME_TOO_SKEWED",
        "AWS_ERROR_HTTP_RESPONSE_FIRST_BYTE_TIMEOUT",
        "AWS_IO_TLS_ERROR_NEGOTIATION_FAILURE",
    }
)
_CODE_RE = re.compile(rb"<Code>([^<]{1,100})</Code>")


def by_status(
    status: int, code: str, bucket: str, *, precondition_kind: str = "precondition"
) -> Failure:
    """An S3 error answer (HTTP `status`, S3 error `code`)."""
    reason = f"HTTP {status} {code}".rstrip()
    if status == 503 or status == 429 or code in THROTTLE_CODES:
        return Failure("throttled", errno.EIO, reason, True)
    # 501 Not Implemented is the server's lasting answer (a store without
    # conditional writes answers If-None-Match so): not retried.
    if (status >= 500 and status != 501) or code in TRANSIENT_CODES:
        return Failure("io", errno.EIO, reason, True)
    if code == "NoSuchBucket":
        return Failure("no_bucket", errno.ENOENT, f"bucket '{bucket}' does not exist", False)
    if status == 404 or code in NOT_FOUND_CODES:
        return Failure("not_found", errno.ENOENT, "no such object", False)
    if status == 403 or code in DENIED_CODES:
        return Failure("access_denied", errno.EACCES, f"access denied ({code})", False)
    if status == 412 or code == "PreconditionFailed":
        return Failure(precondition_kind, errno.ESTALE, "precondition failed", False)
    if code == "KeyTooLongError":
        return Failure("invalid", errno.ENAMETOOLONG, reason, False)
    if status in (400, 405, 501):
        return Failure("invalid", errno.EINVAL, reason, False)
    return Failure("io", errno.EIO, reason, False)


def connect_reason(exc: Exception) -> str:
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


class ShortBody(Exception):
    """A response body shorter or longer than its range promised: retried."""


class Deadline(Exception):
    """A runtime request still running at its operation's deadline (cancelled)."""


def classify(
    exc: Exception, bucket: str, endpoint: str, *, precondition_kind: str = "precondition"
) -> Failure | None:
    """The Failure for an exception raised by either engine; None: not ours."""
    if isinstance(exc, StoreError):  # raised by an attempt itself: already classified
        return Failure(exc.kind, exc.errno, str(exc), False)
    if isinstance(exc, S3ResponseError):
        found = _CODE_RE.search(exc.body or b"")
        code = found.group(1).decode("ascii", "replace") if found else ""
        return by_status(int(exc.status_code or 0), code, bucket,
                         precondition_kind=precondition_kind)
    if isinstance(exc, awscrt.exceptions.AwsCrtError):
        return _crt_failure(exc, endpoint, precondition_kind)
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        return by_status(status, str(err.get("Code", "")), bucket,
                         precondition_kind=precondition_kind)
    if isinstance(exc, Deadline):
        return Failure("timeout", errno.EIO, f"no answer from {endpoint} in time", True,
                       cut=True)
    if isinstance(exc, ConnectTimeoutError):
        return Failure("unreachable", errno.EIO, f"cannot reach {endpoint}: connect timeout", True)
    if isinstance(exc, EndpointConnectionError | BotoConnectionError):
        return Failure(
            "unreachable", errno.EIO, f"cannot reach {endpoint}: {connect_reason(exc)}", True
        )
    if isinstance(exc, ReadTimeoutError | TimeoutError):
        return Failure("timeout", errno.EIO, f"read timeout from {endpoint}", True)
    if isinstance(
        exc, ConnectionClosedError | ResponseStreamingError | IncompleteReadError
        | ConnectionError | http.client.HTTPException,
    ):
        return Failure("io", errno.EIO, "connection closed mid-response", True)
    if isinstance(exc, ShortBody):
        return Failure("io", errno.EIO, f"truncated response: {exc}", True)
    if isinstance(exc, NoCredentialsError):
        return Failure("access_denied", errno.EACCES, NO_CREDENTIALS, False)
    if isinstance(exc, BotoCoreError):
        return Failure("io", errno.EIO, type(exc).__name__, False)
    return None


def _crt_failure(
    exc: awscrt.exceptions.AwsCrtError, endpoint: str, precondition_kind: str
) -> Failure:
    name = exc.name
    if name == "AWS_ERROR_S3_SLOW_DOWN":  # 503 SlowDown, after the runtime's own retries
        return Failure("throttled", errno.EIO, "HTTP 503 SlowDown", True)
    if name == "AWS_ERROR_S3_INTERNAL_ERROR":  # 500 InternalError, likewise
        return Failure("io", errno.EIO, "HTTP 500 InternalError", True)
    if name == "AWS_ERROR_S3_REQUEST_TIMEOUT":
        return Failure("timeout", errno.EIO, f"request timeout from {endpoint}", True)
    if name == "AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE":  # a stalled connection, dropped
        return Failure("timeout", errno.EIO, f"transfer from {endpoint} stalled", True)
    if name == "AWS_ERROR_S3_FILE_MODIFIED":
        return Failure("io", errno.EIO, "local file changed while uploading", False)
    if name in _CRT_UNREACHABLE:
        return Failure(
            "unreachable", errno.EIO, f"cannot reach {endpoint}: {_CRT_UNREACHABLE[name]}", True
        )
    if name == "AWS_ERROR_S3_OBJECT_MODIFIED":  # the runtime saw the ETag move between parts
        return Failure(precondition_kind, errno.ESTALE, "object changed during the read", False)
    if name in _CRT_CLOSED or name.startswith("AWS_IO_SOCKET"):
        return Failure("io", errno.EIO, f"connection failed mid-request ({name})", True)
    if name.startswith("AWS_AUTH") or "CREDENTIALS" in name:
        return Failure("access_denied", errno.EACCES, NO_CREDENTIALS, False)
    return Failure("io", errno.EIO, name, False)
