"""The file:// store's multipart uploads and object tags (see local.py).

A multipart upload is a temp file beside its key: parts land at their offsets,
completing publishes it as any write is published (os.replace). Uploads live in
this process only. Tags are `user.tierfs.tag.*` xattrs.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress

from tierfs.store.base import ObjectInfo, StoreError

# The store's own steps (local.LocalStore): time an operation and map its OSError
# (yields a byte counter), make a temp file beside a key, publish a temp file.
Op = Callable[[str, str], AbstractContextManager[list[int]]]
Publish = Callable[[str, Callable[[int], None], dict[str, str], str | None, bool, str],
                   ObjectInfo]

TAG_XATTR = "user.tierfs.tag."
NO_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENODATA, errno.EPERM)


class LocalUploads:
    """Multipart uploads in progress: id -> (key, temp file, metadata)."""

    def __init__(self, op: Op, temp_beside: Callable[[str], str], publish: Publish) -> None:
        self._op = op
        self._temp_beside = temp_beside
        self._publish = publish
        self._uploads: dict[str, tuple[str, str, dict[str, str]]] = {}
        self._mu = threading.Lock()

    def create(self, key: str, metadata: dict[str, str]) -> str:
        if key.endswith("/"):
            raise StoreError(f"put '{key}': a key ending in '/' is a directory marker",
                             errno_=errno.EINVAL, kind="invalid")
        with self._op("multipart", key):
            tmp = self._temp_beside(key)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
            upload_id = uuid.uuid4().hex
            with self._mu:
                self._uploads[upload_id] = (key, tmp, dict(metadata))
            return upload_id

    def _find(self, key: str, upload_id: str) -> tuple[str, dict[str, str]]:
        with self._mu:
            found = self._uploads.get(upload_id)
        if found is None or found[0] != key:
            raise StoreError(f"no upload {upload_id} of '{key}'", errno_=errno.ENOENT,
                             kind="not_found")
        return found[1], found[2]

    def part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes | memoryview
    ) -> str:
        with self._op("multipart", key) as nbytes:
            tmp, _ = self._find(key, upload_id)
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            try:
                view = memoryview(data).cast("B")
                pos = offset
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
            finally:
                os.close(fd)
            nbytes[0] = len(data)
            return f"{number}-{offset:x}-{len(data):x}"

    def complete(
        self, key: str, upload_id: str, size: int, if_match: str | None, if_none_match: bool
    ) -> ObjectInfo:
        with self._op("multipart", key):
            tmp, metadata = self._find(key, upload_id)
            if os.stat(tmp).st_size != size:
                raise StoreError(f"complete '{key}': parts hold {os.stat(tmp).st_size} bytes, "
                                 f"not {size}", errno_=errno.EIO, kind="io")
            info = self._publish(key, lambda fd: None, metadata, if_match, if_none_match,
                                       tmp)
            with self._mu:
                self._uploads.pop(upload_id, None)
            return info

    def abort(self, upload_id: str) -> None:
        with self._mu:
            found = self._uploads.pop(upload_id, None)
        if found is not None:
            with suppress(FileNotFoundError):
                os.unlink(found[1])


def set_tags(path: str, tags: dict[str, str]) -> None:
    """Replace the object's tags (nothing is kept where xattrs are not)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            for name in [n for n in os.listxattr(fd) if n.startswith(TAG_XATTR)]:
                os.removexattr(fd, name)
            for name, value in tags.items():
                os.setxattr(fd, TAG_XATTR + name, value.encode())
        except OSError as exc:
            if exc.errno not in NO_XATTR:
                raise
    finally:
        os.close(fd)


def get_tags(path: str) -> dict[str, str]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        names = [n for n in os.listxattr(fd) if n.startswith(TAG_XATTR)]
        return {n[len(TAG_XATTR):]: os.getxattr(fd, n).decode("utf-8", "replace")
                for n in names}
    except OSError as exc:
        if exc.errno in NO_XATTR:
            return {}
        raise
    finally:
        os.close(fd)
