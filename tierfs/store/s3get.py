"""One ranged GET of the S3 store, over its attempts, through either engine.

`RangedGet` keeps what must hold across the attempts of one read: the bytes
already received (a retry asks only for the rest), the ETag of the first
answer (later attempts are pinned to it with If-Match, so versions are never
mixed) and the caller's buffer, sized by the first answer. Each attempt is
`via_crt` (the AWS Common Runtime: the default engine, crt.py), `via_crt_file`
(the runtime writing the body into a file itself) or `via_botocore`
(`[store] engine = "botocore"`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from awscrt.s3 import S3ResponseError
from botocore.client import BaseClient
from botocore.exceptions import ClientError
from botocore.response import StreamingBody

from tierfs.store.base import StoreError
from tierfs.store.crt import Answer, CrtEngine
from tierfs.store.s3errors import ShortBody

READ_SLICE = 1 << 20  # largest readinto() per call on a botocore response body
META_PREFIX = "x-amz-meta-"



def strip_etag(etag: str) -> str:
    return etag.strip('"')


def lower_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """User metadata as S3 returns it: names lowercased."""
    return {k.lower(): v for k, v in (metadata or {}).items()}


def quote_etag(etag: str) -> str:
    return f'"{strip_etag(etag)}"'


class RangedGet:
    """Bytes [start, start+length) of `key` (clipped at EOF) into alloc(clipped length)."""

    def __init__(
        self, key: str, full: str, start: int, length: int, etag: str | None,
        alloc: Callable[[int], memoryview],
        put: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """`put(offset in the range, piece)`: where the runtime's body pieces go
        instead of alloc()'s buffer (a file written at the object's offsets)."""
        self.key = key
        self.full = full
        self.start = start
        self.end = start + length - 1
        self.length = length
        self.done = 0
        self.pinned = etag
        self.alloc = alloc
        self.put = put
        self.metadata: dict[str, str] | None = None  # the first answer's user metadata
        self.target: memoryview | None = None

    def _answer(
        self, size: int, content_range: str | None, etag: str | None,
        metadata: Callable[[], dict[str, str] | None],
    ) -> int:
        """A 2xx answer promising `size` body bytes from start+done: checked; the
        body size to expect. Allocates the target on the first answer."""
        pos = self.start + self.done
        if content_range:
            total = content_range.rsplit("/", 1)[1]
            expect = max(0, min(self.end + 1, int(total)) - pos) if total != "*" else size
        elif pos == 0:  # server ignored Range and sent the whole object
            expect = size = min(self.length, size)
        else:
            raise StoreError("server ignored the Range header", errno_=errno.EIO, kind="io")
        if size != expect:
            raise ShortBody(f"{size} bytes for a {expect}-byte range")
        if etag is None:
            raise StoreError("GET answer without an ETag", errno_=errno.EIO, kind="io")
        if self.pinned is None:
            self.pinned = strip_etag(etag)
        if not self.done:
            self.metadata = metadata() or None
        if self.target is None:
            self.target = self.alloc(self.done + size)
        return size

    def _range(self) -> str:
        return f"bytes={self.start + self.done}-{self.end}"

    def via_crt(self, engine: CrtEngine) -> tuple[int, int]:
        """One attempt through the runtime: (bytes done, bytes this attempt)."""
        pos = self.start + self.done
        got = 0
        base = self.done

        def sink(offset: int, piece: bytes) -> None:
            nonlocal got
            if self.target is None:
                h = answer.headers
                size = (_range_length(h["content-range"]) if "content-range" in h
                        else int(h.get("content-length", "0")))
                self._answer(size, h.get("content-range"), h.get("etag"), lambda: _metadata(h))
            assert self.target is not None
            i = base + offset - pos
            if self.put is not None:
                self.put(i, piece)
            else:
                self.target[i : i + len(piece)] = piece
            if offset - pos == got:  # pieces arrive in order: the received prefix grows
                got += len(piece)
                self.done = base + got

        answer = Answer()
        try:
            engine.get(self.full, pos, self.end,
                       quote_etag(self.pinned) if self.pinned else None, sink, answer,
                       in_caller=self.put is not None)
        except S3ResponseError as exc:
            if exc.status_code == 416:  # starts at or past EOF (e.g. a zero-size object)
                return self.done, 0
            raise
        if self.target is None:  # an empty body (a zero-length range)
            h = answer.headers
            self._answer(0, h.get("content-range"), h.get("etag"), lambda: _metadata(h))
        return self.done, got

    def via_crt_file(self, engine: CrtEngine, fd: int) -> tuple[int, int]:
        """One attempt through the runtime writing the body into the file `fd` at the
        object's offsets itself (CrtEngine.get_to_file): (bytes done, bytes this
        attempt). Each attempt asks for the whole range: which parts a failed one
        wrote is not known, so none counts."""
        self.done = 0
        answer = Answer()
        try:
            engine.get_to_file(self.full, self.start, self.end,
                               quote_etag(self.pinned) if self.pinned else None, fd, answer)
        except S3ResponseError as exc:
            if exc.status_code == 416:  # starts at or past EOF (e.g. a zero-size object)
                return 0, 0
            raise
        h = answer.headers
        size = self._answer(answer.received, h.get("content-range"), h.get("etag"),
                            lambda: _metadata(h))
        self.done = size
        return size, size

    def via_botocore(self, client: BaseClient, bucket: str) -> tuple[int, int]:
        """One attempt through botocore's get_object: (bytes done, bytes this attempt)."""
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": self.full, "Range": self._range()}
        if self.pinned:
            kwargs["IfMatch"] = quote_etag(self.pinned)
        try:
            resp = client.get_object(**kwargs)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                return self.done, 0  # range starts at or past EOF (e.g. a zero-size object)
            raise
        body = resp["Body"]
        try:
            size = self._answer(int(resp["ContentLength"]), resp.get("ContentRange"),
                                resp.get("ETag"), lambda: resp.get("Metadata"))
            direct = _socket_readinto(body)
            assert self.target is not None
            view = self.target[self.done : self.done + size]
            got = 0
            while got < size:
                # Straight from the socket where it can; else bounded slices (urllib3's
                # readinto() allocates a temporary of the requested size).
                n = direct(view[got:]) if direct is not None else body.readinto(
                    view[got : got + READ_SLICE])
                if not n:
                    raise ShortBody(f"body ended after {got} of {size} bytes")
                got += n
                self.done += n
            if direct is not None:
                body._raw_stream.release_conn()  # what urllib3 does at the end of a body
            return self.done, got
        finally:
            body.close()


