"""The kernel's side of the mount: dropping what it caches (pages, names) when
tierfs learns they are stale, and the size of its read requests.

Each drop is a notification to the kernel from a worker thread (the kernel
may need this loop to answer requests meanwhile), in the background: the
caller never waits for it. Drops wait in one ordered set (an inode or a name
waits once however often it is asked for) that `run` works through.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyfuse3
import trio

log = logging.getLogger(__name__)

class KernelCache:
    def __init__(self) -> None:
        self._due: dict[tuple[int, bytes | None], None] = {}  # (inode, name or None: pages)
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(1)

    def drop_pages(self, inode: int) -> None:
        """The object behind `inode` changed (or was written around the page cache):
        pages the kernel holds of it are stale."""
        self._due[(inode, None)] = None
        self._wake.set()

    def drop_name(self, parent_inode: int, name: str) -> None:
        """`name` is gone from `parent_inode` although the kernel may remember it."""
        self._due[(parent_inode, name.encode("utf-8", "surrogateescape"))] = None
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._due:
                (inode, name), _ = self._due.popitem()
                try:
                    if name is None:
                        await trio.to_thread.run_sync(
                            pyfuse3.invalidate_inode, inode, False, limiter=self._limiter)
                    else:
                        await trio.to_thread.run_sync(
                            pyfuse3.invalidate_entry, inode, name, limiter=self._limiter)
                except OSError as exc:  # ENOENT: the kernel holds no such inode or name
                    log.debug("kernel notification (%d, %r): %s", inode, name, exc)


def set_kernel_readahead(mountpoint: Path, kb: int) -> None:
    """Ask the kernel for big FUSE reads (DESIGN §3.5); best effort. Blocking."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(kb))
    except OSError as exc:
        log.info("could not set %s to %d (%s); reads stay at the kernel default",
                 path, kb, exc.strerror)
