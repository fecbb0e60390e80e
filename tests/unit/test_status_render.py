"""`tierfs status` fits any width: a table that wraps on a terminal, `name: value`
lines of at most 80 columns into a pipe or a log. Nothing is cut."""

from __future__ import annotations

import io

from rich.console import Console

from tierfs.cli_ops import CLASS_COLUMNS, class_rows, print_status, status_rows
from tierfs.config import DEFAULT_CLASSES, DEFAULT_RULES


def a_status() -> dict:
    classes = {n: {"attr_ttl": c.attr_ttl, "list_ttl": c.list_ttl,
                   "revalidate_on_open": c.revalidate_on_open, "keep_cache": c.keep_cache,
                   "write_mode": c.write_mode, "readahead_max": c.readahead_max,
                   "direct_writes": c.direct_writes, "upload_delay": c.upload_delay,
                   "publish": c.publish}
               for n, c in DEFAULT_CLASSES.items()}
    return {
        "mountpoint": "/mnt/a-rather-long/mount/point/for/training-data", "source":
        "s3://a-bucket-with-a-long-name/and/a/prefix/below/it", "degraded": True, "pid": 4242,
        "cache": {"capacity_bytes": 500 << 30, "used_bytes": 123 << 30, "objects": 98765,
                  "open_objects": 12, "evictions": 3, "evicted_bytes": 1 << 30,
                  "corrupt_chunks": 0},
        "cache_dir": "/nvme/tierfs/0123456789abcdef/with/a/long/path",
        "passthrough": {"enabled": True, "reason": "kernel 6.18.44, libfuse 3.17.2, cache dir "
                        "on ext4", "opens": {"passthrough": {"passthrough": 12},
                                             "daemon": {"partial": 2, "writable": 1}}},
        "store": {"requests": {"get": {"ok": 100, "retry": 2}, "head": {"ok": 5}},
                  "get_bytes": 1 << 30, "put_bytes": 2 << 30},
        "pending": {"available": True, "count": 2, "bytes": 1 << 30, "oldest_age_s": 5.0},
        "classes": classes, "default_class": "default",
        "rules": [{"glob": g, "class": c} for g, c in DEFAULT_RULES],
    }


def test_into_a_pipe_every_header_and_value_whole_within_80_columns() -> None:
    st = a_status()
    out = io.StringIO()
    print_status(st, Console(file=out))  # not a terminal
    text = out.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text
    flat = " ".join(text.split())  # lines wrapped at spaces: join them back
    for name, value in status_rows(st):
        assert f"{name}: {' '.join(value.split())}" in flat, name
    for row in class_rows(st):
        assert f"{row[0]}: " + ", ".join(f"{h} {v}" for h, v in
                                         zip(CLASS_COLUMNS[1:], row[1:], strict=True)) in flat
    assert "dataset" in flat and "checkpoint" in flat and "publish behind" in flat


def test_on_a_narrow_terminal_cells_wrap_and_nothing_is_cut() -> None:
    out = io.StringIO()
    print_status(a_status(), Console(file=out, width=60, force_terminal=True, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert all(len(line) <= 60 for line in text.splitlines())
    flat = " ".join(text.split())
    for row in class_rows(a_status()):  # too narrow for the classes table: a block each
        assert f"{row[0]}: " + ", ".join(f"{h} {v}" for h, v in
                                         zip(CLASS_COLUMNS[1:], row[1:], strict=True)) in flat


def test_a_wide_terminal_gets_the_classes_table() -> None:
    out = io.StringIO()
    print_status(a_status(), Console(file=out, width=120, force_terminal=True, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert any(all(h in line for h in CLASS_COLUMNS) for line in text.splitlines()), text
