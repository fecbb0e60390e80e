"""The one small protocol every object store adapter implements.

Keys are always relative to the mount's source root (the adapter owns the
bucket and prefix). Every method is blocking; callers run them in worker
threads with a capacity limit. Failures surface as `StoreError` carrying an
errno, so the FUSE layer can answer with it directly.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # without quotes
    mtime: float  # seconds since the epoch
    metadata: dict[str, str] = field(default_factory=dict)  # user metadata (not in listings)


@dataclass(frozen=True)
class Received:
    """What a ranged GET put into the caller's buffer (`length` bytes) and what its
    response said of the object: its ETag, and its user metadata where the adapter
    sees it (S3: every response; file://: a read from offset 0), else None. The
    read path passes both up as return values (no callback fires in the GET)."""

    length: int
    etag: str
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class Listing:
    """Direct children of one prefix: objects and sub-prefixes (names, no slash)."""

    files: list[ObjectInfo]
    dirs: list[str]


class StoreError(Exception):
    """A store failure already classified: `errno` for FUSE, `kind` for metrics.

    kinds: not_found, no_bucket, access_denied, unreachable, precondition,
    changed (ETag moved under a ranged read), throttled, timeout, io, invalid.
    """

    def __init__(self, message: str, *, errno_: int = errno.EIO, kind: str = "io"):
        super().__init__(message)
        self.errno = errno_
        self.kind = kind


def key_too_long(url: str, key: str, full: str, limit: int) -> StoreError | None:
    """The error for a key whose full store form is over `limit` bytes, else None."""
    n = len(full.encode("utf-8", "surrogateescape"))
    if n <= limit:
        return None
    return StoreError(
        f"'{url.rstrip('/')}/{key[:40]}...': key of {n} bytes is over the store's limit of {limit}",
        errno_=errno.ENAMETOOLONG,
        kind="invalid",
    )


# Kinds that mean "the store is away", not "the request is wrong": degraded mode
# and work that waits for the store to return (journaled uploads, dir markers).
UNREACHABLE_KINDS = frozenset({"unreachable", "timeout", "throttled"})

# Kinds the store will answer again the same way however often it is asked
# (4xx other than throttling and timeouts: KeyTooLong, AccessDenied,
# EntityTooLarge, InvalidArgument, no such bucket): an upload refused so is
# not retried but quarantined (writeback/uploader.py).
PERMANENT_KINDS = frozenset({"access_denied", "invalid", "no_bucket"})

MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)
MAX_PARTS = 10_000


def part_size_for(size: int, base: int) -> int:
    """`base` (at least MIN_PART), grown in whole MiB to stay within MAX_PARTS parts."""
    part = max(base, MIN_PART)
    if -(-size // part) > MAX_PARTS:
        part = -(-size // (MAX_PARTS << 20)) << 20
    return part


# Called once per store request: (op, outcome, seconds, bytes). outcome is
# "ok", "retry" or a StoreError kind. Used for metrics; must be cheap.
RequestObserver = Callable[[str, str, float, int], None]


class Store(Protocol):
    url: str  # display form, never with secrets: s3://bucket/prefix or file:///path
    identity: str  # stable id of (endpoint, bucket, prefix) for cache naming
    supports_conditional_put: bool
    # Multipart uploads a later daemon can find and abort by id, and object tags:
    # what sending parts while a file is written needs (writeback/streaming.py).
    streams_parts: bool

    @property
    def uploads_files(self) -> bool:
        """put_file reads the file itself and sends its parts in parallel (the transfer
        engine): the uploader hands it the sealed cache file instead of sending parts."""

    def check(self) -> None:
        """Verify the source exists and the credentials work; raise StoreError with a one-line reason."""

    def check_key(self, key: str) -> None:
        """Raise StoreError(ENAMETOOLONG) if `key` (with the source's prefix) is
        longer than the store takes, before anything is written under it."""

    def head(self, key: str) -> ObjectInfo: ...

    def list_dir(self, prefix: str) -> Listing:
        """Children of `prefix` ('' or ending in '/'), all pages; excludes the marker `prefix` itself."""

    def get_range(self, key: str, start: int, length: int, etag: str | None = None) -> bytes:
        """Bytes [start, start+length) clipped at EOF. With `etag`, StoreError(kind='changed', ESTALE) if it moved."""

    def get_range_into(
        self, key: str, start: int, length: int, buf: memoryview, etag: str | None = None
    ) -> Received:
        """As get_range, but into buf[:length] without an extra copy; the bytes read
        and what the response said of the object."""

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
        """Upload a local file (multipart when large). Conditional failures raise
        StoreError(kind='precondition', errno ESTALE). `progress(n)` may be called
        from any thread."""

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
        """Store `data` under `key`. `typed`: an object whose metadata a listing would
        mislead about (a symlink, FIFO, socket, an executable: posix.listing_misleads),
        stored so that a listing shows it may be typed: see may_be_typed."""

    def may_be_typed(self, etag: str) -> bool:
        """Whether an object listed with `etag` may be typed by metadata the listing
        does not carry (a HEAD tells). False: a regular file as far as any tierfs
        wrote it, and `ls -l` of a directory of small objects costs no HEADs."""

    def create_upload(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        """Start a multipart upload of `key`; its upload id."""

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes | memoryview,
        *, content_md5: str | None = None,
    ) -> str:
        """Send part `number` (1-based; it holds the object's bytes from `offset`); its ETag.
        Every part but the last is at least 5 MiB. With `content_md5` (base64) the
        store refuses a part that does not match it."""

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
        """Publish the parts (number, ETag) as the `size`-byte object, under the condition
        given (StoreError(kind='precondition') if it fails). Metadata is create_upload's."""

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts; best effort."""

    def put_tags(self, key: str, tags: dict[str, str]) -> None:
        """Set the object's tags (S3 PutObjectTagging: they replace the old set)."""

    def get_tags(self, key: str) -> dict[str, str]:
        """The object's tags."""

    def probe_conditional_put(self) -> bool:
        """Whether the store enforces If-Match / If-None-Match: * on writes."""

    def copy(self, src: str, dst: str, *, metadata: dict[str, str] | None = None) -> ObjectInfo:
        """Server-side copy (multipart copy above 5 GiB, and of a source that may be
        typed: the copy may be too) with the source's user metadata, or with
        `metadata` in its place."""

    def replace_metadata(
        self, key: str, update: dict[str, str], *, etag: str, typed: bool = False
    ) -> ObjectInfo:
        """`update` over the user metadata of the object at version `etag`, its bytes
        untouched (S3: CopyObject onto itself, metadata REPLACE). A new ETag, except
        where the store changes metadata in place. StoreError(kind='precondition')
        if the object is no longer that version. `typed`: the new version is one
        listings show as maybe typed (as put_bytes's)."""

    def delete(self, key: str) -> None:
        """Delete; deleting a missing key is not an error."""
