"""Tier 1 checked against itself: every chunk against its checksum, seals whose
checksums were left to take after a restart, files no record names."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Protocol

from tierfs.cache.index import DIRTY, Index, key_hash
from tierfs.cache.objects import Entry

log = logging.getLogger(__name__)

FID_NAME = re.compile(r"[0-9a-f]{32}")  # an object file's name


class Checked(Protocol):
    """The Cache, as these checks see it (cache/__init__.py)."""

    index: Index
    boot_id: bytes
    objects_dir: Path

    def _acquire(self, key: str, want: tuple[str, int, float] | None, touch: bool) -> Entry | None: ...

    def release(self, entry: Entry) -> None: ...

    def _unlink(self, name: str) -> None: ...


def verify_all(cache: Checked) -> list[tuple[str, list[int]]]:
    """Check every checksummed chunk of every object against its file, drop the
    bad ones, and remove files no record names. Returns [(key, bad chunks)]."""
    report = []
    for _, rec in cache.index.records():
        if rec.state == DIRTY:
            continue
        e = cache._acquire(rec.key, None, touch=False)
        if e is None:
            continue
        try:
            bad = e.serve.verify()
        finally:
            cache.release(e)
        if bad:
            report.append((e.key, bad))
    collect_orphans(cache)
    return report

def finish_seal(cache: Checked, key: str) -> bool:
    """After a restart: take the checksums a seal left to take, if its bytes can
    be vouched for: the machine has not restarted since (its page cache held
    every byte the writer wrote; a daemon crash loses none), or they were
    fsynced. False if they cannot (closed without fsync, then the machine went
    down: a torn file would be uploaded as if whole)."""
    rec = cache.index.record(key_hash(key))  # most seals have none to take: no open
    mark = None if rec is None else cache.index.unhashed(rec.fid)
    if mark is None:
        return True
    boot, durable = mark
    if boot != cache.boot_id and not durable:
        return False
    e = cache._acquire(key, None, touch=False)
    if e is None:
        return True
    try:
        e.local.take_all_digests()
        log.info("%r: checksums taken after a restart (its seal %s)", key,
                 "was fsynced" if durable else "was made in this boot")
        return True
    finally:
        cache.release(e)

def collect_orphans(cache: Checked) -> int:
    """Delete object files without a record (left by a crash between a record
    change and its file change). Returns how many. A scan of the index: run it
    in the background, not on the mount path."""
    with os.scandir(cache.objects_dir) as it:
        names = {de.name for de in it if FID_NAME.fullmatch(de.name)}
    for _, rec in cache.index.records():
        names.discard(rec.fid.hex())
    for name in names:
        cache._unlink(name)
    return len(names)
