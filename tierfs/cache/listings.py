"""Directory listings kept in the tier-1 index across remounts (DESIGN §4, §6).

Listing a directory of 10,000 objects takes 10 LIST requests of 1,000 keys
(about a second here, more against a remote store), and a remount used to
forget it. The index keeps the last complete listing of each directory with
the wall-clock time it was taken: within its class's listing TTL (dataset:
minutes, `inf` allowed) a later mount takes it as the store's answer, so
`ls -l` or `os.scandir` after a remount sends no LIST, and the ETags and sizes
in it still let opens of the dataset class go without a HEAD.

One record per directory in the index's `listings` database, keyed by the
hash of its prefix (cache/index.py). Value, little-endian:
  header  version u8, listed_at f64 (seconds since the epoch), prefix length
          u16, file count u32, dir count u32, then the prefix
  file    name length u16, size u64, mtime f64, etag length u8, name, etag
  dir     name length u16, name
Names are relative to the prefix. This mount drops the record of a directory
whose entries it changes (create, unlink, rename, upload), so a kept listing
never hides what this mount wrote.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable

from tierfs.cache.index import Index
from tierfs.store.base import Listing, ObjectInfo

log = logging.getLogger(__name__)

VERSION = 1
_HEAD = struct.Struct("<BdHII")
_FILE = struct.Struct("<HQdB")
_NAME = struct.Struct("<H")
_ENC = ("utf-8", "surrogateescape")


class BadListing(ValueError):
    """A kept listing that cannot be read (another version, a torn record)."""


def encode(prefix: str, listing: Listing, listed_at: float) -> bytes:
    p = prefix.encode(*_ENC)
    parts = [_HEAD.pack(VERSION, listed_at, len(p), len(listing.files), len(listing.dirs)), p]
    for f in listing.files:
        name = f.key[len(prefix) :].encode(*_ENC)
        etag = f.etag.encode(*_ENC)
        parts += [_FILE.pack(len(name), f.size, f.mtime, len(etag)), name, etag]
    for d in listing.dirs:
        name = d.encode(*_ENC)
        parts += [_NAME.pack(len(name)), name]
    return b"".join(parts)


def decode(prefix: str, raw: bytes) -> tuple[Listing, float]:
    """The listing kept for `prefix` and when it was taken (BadListing if the
    record is not one this version wrote for that prefix)."""
    try:
        version, listed_at, plen, nfiles, ndirs = _HEAD.unpack_from(raw)
        if version != VERSION:
            raise BadListing(f"kept listing of {prefix!r}: version {version}")
        o = _HEAD.size
        if raw[o : o + plen].decode(*_ENC) != prefix:
            raise BadListing(f"kept listing of {prefix!r} is another directory's")
        o += plen
        files = []
        for _ in range(nfiles):
            nlen, size, mtime, elen = _FILE.unpack_from(raw, o)
            o += _FILE.size
            name = raw[o : o + nlen].decode(*_ENC)
            etag = raw[o + nlen : o + nlen + elen].decode(*_ENC)
            o += nlen + elen
            files.append(ObjectInfo(prefix + name, size, etag, mtime))
        dirs = []
        for _ in range(ndirs):
            (nlen,) = _NAME.unpack_from(raw, o)
            o += _NAME.size
            dirs.append(raw[o : o + nlen].decode(*_ENC))
            o += nlen
    except (struct.error, UnicodeDecodeError) as exc:
        raise BadListing(f"kept listing of {prefix!r} is torn: {exc}") from None
    if o != len(raw):
        raise BadListing(f"kept listing of {prefix!r}: {len(raw) - o} stray bytes")
    return Listing(files, dirs), listed_at


class KeptListings:
    """The listings kept in one cache's index (`Cache.listings`)."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def keep(self, prefix: str, listing: Listing, listed_at: float) -> None:
        """Keep the store's complete listing of `prefix`, taken at `listed_at`."""
        self.index.keep_listing(prefix, encode(prefix, listing, listed_at))

    def kept(self, prefix: str) -> tuple[Listing, float] | None:
        """The listing kept for `prefix` and when it was taken, if any (one that
        cannot be read is dropped)."""
        raw = self.index.kept_listing(prefix)
        if raw is None:
            return None
        try:
            return decode(prefix, raw)
        except BadListing as exc:
            log.warning("%s: dropped", exc)
            self.index.drop_listings([prefix])
            return None

    def drop(self, prefixes: Iterable[str]) -> None:
        self.index.drop_listings(prefixes)
