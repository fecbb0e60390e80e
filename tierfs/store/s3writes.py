"""Writes of the S3 store that take more than one request, through botocore:
server-side copies (multipart above the copy limit, or to keep a multipart
ETag) and file uploads sent part by part (the `engine = "botocore"` path of
`S3Store.put_file`; the runtime's is one call: crt.py)."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, Protocol

from botocore.client import BaseClient

from tierfs.store.base import ObjectInfo, StoreError, part_size_for
from tierfs.store.s3get import lower_metadata, quote_etag, strip_etag


class S3Calls(Protocol):
    """What these writes use of the S3 store (s3.S3Store)."""

    bucket: str
    part_size: int
    multipart_copy_threshold: int
    copy_part_size: int
    _client: BaseClient

    def _full(self, key: str) -> str: ...
    def _simple(self, op: str, key: str, method: Callable[..., dict[str, Any]], nbytes: int = 0,
                **kwargs: Any) -> dict[str, Any]: ...
    @staticmethod
    def _response_time(resp: dict[str, Any]) -> float: ...
    def may_be_typed(self, etag: str) -> bool: ...
    def put_bytes(self, key: str, data: bytes | memoryview, *,
                  metadata: dict[str, str] | None = None, if_match: str | None = None,
                  if_none_match: bool = False, typed: bool = False) -> ObjectInfo: ...
    def create_upload(self, key: str, *, metadata: dict[str, str] | None = None) -> str: ...
    def upload_part(self, key: str, upload_id: str, number: int, offset: int,
                    data: bytes | memoryview, *, content_md5: str | None = None) -> str: ...
    def complete_upload(self, key: str, upload_id: str, parts: list[tuple[int, str]], size: int,
                        *, if_match: str | None = None,
                        if_none_match: bool = False) -> ObjectInfo: ...
    def abort_upload(self, key: str, upload_id: str) -> None: ...
    def delete(self, key: str) -> None: ...

TYPED_MAX = 1 << 20  # a multipart source up to this size may be typed: copied as multipart


def put_file_parts(
    store: S3Calls,
    key: str,
    path: str,
    metadata: dict[str, str] | None,
    if_match: str | None,
    if_none_match: bool,
    progress: Callable[[int], None] | None,
) -> ObjectInfo:
    """Upload `path`: one PUT up to part_size, else a multipart upload of one
    part at a time. `progress(n)` is called once per acknowledged part."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size <= store.part_size:
            data = f.read()
            if len(data) != st.st_size:
                raise StoreError(
                    f"{path}: changed while uploading", errno_=errno.EIO, kind="io"
                )
            info = store.put_bytes(
                key, data, metadata=metadata, if_match=if_match, if_none_match=if_none_match
            )
            if progress is not None:
                progress(len(data))
            return info
        size = st.st_size
        part = part_size_for(size, store.part_size)
        upload_id = store.create_upload(key, metadata=metadata)
        try:
            parts = []
            for number, offset in enumerate(range(0, size, part), 1):
                data = os.pread(f.fileno(), min(part, size - offset), offset)
                if len(data) != min(part, size - offset):
                    raise StoreError(
                        f"{key}: local file shrank while uploading", errno_=errno.EIO, kind="io"
                    )
                parts.append((number, store.upload_part(key, upload_id, number, offset, data)))
                if progress is not None:
                    progress(len(data))
            after = os.fstat(f.fileno())
            if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise StoreError(
                    f"{key}: local file changed while uploading", errno_=errno.EIO, kind="io"
                )
            info = store.complete_upload(key, upload_id, parts, size, if_match=if_match,
                                        if_none_match=if_none_match)
        except BaseException:
            store.abort_upload(key, upload_id)
            raise
    return ObjectInfo(key, size, info.etag, info.mtime, lower_metadata(metadata))



