"""Small journaled records of the write path: one fsynced JSON file each, in a
directory of its own (`BarrierRecords`: manifests' barriers, <cache>/publish/;
`StreamRecords`: multipart uploads opened while a file is written,
<cache>/streams/). Blocking: run in a disk worker."""

from __future__ import annotations

import contextlib
import hashlib
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


def _name(text: str) -> str:
    return f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


class BarrierRecords:
    """The journaled barriers of manifests not published yet (publish.py): one
    per manifest key."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, key: str, rid: str, barrier: list[str], cond: tuple[str | None, bool]) -> None:
        save(self.root / _name(key), {"key": key, "id": rid, "barrier": barrier,
                                      "if_match": cond[0], "if_none_match": cond[1]})

    def load(self) -> dict[str, dict[str, Any]]:
        return {rec["key"]: rec for rec in load(self.root, "publish")
                if isinstance(rec.get("key"), str)}

    def drop(self, key: str, rid: str | None = None) -> None:
        """Forget the record of `key` (only if it is `rid`'s, when given)."""
        path = self.root / _name(key)
        try:
            if rid is not None and json.loads(path.read_text()).get("id") != rid:
                return
            path.unlink()
        except (OSError, ValueError):
            pass


class StreamRecords:
    """Upload ids of multipart uploads opened while their file was written
    (streaming.py): one per upload, so that a restart aborts them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, key: str, upload_id: str) -> None:
        save(self.root / _name(upload_id), {"key": key, "upload_id": upload_id})

    def drop(self, upload_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / _name(upload_id)).unlink()

    def load(self) -> list[tuple[str, str]]:
        return [(str(r["key"]), str(r["upload_id"])) for r in load(self.root, "stream")
                if "key" in r and "upload_id" in r]
