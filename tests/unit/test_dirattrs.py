"""A directory's attribute object (tierfs/namespace/dirattrs.py): the format, which
entries a listing makes unnecessary, and which version an entry describes."""

from __future__ import annotations

import json
import stat

import pytest

from tierfs.namespace.dirattrs import (
    NAME,
    BadTable,
    Table,
    describes,
    dir_entry,
    file_entry,
    implied,
    key_of,
    split,
)
from tierfs.posix import Defaults, from_metadata, new_attrs, to_metadata
from tierfs.store.base import Listing, ObjectInfo

D = Defaults(uid=1000, gid=1000)
T = 1_700_000_000


def test_round_trip_and_plain_json() -> None:
    link = new_attrs(stat.S_IFLNK, 0o777, 0, 0, T * 10**9)
    table = Table({
        "run.sh": file_entry("e1", T + 0.5, to_metadata(new_attrs(stat.S_IFREG, 0o755, 0, 0, 1))),
        "a-link": file_entry("e2-1", T, to_metadata(link), "../blobs/x"),
        "ñ \udcff": file_entry("e3", T, {"mode": "33152", "other": "dropped"}),
        "blobs/": dir_entry(new_attrs(stat.S_IFDIR, 0o1777, 0, 0, 2)),
    })
    raw = table.encode()
    doc = json.loads(raw)  # any JSON reader reads it (a name that is not UTF-8 too)
    assert doc["tierfs-dir-attrs"] == 1 and doc["entries"]["a-link"]["link"] == "../blobs/x"
    assert Table.decode(raw) == table
    assert "other" not in Table.decode(raw).entries["ñ \udcff"]
    got = from_metadata(table.entries["a-link"], is_dir=False, defaults=D, store_mtime_ns=0)
    assert got == link


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"tierfs-dir-attrs": 2, "entries": {}}',
                                 b'{"tierfs-dir-attrs": 1}', b"\xff\xfe", b'{"tierfs-dir-attrs": 1,'])
def test_what_is_not_ours_is_refused(raw: bytes) -> None:
    with pytest.raises(BadTable):
        Table.decode(raw)


def test_odd_entries_are_left_out() -> None:
    raw = json.dumps({"tierfs-dir-attrs": 1, "entries": {
        "ok": {"etag": "e", "mode": "33188"}, "num": 5, "": {"mode": "1"}, "/": {},
        "vals": {"mode": 33188, "uid": "0"}}}).encode()
    assert Table.decode(raw).entries == {"ok": {"etag": "e", "mode": "33188"},
                                         "vals": {"uid": "0"}}


def test_an_entry_describes_one_version() -> None:
    entry = file_entry("etag-a", T + 0.7, {"mode": "33261"})
    assert describes(entry, ObjectInfo("k", 1, "etag-a", T))  # Last-Modified, whole seconds
    assert describes(entry, ObjectInfo("k", 1, "etag-a", T + 1))
    assert not describes(entry, ObjectInfo("k", 1, "etag-b", T))  # replaced
    assert not describes(entry, ObjectInfo("k", 1, "etag-a", T + 2))  # metadata changed later
    assert not describes({"etag": "etag-a", "stored": "soon"}, ObjectInfo("k", 1, "etag-a", T))


def test_what_a_listing_tells_needs_no_entry() -> None:
    now = T * 10**9
    plain = new_attrs(stat.S_IFREG, 0o644, 1000, 1000, now)
    assert implied(plain, D, T + 5)  # written, uploaded 5 s later
    assert implied(plain, D, T - 0.5)  # the store's whole seconds
    assert not implied(plain, D, T + 3600)  # uploaded an hour after: its mtime is not that
    assert not implied(plain, D, T - 5)  # an mtime in the future of its upload
    assert not implied(plain.with_perms(0o600, now), D, T)
    assert not implied(plain.with_owner(65534, None, now), D, T)
    assert not implied(new_attrs(stat.S_IFIFO, 0o644, 1000, 1000, now), D, T)
    assert implied(new_attrs(stat.S_IFDIR, 0o755, 1000, 1000, now), D)
    assert not implied(new_attrs(stat.S_IFDIR, 0o1777, 1000, 1000, now), D)


def test_the_attribute_object_is_split_from_a_listing() -> None:
    files = [ObjectInfo("d/a", 1, "e", 0.0), ObjectInfo(key_of("d/"), 9, "t", 0.0)]
    listing, table = split("d/", Listing(files, ["sub"]))
    assert listing == Listing(files[:1], ["sub"]) and table == files[1]
    assert split("d/", listing) == (listing, None)
    assert key_of("") == NAME
