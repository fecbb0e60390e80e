"""A directory's attribute object: what a listing cannot tell of its entries.

ListObjectsV2 carries no user metadata, so a node that never saw an object
shows it with the mount's defaults (owner, 0644, the store's Last-Modified)
until a HEAD or a GET teaches it. After `cp -a`, `rsync -a` or `tar xpf` into
the mount that is wrong for nearly every entry, and `rsync -a` run again from
another node copies everything again. So a directory where tierfs wrote
something a listing would get wrong (`implied`: another type, mode or owner
than the writer's defaults, an mtime other than about its upload's time) has
one more plain object, `<dir>/.tierfs.attrs.json`, with those entries only,
read with one GET when the directory is listed:

    {"tierfs-dir-attrs": 1,
     "entries": {
       "run.sh":  {"etag": "5d41...", "stored": "1700000123.5", "mode": "33261",
                   "uid": "0", "gid": "0", "atime": "...", "mtime": "...", "ctime": "..."},
       "a-link":  {"etag": "...-1", "stored": "...", "mode": "41471", ..., "link": "../x"},
       "blobs/":  {"mode": "16877", "uid": "0", ...}}}

A file's entry holds the user metadata tierfs stored on the object (posix.py's
names and spelling), tagged with the object's ETag and the store's time of
that write (`stored`, seconds). The object's own metadata stays the truth: an
entry is taken only for the version it names (same ETag, listed no later
than STORED_SLACK after `stored`), so an object replaced by another tool, or
whose metadata another node changed, is asked by HEAD instead. A directory's
entry (`name/`) holds what its `name/` marker's metadata holds. The object is
never listed as a file, moves with its directory, and is deleted with it (or
once its last entry goes).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from tierfs.posix import NAMES, Attrs, Defaults, to_metadata
from tierfs.store.base import Listing, ObjectInfo

NAME = ".tierfs.attrs.json"
VERSION = 1
# An object listed with the entry's ETag is the entry's version if its listed
# Last-Modified is under `stored` + this: the store stamps both (its Date header
# of the write, whole seconds; Last-Modified at or before it), and a version
# written again by another tool, or copied onto itself by a chmod, is later.
STORED_SLACK = 1.0
# A file written through the mount and uploaded within this many seconds of its
# last write needs no entry for its mtime: a listing shows the upload's time.
IMPLIED_MTIME = 60.0
ETAG, STORED, LINK = "etag", "stored", "link"
_FIELDS = frozenset({*NAMES, ETAG, STORED, LINK})

Entry = dict[str, str]


class BadTable(ValueError):
    """An attribute object this version cannot read (whoever can write the bucket
    writes it: it is then ignored, and the listing's defaults and HEADs stand)."""


def key_of(prefix: str) -> str:
    """The attribute object of the directory `prefix` ('' or ending in '/')."""
    return prefix + NAME


def implied(attrs: Attrs, defaults: Defaults, stored: float | None = None) -> bool:
    """Whether a listing shows `attrs` (of an object stored at `stored`; of a
    directory: None) as they are, to a node with the writer's `defaults`."""
    mine = attrs.uid == defaults.uid and attrs.gid == defaults.gid
    if attrs.kind == stat.S_IFDIR:
        return mine and attrs.mode == stat.S_IFDIR | defaults.dir_mode
    # (the store's times are whole seconds, and a file system's a coarse clock's)
    return (mine and attrs.mode == stat.S_IFREG | defaults.file_mode and stored is not None
            and -STORED_SLACK <= stored - attrs.mtime_ns / 1e9 <= IMPLIED_MTIME)


def file_entry(etag: str, stored: float, metadata: Mapping[str, str],
               link: str | None = None) -> Entry:
    """The entry of an object stored (or copied) at `stored` with `metadata`."""
    entry = {k: v for k, v in metadata.items() if k in NAMES}
    entry[ETAG], entry[STORED] = etag, repr(stored)
    if link is not None:
        entry[LINK] = link
    return entry


def dir_entry(attrs: Attrs) -> Entry:
    return to_metadata(attrs)


def describes(entry: Entry, info: ObjectInfo) -> bool:
    """Whether `entry` is of the version `info` lists (see STORED_SLACK)."""
    try:
        stored = float(entry.get(STORED, ""))
    except ValueError:
        return False
    return entry.get(ETAG) == info.etag and info.mtime < stored + STORED_SLACK


@dataclass(frozen=True)
class Table:
    """One directory's entries: file names, and directory names with a '/'."""

    entries: dict[str, Entry] = field(default_factory=dict)

    def file(self, name: str) -> Entry | None:
        return self.entries.get(name)

    def dir(self, name: str) -> Entry | None:
        return self.entries.get(name + "/")

    def changed(self, changes: Mapping[str, Entry | None]) -> Table:
        """This table with `changes` (name -> entry, None: gone) made."""
        entries = dict(self.entries)
        for name, entry in changes.items():
            if entry is None:
                entries.pop(name, None)
            else:
                entries[name] = entry
        return Table(entries)

    def encode(self) -> bytes:
        doc = {"tierfs-dir-attrs": VERSION, "entries": self.entries}
        # ASCII, \u escapes: a name that is not UTF-8 (a lone surrogate here) is
        # still valid JSON for any reader
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("ascii")

    @classmethod
    def decode(cls, raw: bytes) -> Table:
        """The table `raw` holds; entries that are not string maps are left out."""
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadTable(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("tierfs-dir-attrs") != VERSION:
            raise BadTable("not a tierfs-dir-attrs object of version 1")
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            raise BadTable("no entries")
        return cls({name: {k: v for k, v in e.items() if k in _FIELDS and isinstance(v, str)}
                    for name, e in entries.items()
                    if isinstance(name, str) and name.strip("/") and isinstance(e, dict)})


def split(prefix: str, listing: Listing) -> tuple[Listing, ObjectInfo | None]:
    """`listing` of `prefix` without its attribute object, and that object (if any)."""
    key = key_of(prefix)
    found = next((f for f in listing.files if f.key == key), None)
    if found is None:
        return listing, None
    return Listing([f for f in listing.files if f is not found], listing.dirs), found
