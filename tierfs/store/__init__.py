"""Object store adapters behind one small protocol (see base.py).

`open_store` turns a mount SOURCE (s3://bucket[/prefix] or file:///path) into
a Store; nothing above this package knows which kind it got.
"""

from __future__ import annotations

import errno
import os
import re
from typing import TYPE_CHECKING

from tierfs.config import (
    CONNECT_TIMEOUT,
    DEADLINE,
    MAX_CONNECTIONS,
    MAX_KEY_BYTES,
    PART_SIZE,
    READ_TIMEOUT,
)
from tierfs.store.base import Listing, ObjectInfo, RequestObserver, Store, StoreError
from tierfs.store.local import LocalStore
from tierfs.store.s3 import S3Store

if TYPE_CHECKING:
    import boto3

__all__ = [
    "Listing",
    "LocalStore",
    "ObjectInfo",
    "RequestObserver",
    "S3Store",
    "Store",
    "StoreError",
    "bucket_name_problem",
    "open_store",
    "parse_source",
]


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


def bucket_name_problem(name: str) -> str | None:
    """Why `name` is not a valid S3 bucket name, or None."""
    if not 3 <= len(name) <= 63:
        return f"must be 3-63 characters long (got {len(name)})"
    if not _BUCKET_RE.match(name):
        return "may only contain lowercase letters, digits, '.' and '-', and must start and end with a letter or digit"
    if ".." in name or ".-" in name or "-." in name:
        return "must not contain '..', '.-' or '-.'"
    if _IPV4_RE.match(name):
        return "must not look like an IP address"
    return None


def parse_source(url: str) -> tuple[str, str, str]:
    """Split a SOURCE into (scheme, bucket or absolute path, prefix).

    The prefix is '' or ends in '/' ("s3://b/x/y/" and "s3://b/x/y" both give
    "x/y/"); file:// sources have no prefix. The path is taken literally (no
    percent-decoding). Malformed sources raise StoreError(kind='invalid').
    """
    usage = StoreError(
        f"invalid source {url!r}: expected s3://bucket[/prefix] or file:///path",
        errno_=errno.EINVAL,
        kind="invalid",
    )
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or "\0" in rest:
        raise usage
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise usage
        problem = bucket_name_problem(bucket)
        if problem:
            raise StoreError(
                f"invalid bucket name {bucket!r} in source {url!r}: {problem}",
                errno_=errno.EINVAL,
                kind="invalid",
            )
        prefix = prefix.strip("/")
        return "s3", bucket, f"{prefix}/" if prefix else ""
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise usage
        return "file", os.path.normpath("/" + path), ""
    raise usage


def open_store(
    url: str,
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
) -> Store:
    """The Store for SOURCE `url`. Makes no request: call `check()` to verify it.
    `engine`, `session`: S3 only (S3Store)."""
    scheme, where, prefix = parse_source(url)
    if scheme == "file":
        return LocalStore(where, observer=observer, max_key_bytes=max_key_bytes)
    return S3Store(
        where,
        prefix,
        endpoint_url=endpoint_url,
        part_size=part_size,
        max_connections=max_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        deadline=deadline,
        observer=observer,
        max_key_bytes=max_key_bytes,
        engine=engine,
        session=session,
    )
