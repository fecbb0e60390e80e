"""file:// adapter: the same protocol over a directory tree (e.g. an NFS share).

Keys map to paths under the root; directories are prefixes, and a dir marker
("a/" with empty data) is a directory. Writes land in a temp file in the
target directory and are published with os.replace, so readers never see a
partial object. The ETag is derived from stat (mtime_ns, size, inode): every
publish makes a new inode, so it changes on any write.

User metadata lives in `user.tierfs.meta.*` xattrs. On a filesystem without
user xattrs it is not persisted (head returns {}): there is no sidecar file.

Conditional puts compare the current ETag under a process-wide mutex plus a
POSIX lock on `<root>/.tierfs-lock`; over NFS that lock is only as good as the
server's lock manager (best effort). Symlinks inside the root are followed like
any other content; only the keys themselves are confined to the root.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace

from tierfs.config import MAX_KEY_BYTES
from tierfs.store.base import (
    Listing,
    ObjectInfo,
    Received,
    RequestObserver,
    StoreError,
    key_too_long,
)
from tierfs.store.localparts import NO_XATTR, LocalUploads, get_tags, set_tags

log = logging.getLogger("tierfs.store")

HIDDEN_PREFIX = ".tierfs-"  # lock and temp files; never listed, never valid keys
META_XATTR = "user.tierfs.meta."
COPY_CHUNK = 8 << 20

# POSIX locks are per process, so threads of this process also need a mutex.
_PROCESS_LOCK = threading.Lock()

_KIND_BY_ERRNO = {
    errno.ENOENT: "not_found",
    errno.EACCES: "access_denied",
    errno.EPERM: "access_denied",
    errno.EROFS: "access_denied",
    errno.EISDIR: "invalid",
    errno.ENOTDIR: "invalid",
    errno.ENAMETOOLONG: "invalid",
    errno.EINVAL: "invalid",
    errno.EEXIST: "invalid",
}


def etag_of(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"


def _invalid(message: str) -> StoreError:
    return StoreError(message, errno_=errno.EINVAL, kind="invalid")


def _read_meta(fd: int) -> dict[str, str]:
    try:
        names = [n for n in os.listxattr(fd) if n.startswith(META_XATTR)]
        return {n[len(META_XATTR) :]: os.getxattr(fd, n).decode("utf-8", "replace") for n in names}
    except OSError as exc:
        if exc.errno in NO_XATTR:
            return {}
        raise


def _lower(metadata: dict[str, str] | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (metadata or {}).items()}


def _write_meta(fd: int, metadata: dict[str, str]) -> None:
    for name, value in metadata.items():
        try:
            os.setxattr(fd, META_XATTR + name.lower(), value.encode())
        except OSError as exc:
            if exc.errno not in NO_XATTR:
                raise
            log.debug("user xattrs unsupported here: object metadata not kept")
            return


def _copy_fd(src: int, dst: int, progress: Callable[[int], None] | None) -> None:
    """Copy src to dst from their current offsets: copy_file_range (server-side on
    NFS 4.2, reflink where possible), read/write where the kernel refuses."""
    use_cfr = True
    while True:
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, COPY_CHUNK)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
                continue
        else:
            data = os.read(src, COPY_CHUNK)
            n = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view) :]
        if n == 0:
            return
        if progress is not None:
            progress(n)


class LocalStore:
    """`Store` over a directory tree."""

    supports_conditional_put = True
    # Its multipart uploads live in this process only: a restart cannot abort
    # them by id, so files go up after their seal only.
    streams_parts = False
    uploads_files = False  # the uploader's parallel parts; put_file is one copy

    def __init__(
        self, root: str, *, observer: RequestObserver | None = None,
        max_key_bytes: int = MAX_KEY_BYTES,
    ) -> None:
        self.root = os.path.normpath(root)
        self.max_key_bytes = max_key_bytes
        self.url = f"file://{self.root}"
        self.identity = f"file|{self.root}"
        self.observer = observer
        self._lock_fd: int | None = None
        self._uploads = LocalUploads(self._op, self._temp_beside, self._publish)

    def probe_conditional_put(self) -> bool:
        """Nothing to probe: conditions are checked here, under the lock."""
        return True

    # -- plumbing ---------------------------------------------------------------

    def _path(self, key: str) -> str:
        """The path of `key`; keys that could leave the root or hit our own files are refused."""
        if not key:
            raise _invalid("empty object key")
        if "\0" in key or key.startswith("/"):
            raise _invalid(f"invalid key {key!r}: absolute or contains NUL")
        for part in key.split("/"):
            if part == "..":
                raise _invalid(f"invalid key {key!r}: '..' segment")
            if part.startswith(HIDDEN_PREFIX):
                raise _invalid(f"invalid key {key!r}: {HIDDEN_PREFIX}* names are reserved")
        self.check_key(key)
        return os.path.join(self.root, key)

    def check_key(self, key: str) -> None:
        """Keys are measured without the root, as an S3 key is without its bucket."""
        err = key_too_long(self.url, key, key, self.max_key_bytes)
        if err is not None:
            raise err

    @contextmanager
    def _op(self, op: str, key: str) -> Iterator[list[int]]:
        """Time one operation for the observer; OSError becomes StoreError. Yields a byte counter."""
        t0 = time.monotonic()
        nbytes = [0]
        try:
            yield nbytes
        except OSError as exc:
            code = exc.errno or errno.EIO
            if code == errno.ENOTDIR and op in ("head", "get"):
                code = errno.ENOENT  # "a/b" where "a" is a file: simply no such object
            err = StoreError(
                f"{op} '{self.url}/{key}': {os.strerror(code)}",
                errno_=code,
                kind=_KIND_BY_ERRNO.get(code, "io"),
            )
            self._report(op, err.kind, t0, 0)
            raise err from exc
        except StoreError as exc:
            self._report(op, exc.kind, t0, 0)
            raise
        self._report(op, "ok", t0, nbytes[0])

    def _report(self, op: str, outcome: str, t0: float, nbytes: int) -> None:
        if self.observer is not None:
            self.observer(op, outcome, time.monotonic() - t0, nbytes)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with _PROCESS_LOCK:
            if self._lock_fd is None:
                self._lock_fd = os.open(
                    os.path.join(self.root, HIDDEN_PREFIX + "lock"),
                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                    0o666,
                )
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._lock_fd, fcntl.LOCK_UN)

    @staticmethod
    def _check_condition(key: str, path: str, if_match: str | None, if_none_match: bool) -> None:
        if if_match is not None and if_none_match:
            raise _invalid("if_match and if_none_match are exclusive")
        if if_match is None and not if_none_match:
            return
        try:
            current: str | None = etag_of(os.stat(path))
        except FileNotFoundError:
            current = None
        if (if_none_match and current is not None) or (
            if_match is not None and current != if_match
        ):
            raise StoreError(
                f"put '{key}': precondition failed",
                errno_=errno.ESTALE,
                kind="precondition",
            )

    def _temp_beside(self, key: str) -> str:
        path = self._path(key)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        return os.path.join(parent, f"{HIDDEN_PREFIX}tmp-{uuid.uuid4().hex}")

    def _publish(
        self,
        key: str,
        fill: Callable[[int], None],
        metadata: dict[str, str],
        if_match: str | None,
        if_none_match: bool,
        tmp: str | None = None,
    ) -> ObjectInfo:
        """Write via `fill(fd)` to a temp file beside the target (or into `tmp`, one
        made by `_temp_beside`), then os.replace it in."""
        path = self._path(key)
        parent = os.path.dirname(path)
        if tmp is None:
            tmp = self._temp_beside(key)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            fill(fd)
            _write_meta(fd, metadata)
            os.fsync(fd)
            st = os.fstat(fd)
            with self._locked():
                self._check_condition(key, path, if_match, if_none_match)
                os.replace(tmp, path)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return ObjectInfo(
            key, st.st_size, etag_of(st), st.st_mtime, {k.lower(): v for k, v in metadata.items()}
        )

    def _make_marker(
        self, key: str, if_none_match: bool, metadata: dict[str, str] | None = None
    ) -> ObjectInfo:
        path = self._path(key)
        with self._locked():
            if if_none_match and os.path.isdir(path):
                raise StoreError(
                    f"put '{key}': precondition failed (exists)",
                    errno_=errno.ESTALE,
                    kind="precondition",
                )
            os.makedirs(path, exist_ok=True)
        if metadata:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _write_meta(fd, metadata)
            finally:
                os.close(fd)
        st = os.stat(path)
        return ObjectInfo(key, 0, etag_of(st), st.st_mtime, _lower(metadata))

    # -- Store protocol ---------------------------------------------------------

    def check(self) -> None:
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise StoreError(
                f"{self.url}: no such directory", errno_=errno.ENOENT, kind="no_bucket"
            ) from None
        except PermissionError:
            raise StoreError(
                f"{self.url}: permission denied", errno_=errno.EACCES, kind="access_denied"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(f"{self.url}: not a directory", errno_=errno.ENOTDIR, kind="invalid")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise StoreError(
                f"{self.url}: permission denied", errno_=errno.EACCES, kind="access_denied"
            )

    def head(self, key: str) -> ObjectInfo:
        with self._op("head", key):
            path = self._path(key)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                is_dir = stat.S_ISDIR(st.st_mode)
                # A bare prefix (directory without '/') is not an object; nor is a file "x/".
                if is_dir != key.endswith("/"):
                    raise FileNotFoundError(errno.ENOENT, "no such object")
                return ObjectInfo(
                    key, 0 if is_dir else st.st_size, etag_of(st), st.st_mtime, _read_meta(fd)
                )
            finally:
                os.close(fd)

    def list_dir(self, prefix: str) -> Listing:
        if prefix and not prefix.endswith("/"):
            raise _invalid(f"list prefix {prefix!r} must end with '/'")
        with self._op("list", prefix):
            directory = self._path(prefix) if prefix else self.root
            files: list[ObjectInfo] = []
            dirs: list[str] = []
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return Listing(files=[], dirs=[])
            for entry in entries:
                if entry.name.startswith(HIDDEN_PREFIX):
                    continue
                try:
                    if entry.is_dir():
                        dirs.append(entry.name)
                    elif entry.is_file():
                        st = entry.stat()
                        files.append(
                            ObjectInfo(prefix + entry.name, st.st_size, etag_of(st), st.st_mtime)
                        )
                except OSError:  # vanished, dangling or looping symlink: not an object
                    continue
            return Listing(files=files, dirs=dirs)

    def get_range(self, key: str, start: int, length: int, etag: str | None = None) -> bytes:
        held: list[bytearray] = []

        def alloc(size: int) -> memoryview:
            held.append(bytearray(size))
            return memoryview(held[0])

        n = self._read(key, start, length, etag, alloc).length
        if not held:
            return b""
        return bytes(held[0]) if n == len(held[0]) else bytes(memoryview(held[0])[:n])

    def get_range_into(
        self, key: str, start: int, length: int, buf: memoryview, etag: str | None = None
    ) -> Received:
        if len(buf) < length:
            raise _invalid(f"buffer of {len(buf)} bytes for a {length}-byte range")
        return self._read(key, start, length, etag, lambda _size: buf)

    def _read(
        self,
        key: str,
        start: int,
        length: int,
        etag: str | None,
        alloc: Callable[[int], memoryview],
    ) -> Received:
        """pread [start, start+length) clipped at EOF into alloc(clipped length); the
        file's xattrs are its user metadata (read from offset 0 only)."""
        if start < 0 or length < 0:
            raise _invalid(f"bad range start={start} length={length}")
        with self._op("get", key) as nbytes:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode) != key.endswith("/"):
                    raise FileNotFoundError(errno.ENOENT, "no such object")
                if etag is not None and etag_of(st) != etag:
                    raise StoreError(
                        f"get '{key}': object changed", errno_=errno.ESTALE, kind="changed"
                    )
                seen = Received(0, etag_of(st), (_read_meta(fd) or None) if start == 0 else None)
                want = 0 if stat.S_ISDIR(st.st_mode) else min(length, max(0, st.st_size - start))
                if want == 0:
                    return seen
                buf = alloc(want)
                got = 0
                while got < want:
                    n = os.preadv(fd, [buf[got:want]], start + got)
                    if n == 0:  # truncated since fstat
                        break
                    got += n
                nbytes[0] = got
                return replace(seen, length=got)
            finally:
                os.close(fd)

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
        if key.endswith("/"):
            raise _invalid(f"put '{key}': a key ending in '/' is a directory marker")
        with self._op("put", key) as nbytes:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                info = self._publish(
                    key,
                    lambda fd: _copy_fd(src, fd, progress),
                    metadata or {},
                    if_match,
                    if_none_match,
                )
            finally:
                os.close(src)
            nbytes[0] = info.size
            return info

    def put_bytes(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        metadata: dict[str, str] | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
        typed: bool = False,  # (every object here may be: see may_be_typed)
    ) -> ObjectInfo:
        with self._op("put", key) as nbytes:
            if key.endswith("/"):
                if data:
                    raise _invalid(f"put '{key}': a directory marker cannot hold data")
                return self._make_marker(key, if_none_match, metadata)

            def fill(fd: int) -> None:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]

            nbytes[0] = len(data)
            return self._publish(key, fill, metadata or {}, if_match, if_none_match)

    def may_be_typed(self, etag: str) -> bool:
        """Always: a listing here carries no xattrs, and a HEAD is one getxattr."""
        return True

    def create_upload(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        return self._uploads.create(key, metadata or {})

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes | memoryview,
        *, content_md5: str | None = None,
    ) -> str:
        return self._uploads.part(key, upload_id, number, offset, data)

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
        return self._uploads.complete(key, upload_id, size, if_match, if_none_match)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._uploads.abort(upload_id)

    def put_tags(self, key: str, tags: dict[str, str]) -> None:
        """Tags are `user.tierfs.tag.*` xattrs (not kept where xattrs are not)."""
        with self._op("tagging", key):
            set_tags(self._path(key), tags)

    def get_tags(self, key: str) -> dict[str, str]:
        with self._op("tagging", key):
            return get_tags(self._path(key))

    def copy(self, src: str, dst: str, *, metadata: dict[str, str] | None = None) -> ObjectInfo:
        with self._op("copy", dst):
            if src.endswith("/") or dst.endswith("/"):
                if not (src.endswith("/") and dst.endswith("/")):
                    raise _invalid(
                        f"copy '{src}' -> '{dst}': cannot copy between a marker and an object"
                    )
                if not os.path.isdir(self._path(src)):
                    raise FileNotFoundError(errno.ENOENT, "no such object")
                return self._make_marker(dst, False, metadata)
            fd = os.open(self._path(src), os.O_RDONLY | os.O_CLOEXEC)
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise FileNotFoundError(errno.ENOENT, "no such object")
                meta = _read_meta(fd) if metadata is None else metadata
                return self._publish(dst, lambda out: _copy_fd(fd, out, None), meta, None, False)
            finally:
                os.close(fd)

    def replace_metadata(
        self, key: str, update: dict[str, str], *, etag: str, typed: bool = False
    ) -> ObjectInfo:
        """`update` over the object's user metadata (xattrs, in place: the bytes and
        the ETag stay), if the object is still the version `etag` names. (`typed`:
        every object here may be: see may_be_typed.)"""
        with self._op("copy", key), self._locked():
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode) != key.endswith("/"):
                    raise FileNotFoundError(errno.ENOENT, "no such object")
                if etag_of(st) != etag:
                    raise StoreError(f"'{key}': changed in the store", errno_=errno.ESTALE,
                                     kind="precondition")
                _write_meta(fd, update)
                return ObjectInfo(key, 0 if key.endswith("/") else st.st_size, etag, st.st_mtime,
                                  _read_meta(fd))
            finally:
                os.close(fd)

    def delete(self, key: str) -> None:
        with self._op("delete", key):
            path = self._path(key)
            with self._locked():
                try:
                    if key.endswith("/"):
                        os.rmdir(path)
                    else:
                        os.unlink(path)
                except OSError as exc:
                    # Missing, a bare prefix, or a marker whose directory still has children:
                    # on S3 none of these leaves anything to delete either.
                    if exc.errno not in (
                        errno.ENOENT,
                        errno.EISDIR,
                        errno.ENOTEMPTY,
                        errno.ENOTDIR,
                    ):
                        raise
