"""Small journaled records of the write path: one fsynced JSON file each, in a
directory of its own (publish.py: manifests' barriers; streaming.py: open
multipart uploads). Blocking: run in a disk worker."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def save(path: Path, record: dict[str, Any]) -> None:
    """Write `record` to `path` so that a crash leaves the old one or the new one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load(root: Path, kind: str) -> list[dict[str, Any]]:
    """Every readable record under `root` (an unreadable one is logged, skipped)."""
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            rec = json.loads((root / name).read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s record %s: %s", kind, name, exc)
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
