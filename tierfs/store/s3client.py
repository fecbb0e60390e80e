"""The S3 store's botocore client: how it is configured, and the check a mount
makes before it starts (endpoint, bucket and credentials, in a few seconds)."""

from __future__ import annotations

import email.utils
import os
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.utils import parse_timestamp

from tierfs.store.base import RequestObserver, StoreError
from tierfs.store.crt import CrtEngine
from tierfs.store.retry import Failure, call_with_retries, time_left

CHECK_DEADLINE = 5.0  # check() gives up on an unreachable endpoint after about this long


def safe_endpoint(url: str) -> str:
    """The endpoint for messages: scheme://host:port, never userinfo or a path query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


def _cap_read_timeout(read_timeout: float, context: dict[str, Any], **_: Any) -> None:
    """botocore before-call hook: a request sent by an operation with a deadline
    (retry.call_with_retries) waits at most the time left to that deadline for
    each read, so a stalled store (accepted connection, no answer) fails the
    operation at its deadline instead of one read_timeout after it."""
    left = time_left()
    if left is not None:
        context["read_timeout"] = max(0.05, min(read_timeout, left))


def timestamp(value: str) -> datetime:
    """A response's timestamp (a listing's ISO 8601, a header's RFC 1123) as
    botocore's default parser reads it, without dateutil: that took 160 us a
    timestamp, a seventh of the daemon's CPU in a first walk through a directory
    of 1,000 small objects (py-spy). Anything else goes to botocore's parser."""
    try:
        parsed: datetime | None = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            parsed = None
    if parsed is None or parsed.tzinfo is None:
        return parse_timestamp(value)
    return parsed


def botocore_client(
    session: boto3.session.Session, endpoint_url: str | None, *, max_connections: int,
    connect_timeout: float, read_timeout: float,
) -> BaseClient:
    """A client of `session` (the caller holds its lock: sessions are not thread-safe)."""
    config = Config(
        region_name=session.region_name or "us-east-1",
        # No SHA-256 of every uploaded byte for SigV4 (over plain http botocore
        # signs the payload unless told not to): it cost 0.7 CPU-s per GiB
        # uploaded (1.25 vs 0.54, 64 x 16 MiB parts to SeaweedFS), CPU the
        # server and the training job need. TLS (or TCP's checksum on a
        # loopback/LAN endpoint) guards the bytes; uploads check sizes.
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        retries={"total_max_attempts": 1, "mode": "standard"},  # ours: retry.py
        max_pool_connections=max_connections,
        # Neither timeout may outlast the operation's deadline (the caller's cap);
        # the read timeout is further cut per request to the time left.
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        tcp_keepalive=True,
        # Checksums only where the API demands them: S3-compatible servers
        # differ in their support for the newer default trailing checksums.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session._session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=timestamp)
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    client.meta.events.register("before-call.s3", partial(_cap_read_timeout, read_timeout))
    return client


def check(
    client: BaseClient, url: str, endpoint: str, bucket: str, prefix: str, *, deadline: float,
    classify: Callable[[Exception], Failure | None], observer: RequestObserver | None,
) -> None:
    """List one key under `prefix` with `client` (short timeouts; closed after): a
    one-line StoreError naming what is wrong."""
    try:
        call_with_retries(
            "list",
            f"check {url}",
            lambda: (
                client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1),
                0,
            ),
            deadline=min(deadline, CHECK_DEADLINE),
            classify=classify,
            observer=observer,
        )
    except StoreError as exc:
        kind = exc.kind
        if kind in ("no_bucket", "not_found"):  # some servers send a bare 404
            kind = "no_bucket"
            msg = f"bucket '{bucket}' does not exist at {endpoint}"
        elif exc.kind == "access_denied" and isinstance(exc.__cause__, ClientError):
            msg = (f"access denied to bucket '{bucket}': "
                   "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        else:
            cause = exc.__cause__
            failure = classify(cause) if isinstance(cause, Exception) else None
            msg = failure.reason if failure is not None else str(exc)
        raise StoreError(msg, errno_=exc.errno, kind=kind) from exc.__cause__
    finally:
        client.close()


def crt_engine(
    session: boto3.session.Session, client: BaseClient, bucket: str, *, part_size: int,
    max_connections: int, connect_timeout: float,
) -> CrtEngine:
    """The runtime client on `client`'s endpoint and region and `session`'s
    (refreshable) credentials and CA bundle (the caller holds the session's lock)."""
    ca_file = session._session.get_config_variable("ca_bundle")
    return CrtEngine(
        client.meta.endpoint_url,
        bucket,
        region=client.meta.region_name,
        credentials=session.get_credentials(),
        part_size=part_size,
        max_connections=max_connections,
        connect_timeout=connect_timeout,
        ca_file=ca_file or os.environ.get("REQUESTS_CA_BUNDLE"),
    )