def copy_version(
    store: S3Calls, info: ObjectInfo, dst: str, metadata: dict[str, str] | None,
    *, typed: bool = False,
) -> ObjectInfo:
    """Copy the object version `info` to `dst` (CopySourceIfMatch its ETag: 412 if
    it moved meanwhile), with its user metadata or `metadata` in its place."""
    source = {"Bucket": store.bucket, "Key": store._full(info.key)}
    full = store._full(dst)
    meta = dict(info.metadata) if metadata is None else lower_metadata(metadata)
    as_multipart = info.size > store.multipart_copy_threshold or (
        info.size <= TYPED_MAX and (typed or store.may_be_typed(info.etag)))
    if not as_multipart:
        extra: dict[str, Any] = {}
        if metadata is not None:
            extra = {"MetadataDirective": "REPLACE", "Metadata": metadata}
        resp = store._simple(
            "copy",
            dst,
            store._client.copy_object,
            Bucket=store.bucket,
            Key=full,
            CopySource=source,
            CopySourceIfMatch=quote_etag(info.etag),
            **extra,
        )
        result = resp["CopyObjectResult"]
        mtime = (
            result["LastModified"].timestamp()
            if isinstance(result.get("LastModified"), datetime)
            else store._response_time(resp)
        )
        return ObjectInfo(dst, info.size, strip_etag(result["ETag"]), mtime, meta)

    # A small multipart source stays multipart (CopyObject would give it a plain
    # MD5 ETag and hide from listings that it may be typed: see may_be_typed).
    part = part_size_for(info.size, store.copy_part_size)
    count = max(1, -(-info.size // part))

    def send(number: int) -> dict[str, Any]:
        first = (number - 1) * part
        last = min(first + part, info.size) - 1
        # (an empty source has no byte range: its one part is the whole of it)
        whole: dict[str, Any] = {} if last < first else {"CopySourceRange": f"bytes={first}-{last}"}
        resp = store._simple(
            "copy",
            dst,
            store._client.upload_part_copy,
            Bucket=store.bucket,
            Key=full,
            UploadId=upload_id,
            PartNumber=number,
            CopySource=source,
            CopySourceIfMatch=quote_etag(info.etag),
            **whole,
        )
        return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

    created = store._simple(
        "copy",
        dst,
        store._client.create_multipart_upload,
        Bucket=store.bucket,
        Key=full,
        Metadata=meta,
    )
    upload_id: str = created["UploadId"]
    try:
        parts = [send(n) for n in range(1, count + 1)]
        resp = store._simple(
            "copy",
            dst,
            store._client.complete_multipart_upload,
            Bucket=store.bucket,
            Key=full,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        store.abort_upload(dst, upload_id)
        raise
    return ObjectInfo(dst, info.size, strip_etag(resp["ETag"]), store._response_time(resp), meta)



def put_typed(
    store: S3Calls, key: str, data: bytes | memoryview, metadata: dict[str, str],
    if_match: str | None, if_none_match: bool,
) -> ObjectInfo:
    """A one-part multipart upload: its ETag ('<md5>-1') is what a listing shows
    of it (ListObjectsV2 carries no user metadata). Three requests, for objects
    that are made rarely and listed often."""
    upload_id = store.create_upload(key, metadata=metadata)
    try:
        part = store.upload_part(key, upload_id, 1, 0, data)
        info = store.complete_upload(key, upload_id, [(1, part)], len(data),
                                     if_match=if_match, if_none_match=if_none_match)
    except BaseException:
        store.abort_upload(key, upload_id)
        raise
    return replace(info, metadata=lower_metadata(metadata))


def conditions_enforced(store: S3Calls) -> bool:
    """Whether the store refuses a second PUT If-None-Match: * of a probe key."""
    key = f".tierfs-probe-{uuid.uuid4().hex}"
    try:
        store.put_bytes(key, b"", if_none_match=True)
        try:
            store.put_bytes(key, b"", if_none_match=True)
            return False
        except StoreError as exc:
            if exc.kind != "precondition":
                raise
            return True
    except StoreError as exc:
        if exc.kind != "invalid":  # 400/501: the server rejects the header outright
            raise
        return False
    finally:
        store.delete(key)
