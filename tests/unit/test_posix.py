"""The POSIX metadata convention (tierfs/posix.py): s3fs's names and forms."""

from __future__ import annotations

import os
import stat

import pytest

from tierfs.posix import (
    Attrs,
    Defaults,
    Known,
    default_attrs,
    format_time,
    from_metadata,
    has_attrs,
    listing_misleads,
    new_attrs,
    parse_mode,
    parse_time,
    to_metadata,
)

D = Defaults(uid=1000, gid=1001, file_mode=0o640, dir_mode=0o750)
LM = 1_700_000_000 * 10**9  # an object's Last-Modified


def test_written_as_s3fs_writes_it() -> None:
    a = Attrs(stat.S_IFREG | 0o644, 0, 0, 5 * 10**9, 1_700_000_000_123_456_789, 7 * 10**9)
    assert to_metadata(a) == {
        "mode": "33188", "uid": "0", "gid": "0",
        "atime": "5", "mtime": "1700000000.123456789", "ctime": "7",
    }
    assert to_metadata(Attrs(stat.S_IFLNK | 0o777, 1, 2, 0, 0, 0))["mode"] == "41471"
    assert to_metadata(Attrs(stat.S_IFDIR | 0o1777, 1, 2, 0, 0, 0))["mode"] == str(0o41777)


@pytest.mark.parametrize("kind", [stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK])
def test_round_trip(kind: int) -> None:
    a = Attrs(kind | 0o4751, 65534, 12, -315_619_140 * 10**9 + 1, 0, 999_999_999)
    assert from_metadata(to_metadata(a), is_dir=False, defaults=D, store_mtime_ns=LM) == a


def test_directory_marker_is_always_a_directory() -> None:
    got = from_metadata({"mode": str(stat.S_IFREG | 0o700)}, is_dir=True, defaults=D,
                        store_mtime_ns=LM)
    assert got.mode == stat.S_IFDIR | 0o700


def test_nothing_known_takes_the_defaults_and_last_modified() -> None:
    assert not has_attrs({"other": "x"})
    got = from_metadata({"other": "x"}, is_dir=False, defaults=D, store_mtime_ns=LM)
    assert got == default_attrs(stat.S_IFREG, D, LM) == Attrs(stat.S_IFREG | 0o640, 1000, 1001,
                                                              LM, LM, LM)
    assert from_metadata({}, is_dir=True, defaults=D, store_mtime_ns=LM).mode == stat.S_IFDIR | 0o750


def test_unknown_types_show_as_regular_files() -> None:
    for kind in (stat.S_IFDIR, 0o170000):
        got = from_metadata({"mode": str(kind | 0o4755)}, is_dir=False, defaults=D,
                            store_mtime_ns=LM)
        assert got.mode == stat.S_IFREG | 0o4755


def test_device_nodes_keep_their_number() -> None:
    """mknod b/c: the type and st_rdev (s3fs's `rdev`), inert on the nodev mount."""
    for kind in (stat.S_IFCHR, stat.S_IFBLK):
        a = new_attrs(kind, 0o640, 0, 6, LM, rdev=os.makedev(8, 1))
        meta = to_metadata(a)
        assert meta["rdev"] == str(os.makedev(8, 1))
        assert from_metadata(meta, is_dir=False, defaults=D, store_mtime_ns=0) == a
        assert Known.unpack(Known("e", 0, a).pack()) == Known("e", 0, a)
        assert listing_misleads(meta)
    # no rdev on other types, and a bad one is 0
    assert "rdev" not in to_metadata(new_attrs(stat.S_IFIFO, 0o644, 0, 0, LM, rdev=5))
    bad = {"mode": str(stat.S_IFCHR | 0o600), "rdev": "-1"}
    assert from_metadata(bad, is_dir=False, defaults=D, store_mtime_ns=LM).rdev == 0


def test_bad_values_fall_back_one_by_one() -> None:
    meta = {"mode": "rwx", "uid": "-1", "gid": "4294967295", "mtime": "yesterday",
            "atime": "1.5", "ctime": ""}
    got = from_metadata(meta, is_dir=False, defaults=D, store_mtime_ns=LM)
    assert got == Attrs(stat.S_IFREG | 0o640, 1000, 1001, 1_500_000_000, LM, LM)


def test_mode_forms() -> None:
    assert parse_mode("33188") == 0o100644
    assert parse_mode("100644") == 0o100644  # rclone --metadata: octal
    assert parse_mode("644") == 644  # small decimal: taken as written (no type bits)
    assert parse_mode("999999") is None  # above 16 bits and not octal
    assert parse_mode("77777777") is None
    assert parse_mode("") is None and parse_mode("0x81a4") is None


def test_time_forms() -> None:
    assert format_time(0) == "0"
    assert format_time(1_700_000_000 * 10**9) == "1700000000"
    assert format_time(10**9 + 5) == "1.000000005"
    assert format_time(-1) == "-1.999999999"  # timespec: whole seconds down, ns up
    assert parse_time("-1.999999999") == -1
    assert parse_time("1700000000.5") == 1_700_000_000_500_000_000  # rclone floats
    assert parse_time("1700000000.123456789123") == 1_700_000_000_123_456_789
    assert parse_time("2023-05-11T17:54:11.523399602+01:00") == 1_683_824_051_523_399_602
    assert parse_time("2023-05-11T16:54:11Z") == 1_683_824_051 * 10**9
    for bad in ("", "x", "1.2.3", "2023-05-11T17:54:11", "1e9", "."):
        assert parse_time(bad) is None


def test_legacy_tierfs_mtime_is_read() -> None:
    got = from_metadata({"tierfs-mtime": "1700000000.250000000"}, is_dir=False, defaults=D,
                        store_mtime_ns=LM)
    assert got.mtime_ns == 1_700_000_000_250_000_000
    assert has_attrs({"tierfs-mtime": "1"})


def test_changes_move_ctime() -> None:
    a = default_attrs(stat.S_IFREG, D, LM)
    b = a.with_perms(0o7755, LM + 1)
    assert b.mode == stat.S_IFREG | 0o7755 and b.ctime_ns == LM + 1 and b.mtime_ns == LM
    c = b.with_owner(None, 7, LM + 2)
    assert (c.uid, c.gid, c.ctime_ns) == (1000, 7, LM + 2)
    d = c.with_times(None, 5, LM + 3)
    assert (d.atime_ns, d.mtime_ns, d.ctime_ns) == (LM, 5, LM + 3)


def test_known_records_round_trip() -> None:
    a = Attrs(stat.S_IFLNK | 0o777, 1, 2, -3, 4, 5)
    for k in (Known("etag-1", 1_700_000_000 * 10**9, a, "../../blobs/ab"), Known("", 0, a)):
        assert Known.unpack(k.pack()) == k
    assert Known.unpack(b"short") is None
    assert Known.unpack(Known("e", 0, a).pack() + b"x") is None