def file_writer(
    fd: int, start: int, on_piece: Callable[[int, bytes], None]
) -> Callable[[int, bytes], None]:
    """A RangedGet `put` for a range starting at object offset `start`: each piece
    written into `fd` at its object offset, then shown to `on_piece`."""

    def put(i: int, piece: bytes) -> None:
        view = memoryview(piece)
        pos = start + i
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
        on_piece(start + i, piece)

    return put


def _range_length(content_range: str) -> int:
    """Body length of a Content-Range 'bytes a-b/total' answer."""
    span = content_range.split(" ", 1)[-1].split("/", 1)[0]
    a, _, b = span.partition("-")
    return int(b) - int(a) + 1


def _metadata(headers: dict[str, str]) -> dict[str, str]:
    """User metadata from x-amz-meta-* headers (lowercased names, as S3 returns them)."""
    cut = len(META_PREFIX)
    return {k[cut:]: v for k, v in headers.items() if k.startswith(META_PREFIX)}


def _socket_readinto(body: Any) -> Callable[[memoryview], int] | None:
    """`readinto` of the http.client response under a plain botocore body: the bytes
    go from the socket straight into the caller's buffer. urllib3's own readinto
    reads into a temporary and copies it: in a profile of a cold 1 GiB read that
    was a second memcpy of every byte plus a fresh allocation per call. None
    where urllib3 must see the bytes (an encoded body, a checksum-validating
    wrapper, an unknown urllib3)."""
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
