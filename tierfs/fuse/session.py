"""The FUSE connection of a mount: its options, making it, serving requests until
stopped, and taking it down (pyfuse3's module-level session)."""

from __future__ import annotations

import os
from pathlib import Path

import pyfuse3
import trio

from tierfs.config import FUSE_TASKS
from tierfs.workers import Workers


class NotAnswering(Exception):
    """The mount never answered a stat of its root."""


def open_session(ops: pyfuse3.Operations, mountpoint: Path, *, fsname: str,
                 allow_other: bool) -> None:
    """Mount `ops` at `mountpoint`. Modes and owners come from whoever can write
    the bucket: a setuid-root mode in an object must never run as root, nor a
    device node open. noatime: atime is stored when set explicitly (utimensat),
    never on reads."""
    options = set(pyfuse3.default_options)
    options |= {f"fsname={fsname}", "subtype=tierfs", "noatime", "nosuid", "nodev"}
    if allow_other:
        options.add("allow_other")
    pyfuse3.init(ops, str(mountpoint), options)


async def serve_requests(stop: trio.Event) -> None:
    """Answer the kernel's requests until the session ends; then `stop` is set."""
    try:
        await pyfuse3.main(min_tasks=FUSE_TASKS[0], max_tasks=FUSE_TASKS[1])
    finally:
        stop.set()


def close_session(*, unmount: bool) -> None:
    pyfuse3.close(unmount=unmount)


async def wait_ready(mountpoint: Path, workers: Workers) -> int:
    """The mount counts as up once a stat of its root is answered by us;
    returns the mount's device number."""
    mp = str(mountpoint)
    for _ in range(200):
        try:
            st = await workers.disk(os.stat, mp)
            if st.st_ino == pyfuse3.ROOT_INODE:
                return st.st_dev
        except OSError:
            pass
        await trio.sleep(0.05)
    raise NotAnswering(f"mount at {mp} did not answer")
