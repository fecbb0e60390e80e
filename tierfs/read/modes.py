"""Which way each open is served: FUSE passthrough or the daemon path (DESIGN §3.8).

A read-only open of a clean object whose tier-1 copy is complete and verified
by this process goes passthrough: the kernel reads the cache file itself (its
page cache, its readahead) and the daemon sees no READ. Everything else takes
the daemon path: writable opens (the write path must see every write(2)),
partial objects, files written here and not yet uploaded, classes revalidated
on every open (manifests), and any open while the mount has passthrough off.

Verification never blocks an open: a complete object with chunks not yet
checked since the daemon started is verified in the background (one object at
a time) and its next open goes passthrough.

The kernel's rule (passthrough.InodeBackings): all concurrent opens of an
inode share one mode, so an inode switches only once every handle is closed.
A read-only open of an inode open in passthrough joins it, even when the
object has a newer version meanwhile: it reads the version the inode's open
handles hold (as they do) until they are all closed; the next open gets the
new cache file and a new backing id. A writable open of an inode open in
passthrough is refused with ETXTBSY (joining would hide its writes from the
write path, and the kernel fails any other mode with EIO).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import trio

from tierfs.cache import Cache, Entry
from tierfs.config import ClassSettings
from tierfs.passthrough import InodeBackings, Mode
from tierfs.workers import Workers

log = logging.getLogger(__name__)

# tierfs_opens_total{mode, why}: mode "passthrough" (why "passthrough") or "daemon",
# why one of: off, writable, partial, unverified, local (written here, not yet
# uploaded), revalidated (a class revalidated at every open), inode_busy (the
# inode is open on the daemon path), register_failed; a passthrough open joining
# handles of an older version counts as (passthrough, older_version), a
# writable open refused beside passthrough handles as (refused, writable).
PASSTHROUGH = "passthrough"


H = TypeVar("H")


class Closable(Protocol):
    async def release(self) -> None: ...


@dataclass(frozen=True)
class Opened:
    """How one open is served: `backing_id` > 0 is passthrough; `pinned`: the
    entry whose chunks were pinned for the kernel, and how many."""

    inode: int
    backing_id: int
    pinned: tuple[Entry, int] | None = None


class OpenModes:
    """Decides and records the mode of every open of the mount."""

    def __init__(
        self,
        mode: Mode,
        cache: Cache,
        workers: Workers,
        nursery: trio.Nursery,
        count: Callable[[str, str], None],
    ) -> None:
        self.mode = mode
        self.cache = cache
        self.workers = workers
        self.nursery = nursery
        self._count = count  # (mode, why) of each open, for metrics
        self.backings = InodeBackings()
        self._handles: dict[int, Opened] = {}  # file handle -> its mode
        self._verifying: set[int] = set()  # id() of entries being verified
        self._verify_slot = trio.CapacityLimiter(1)

    def set_mode(self, mode: Mode) -> None:
        """The mount's mode once the kernel answered INIT (passthrough.confirm)."""
        self.mode = mode

    def open_read(self, inode: int, entry: Entry, settings: ClassSettings) -> Opened:
        """A read-only open of `entry`: passthrough if it may, else the daemon path."""
        if self.backings.mode(inode):  # open in passthrough: join it
            joined = self.backings.acquire(inode, None)
            assert joined
            self._count(PASSTHROUGH, PASSTHROUGH if self.backings.owner(inode) is entry
                        else "older_version")
            return Opened(inode, joined)
        why = self._why_not(entry, settings)
        if why is None and self.backings.mode(inode) is None:
            try:
                backing_id = self.backings.acquire(inode, entry.backing_fd(), entry)
            except OSError as exc:
                log.warning("passthrough open of %s failed (%s): served by the daemon",
                            entry.key, exc)
                why = "register_failed"
            else:
                assert backing_id
                chunks = entry.chunk_count()
                entry.pin_all()
                self._count(PASSTHROUGH, PASSTHROUGH)
                return Opened(inode, backing_id, (entry, chunks))
        self.backings.acquire(inode, None)
        self._count("daemon", why or "inode_busy")
        return Opened(inode, 0)

    def open_write(self, inode: int) -> Opened:
        """A writable open: always the daemon path, which sees every write(2);
        OSError(ETXTBSY) while the inode is open in passthrough."""
        if self.backings.acquire(inode, None, join=False) is None:
            self._count("refused", "writable")
            raise OSError(errno.ETXTBSY, "open for writing while read-only opens of it are "
                          "served by FUSE passthrough; retry once they are closed")
        self._count("daemon", "writable" if self.mode.enabled else "off")
        return Opened(inode, 0)

    async def writable(self, inode: int, open_: Callable[[], Awaitable[H]]) -> tuple[H, Opened]:
        """`open_write`, then the write path's open (`open_`)."""
        opened = self.open_write(inode)
        try:
            return await open_(), opened
        except BaseException:
            self._drop(opened)
            raise

    async def created(self, inode: int, handle: Closable) -> Opened:
        """`open_write` of a file `handle` was just created for (released if refused)."""
        try:
            return self.open_write(inode)
        except OSError:
            await handle.release()
            raise

    def bind(self, fh: int, opened: Opened) -> int:
        """Remember the mode of file handle `fh`; its backing id (0: daemon path)."""
        self._handles[fh] = opened
        return opened.backing_id

    def release(self, fh: int) -> None:
        """The kernel released `fh`: its place in the inode's mode goes."""
        opened = self._handles.pop(fh, None)
        if opened is not None:
            self._drop(opened)

    def _drop(self, opened: Opened) -> None:
        if opened.pinned is not None:
            opened.pinned[0].unpin_all(opened.pinned[1])
        self.backings.release(opened.inode)

    def summary(self) -> dict[str, object]:
        return {"enabled": self.mode.enabled, "reason": self.mode.reason,
                "open_inodes": self.backings.backed()}

    def _why_not(self, entry: Entry, settings: ClassSettings) -> str | None:
        if not self.mode.enabled:
            return "off"
        if settings.revalidate_on_open:
            return "revalidated"
        state = entry.completeness()
        if state == "verified":
            return None
        if state == "complete":
            self._verify_soon(entry)
            return "unverified"
        return "local" if entry.state != "clean" else "partial"

    def _verify_soon(self, entry: Entry) -> None:
        if id(entry) in self._verifying or not self.cache.retain(entry):
            return
        self._verifying.add(id(entry))
        self.nursery.start_soon(self._verify, entry)

    async def _verify(self, entry: Entry) -> None:
        """Check a complete object's chunks, holding a reference of its own (taken
        at the open) so the verified marks outlive a close before the end: they
        are stashed with the object at its last release."""
        try:
            async with self._verify_slot:
                bad = await self.workers.disk(entry.verify)
            if bad:
                log.warning("%s: %d cached chunk(s) failed their checksum; dropped",
                            entry.key, len(bad))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("background verification of %s failed: %s", entry.key, exc)
        finally:
            self._verifying.discard(id(entry))
            await self.workers.disk(self.cache.release, entry)
