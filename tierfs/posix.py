"""POSIX attributes as plain object user metadata (DESIGN §6).

The convention is s3fs's, the one most POSIX views of S3 read and write
(s3fs-fuse, and rclone for `mtime`): each value is a user metadata header,
`x-amz-meta-<name>`, written here without the prefix (boto3 adds it):

    mode   st_mode in decimal, file type bits included (33188 = S_IFREG|0644,
           16877 = S_IFDIR|0755, 41471 = S_IFLNK|0777, 4516 = S_IFIFO|0644)
    uid    decimal
    gid    decimal
    atime  seconds since the epoch: "1700000000" or "1700000000.123456789"
    mtime  (nine digits after the point whenever the nanoseconds are not 0;
    ctime   rclone writes mtime the same way)
    rdev   a device node's device number, decimal (s3fs's name; only on devices)

A symlink is an object whose body is its target; FIFOs, sockets and device
nodes are empty objects; each is typed by its `mode`. Device nodes are inert
metadata: the mount is always nodev, so the kernel opens none of them. A
directory's attributes go on its `dir/` marker object. Any type this mount
does not know shows as a regular file.

What is read is taken with care, because whoever can write the bucket writes
it: a value that does not parse is ignored (the mount's defaults stand in),
and a `mode` above 0o177777 spelled in octal digits is read as octal (rclone's
`--metadata` writes modes in octal: "100644"). Objects written by tierfs
before this convention carry `tierfs-mtime` (seconds, float); it is read as
the mtime when `mtime` is absent.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime

MODE, UID, GID, ATIME, MTIME, CTIME = "mode", "uid", "gid", "atime", "mtime", "ctime"
RDEV = "rdev"
LEGACY_MTIME = "tierfs-mtime"
NAMES = (MODE, UID, GID, ATIME, MTIME, CTIME, RDEV)

# The largest symlink body: PATH_MAX (4096) less the terminating NUL. A bigger
# object is never a symlink, and FIFOs and sockets are empty: only objects of at
# most this size can turn out to be something other than a regular file.
SYMLINK_MAX = 4095

# File types an object can stand for (a directory is a prefix, never an object).
OBJECT_TYPES = frozenset({stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK,
                          stat.S_IFBLK, stat.S_IFCHR})
DEVICES = frozenset({stat.S_IFBLK, stat.S_IFCHR})
_MAX_RDEV = (1 << 64) - 1
_NS = 1_000_000_000
_MAX_ID = 0xFFFF_FFFE  # (uid_t)-1 means "no change" to chown(2): never an owner
# A record kept in the tier-1 index (cache `attrs`): which version of the object
# the attributes belong to (ETag, Last-Modified), the attributes, a symlink's target.
# (A record of the earlier layout, without rdev, does not unpack: it is learned again.)
_RECORD = struct.Struct("<qIIIqqqQHH")


@dataclass(frozen=True)
class Defaults:
    """What an object without (readable) attributes shows: the mount's
    --uid --gid --file-mode --dir-mode."""

    uid: int
    gid: int
    file_mode: int = 0o644
    dir_mode: int = 0o755


@dataclass(frozen=True)
class Attrs:
    """The POSIX attributes of one file, symlink, FIFO, socket or directory."""

    mode: int  # st_mode, with its file type bits
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0  # a device node's device number (st_rdev); 0 for everything else

    @property
    def kind(self) -> int:
        return stat.S_IFMT(self.mode)

    @property
    def is_dir(self) -> bool:
        return self.kind == stat.S_IFDIR

    def with_perms(self, perms: int, now_ns: int) -> Attrs:
        """chmod: new permission bits (setuid/setgid/sticky included), ctime now."""
        return replace(self, mode=self.kind | (perms & 0o7777), ctime_ns=now_ns)

    def with_owner(self, uid: int | None, gid: int | None, now_ns: int) -> Attrs:
        return replace(
            self,
            uid=self.uid if uid is None else uid,
            gid=self.gid if gid is None else gid,
            ctime_ns=now_ns,
        )

    def written_at(self, mtime_ns: int) -> Attrs:
        """These attributes after a write at `mtime_ns`, if they do not show it yet
        (a file's journal keeps the time of its last write)."""
        if mtime_ns == self.mtime_ns:
            return self
        return replace(self, mtime_ns=mtime_ns, ctime_ns=max(self.ctime_ns, mtime_ns))

    def with_times(self, atime_ns: int | None, mtime_ns: int | None, now_ns: int) -> Attrs:
        return replace(
            self,
            atime_ns=self.atime_ns if atime_ns is None else atime_ns,
            mtime_ns=self.mtime_ns if mtime_ns is None else mtime_ns,
            ctime_ns=now_ns,
        )


def default_attrs(kind: int, defaults: Defaults, time_ns: int) -> Attrs:
    """Attributes of an object (or prefix) nothing is known of but its time."""
    perms = defaults.dir_mode if kind == stat.S_IFDIR else defaults.file_mode
    return Attrs(kind | perms, defaults.uid, defaults.gid, time_ns, time_ns, time_ns)


def new_attrs(kind: int, perms: int, uid: int, gid: int, now_ns: int, rdev: int = 0) -> Attrs:
    """Attributes of a file, directory, symlink, FIFO or device made now by `uid`:`gid`."""
    return Attrs(kind | (perms & 0o7777), uid, gid, now_ns, now_ns, now_ns,
                 rdev if kind in DEVICES else 0)


def to_metadata(attrs: Attrs) -> dict[str, str]:
    """The user metadata that stores `attrs`."""
    meta = {
        MODE: str(attrs.mode),
        UID: str(attrs.uid),
        GID: str(attrs.gid),
        ATIME: format_time(attrs.atime_ns),
        MTIME: format_time(attrs.mtime_ns),
        CTIME: format_time(attrs.ctime_ns),
    }
    if attrs.kind in DEVICES:
        meta[RDEV] = str(attrs.rdev)
    return meta


def upload_metadata(attrs: Attrs | None, mtime_ns: int) -> dict[str, str]:
    """What an upload of a file last written at `mtime` stores: its attributes,
    or only that mtime while they are unknown (a file this mount never saw the
    attributes of keeps the defaults' meaning: unknown)."""
    if attrs is None:
        return {MTIME: format_time(mtime_ns)}
    return to_metadata(attrs.written_at(mtime_ns))


def listing_misleads(metadata: Mapping[str, str]) -> bool:
    """Whether an object stored with `metadata` must say in listings that a HEAD
    would tell more (Store.put_bytes typed=True; it matters for objects of at most
    SYMLINK_MAX bytes, the ones a listing's reader may type): a listing carries
    no metadata, so another node types it by the defaults. Worth a HEAD there:
    a kind other than a regular file, and permission bits other than 0644
    (`chmod +x script`, a 0600 key file). Owners and times of plain files are
    left to the defaults and store times, as for larger files, until a read or
    a revalidation teaches them."""
    mode = parse_mode(metadata.get(MODE, ""))
    return mode is not None and (stat.S_IFMT(mode) not in (0, stat.S_IFREG)
                                 or stat.S_IMODE(mode) != 0o644)


def has_attrs(metadata: Mapping[str, str]) -> bool:
    """Whether `metadata` says anything of POSIX attributes."""
    return any(name in metadata for name in (*NAMES, LEGACY_MTIME))


def from_metadata(
    metadata: Mapping[str, str], *, is_dir: bool, defaults: Defaults, store_mtime_ns: int
) -> Attrs:
    """The attributes an object's user metadata (names lowercased, as S3 returns
    them) describes; what is missing or unreadable comes from `defaults`, and
    times from the object's Last-Modified."""
    mode = parse_mode(metadata.get(MODE, ""))
    if is_dir:
        kind = stat.S_IFDIR
    else:
        kind = stat.S_IFMT(mode) if mode is not None else stat.S_IFREG
        if kind not in OBJECT_TYPES:
            kind = stat.S_IFREG
    if mode is None:
        perms = defaults.dir_mode if is_dir else defaults.file_mode
    else:
        perms = stat.S_IMODE(mode)
    mtime = parse_time(metadata.get(MTIME, ""))
    if mtime is None:
        mtime = parse_time(metadata.get(LEGACY_MTIME, ""))
    mtime = store_mtime_ns if mtime is None else mtime
    atime = parse_time(metadata.get(ATIME, ""))
    ctime = parse_time(metadata.get(CTIME, ""))
    rdev = metadata.get(RDEV, "").strip()
    return Attrs(
        mode=kind | perms,
        uid=_parse_id(metadata.get(UID, ""), defaults.uid),
        gid=_parse_id(metadata.get(GID, ""), defaults.gid),
        atime_ns=mtime if atime is None else atime,
        mtime_ns=mtime,
        ctime_ns=mtime if ctime is None else ctime,
        rdev=int(rdev) if kind in DEVICES and rdev.isdigit() and int(rdev) <= _MAX_RDEV else 0,
    )


def parse_mode(text: str) -> int | None:
    """A stored mode: decimal st_mode (s3fs), or octal digits above 0o177777 (rclone)."""
    text = text.strip()
    if not text.isdigit():
        return None
    value = int(text)
    if value > 0o177777:
        if set(text) - set("01234567"):
            return None
        value = int(text, 8)
        if value > 0o177777:
            return None
    return value


def _parse_id(text: str, default: int) -> int:
    text = text.strip()
    if not text.isdigit():
        return default
    value = int(text)
    return value if value <= _MAX_ID else default


def format_time(ns: int) -> str:
    """s3fs's form: whole seconds, then nine digits of nanoseconds unless they are 0.
    A time before the epoch keeps non-negative nanoseconds (a timespec's)."""
    sec, nsec = divmod(ns, _NS)
    return f"{sec}.{nsec:09d}" if nsec else str(sec)


def parse_time(text: str) -> int | None:
    """Nanoseconds since the epoch from "sec[.fraction]" (s3fs, rclone) or an
    RFC 3339 time (rclone's --metadata); None if it is neither."""
    text = text.strip()
    if not text:
        return None
    whole, dot, frac = text.partition(".")
    digits = whole[1:] if whole[:1] in "+-" else whole
    if digits.isdigit() and (not dot or frac.isdigit()):
        sec = int(whole)
        nsec = int(frac[:9].ljust(9, "0")) if frac else 0
        return sec * _NS + nsec
    return _parse_rfc3339(text)


def _parse_rfc3339(text: str) -> int | None:
    if "T" not in text:
        return None
    head, dot, rest = text.partition(".")
    frac, zone = "", ""
    if dot:
        i = next((i for i, ch in enumerate(rest) if not ch.isdigit()), len(rest))
        frac, zone = rest[:i], rest[i:]
    try:
        when = datetime.fromisoformat(head + (zone or ""))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    nsec = int(frac[:9].ljust(9, "0")) if frac else 0
    return int(when.timestamp()) * _NS + nsec


@dataclass(frozen=True)
class Known:
    """Attributes known for one version of an object (or of a directory, whose
    version is empty): what the tier-1 index keeps across remounts."""

    etag: str
    version_ns: int  # the object's Last-Modified, ns (0: any)
    attrs: Attrs
    link: str | None = None  # a symlink's target, once read

    def pack(self) -> bytes:
        e = self.etag.encode("utf-8", "surrogateescape")
        k = (self.link or "").encode("utf-8", "surrogateescape")
        a = self.attrs
        return _RECORD.pack(self.version_ns, a.mode, a.uid, a.gid, a.atime_ns, a.mtime_ns,
                            a.ctime_ns, a.rdev, len(e), len(k)) + e + k

    @classmethod
    def unpack(cls, raw: bytes) -> Known | None:
        """None for a record this version cannot read."""
        if len(raw) < _RECORD.size:
            return None
        version, mode, uid, gid, at, mt, ct, rdev, el, kl = _RECORD.unpack_from(raw)
        o = _RECORD.size
        if len(raw) != o + el + kl:
            return None
        etag = raw[o : o + el].decode("utf-8", "surrogateescape")
        link = raw[o + el :].decode("utf-8", "surrogateescape") or None
        return cls(etag, version, Attrs(mode, uid, gid, at, mt, ct, rdev), link)
