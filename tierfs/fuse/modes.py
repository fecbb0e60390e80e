"""Which way each open is served: FUSE passthrough or the daemon path (DESIGN §3.8).

A read-only open of a clean object whose tier-1 copy is complete and verified
by this process goes passthrough: the kernel reads the cache file itself (its
page cache, its readahead) and the daemon sees no READ. So does a writable
open of a write-back file whose whole content is local (created, O_TRUNC, or
written here and not uploaded yet, or a clean object complete and verified
in tier 1, made a local write at open): the kernel writes its tier-1 file at
local-disk speed, and the write session takes the file as written, whole, at
flush, fsync and release (size and mtime from the file; stat asks the file
while it is open: WriteSession.observe). Everything else takes the daemon
path: other writable opens (an object not yet local, write-through and
published classes), partial objects, read-only opens of files written here
and not yet uploaded (unless a writer holds them in passthrough: they join
it), classes revalidated on every open (manifests), and any open while the
mount has passthrough off.

Verification never blocks an open: a complete object with chunks not yet
checked since the daemon started is verified in the background (one object at
a time) and its next open goes passthrough.

The kernel's rule (passthrough.InodeBackings): all concurrent opens of an
inode share one mode, so an inode switches only once every handle is closed.
A read-only open of an inode open in passthrough joins it, even when the
object has a newer version meanwhile: it reads the version the inode's open
handles hold (as they do) until they are all closed; the next open gets the
new cache file and a new backing id. A writable open of an inode open in
passthrough joins it when it writes that same file (a second writer of a
local file, or a writer of the clean object the readers read: they see its
writes, as on a local disk); otherwise it is refused with ETXTBSY (the kernel
fails any other mode with EIO).
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
from tierfs.fuse.passthrough import InodeBackings, Mode
from tierfs.workers import Workers

log = logging.getLogger(__name__)

# tierfs_opens_total{mode, why}: mode "passthrough" (why "passthrough", or "writable"
# for a writer) or "daemon", why one of: off, writable (a writer that does not
# qualify), writable_busy (a writer beside daemon-path opens), partial, unverified,
# local (written here, not yet uploaded), revalidated (a class revalidated at every
# open), inode_busy (the inode is open on the daemon path), register_failed; a
# passthrough open joining
# handles of an older version counts as (passthrough, older_version), a
# writable open refused beside passthrough handles as (refused, writable).
PASSTHROUGH = "passthrough"


class Writable(Protocol):
    """A write session (writeback/session.py), as far as its open's mode goes."""

    entry: Entry

    async def release(self) -> None: ...

    def may_pass_through(self) -> bool: ...

    async def prepare_pass_through(self) -> None: ...

    def begin_pass_through(self) -> int: ...

    async def end_pass_through(self) -> None: ...


W = TypeVar("W", bound=Writable)


@dataclass(frozen=True)
class Opened:
    """How one open is served: `backing_id` > 0 is passthrough; `pinned`: the
    entry whose chunks were pinned for the kernel."""

    inode: int
    backing_id: int
    pinned: Entry | None = None


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
            same = self.backings.owner(inode) is entry
            self._count(PASSTHROUGH, PASSTHROUGH if same else "older_version")
            if not same:
                return Opened(inode, joined)
            entry.serve.pin_all()  # the writer it joined may release first; its upload makes it clean
            return Opened(inode, joined, entry)
        why = self._why_not(entry, settings)
        if why is None and self.backings.mode(inode) is None:
            try:
                backing_id = self.backings.acquire(inode, entry.serve.backing_fd(), entry)
            except OSError as exc:
                log.warning("passthrough open of %s failed (%s): served by the daemon",
                            entry.key, exc)
                why = "register_failed"
            else:
                assert backing_id
                entry.serve.pin_all()
                self._count(PASSTHROUGH, PASSTHROUGH)
                return Opened(inode, backing_id, entry)
        self.backings.acquire(inode, None)
        self._count("daemon", why or "inode_busy")
        return Opened(inode, 0)

    def _refuse(self) -> OSError:
        self._count("refused", "writable")
        return OSError(errno.ETXTBSY, "open for writing while read-only opens of it are "
                       "served by FUSE passthrough; retry once they are closed")

    def _beside_readers(self, inode: int) -> bool:
        """Whether `inode` is open in passthrough on a clean object (readers): a
        writable open then cannot share its mode."""
        owner = self.backings.owner(inode)
        return bool(self.backings.mode(inode)) and (not isinstance(owner, Entry)
                                                    or owner.state == "clean")

    async def writable(self, inode: int, open_: Callable[[], Awaitable[W]], *,
                       writeback: bool) -> tuple[W, Opened]:
        """A writable open of an existing file: the write path's open (`open_`),
        then `open_write`. ETXTBSY, before anything is opened (O_TRUNC), while
        read-only opens of it are served by passthrough and the writer cannot
        join them (`writeback`: its class is write-back, so it may: the readers'
        clean, verified file is the one it writes)."""
        if self._beside_readers(inode) and not (writeback and self.mode.enabled):
            raise self._refuse()
        h = await open_()
        return h, await self.created(inode, h)

    async def created(self, inode: int, h: W) -> Opened:
        """`open_write` of a write session `h` (released if refused)."""
        try:
            return await self.open_write(inode, h)
        except BaseException:
            await h.release()
            raise

    async def open_write(self, inode: int, h: Writable) -> Opened:
        """A writable open. Passthrough, with the file's tier-1 copy as backing file,
        when the whole content is local (a new file, O_TRUNC, a write-back file not
        uploaded yet) and no open of the inode is on the daemon path: the kernel
        then writes at local-disk speed and the session takes the file as written
        at flush, fsync and release. Otherwise the daemon path, which sees every
        write(2). OSError(ETXTBSY) while the inode is open in passthrough on
        another file (read-only opens of the clean object)."""
        eligible = self.mode.enabled and h.may_pass_through()
        if eligible:
            await h.prepare_pass_through()  # no upload reads it while the kernel writes
            eligible = h.may_pass_through()
        # No await from here on: the inode's mode cannot change under the decision.
        mode = self.backings.mode(inode)
        if mode:  # open in passthrough: join it on the same file, or not at all
            if not eligible or self.backings.owner(inode) is not h.entry:
                raise self._refuse()
            h.begin_pass_through()
            joined = self.backings.acquire(inode, None)
            assert joined
            h.entry.serve.pin_all()
            self._count(PASSTHROUGH, "writable")
            return Opened(inode, joined, h.entry)
        if mode is None and eligible:
            fd = h.begin_pass_through()
            try:
                backing_id = self.backings.acquire(inode, fd, h.entry)
            except OSError as exc:
                log.warning("passthrough open of %s for writing failed (%s): served by the "
                            "daemon", h.entry.key, exc)
                self.backings.acquire(inode, None)
                self._count("daemon", "register_failed")
                await h.end_pass_through()
                return Opened(inode, 0)
            assert backing_id
            h.entry.serve.pin_all()  # clean again at release if unwritten (WriteSession._restore)
            self._count(PASSTHROUGH, "writable")
            return Opened(inode, backing_id, h.entry)
        self.backings.acquire(inode, None)
        self._count("daemon", ("writable_busy" if mode == 0 else "writable") if self.mode.enabled
                    else "off")
        return Opened(inode, 0)

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
            opened.pinned.serve.unpin_all()
        self.backings.release(opened.inode)

    def summary(self) -> dict[str, object]:
        return {"enabled": self.mode.enabled, "reason": self.mode.reason,
                "open_inodes": self.backings.backed()}

    def _why_not(self, entry: Entry, settings: ClassSettings) -> str | None:
        if not self.mode.enabled:
            return "off"
        if settings.revalidate_on_open:
            return "revalidated"
        state = entry.serve.completeness()
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
                bad = await self.workers.disk(entry.serve.verify)
            if bad:
                log.warning("%s: %d cached chunk(s) failed their checksum; dropped",
                            entry.key, len(bad))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("background verification of %s failed: %s", entry.key, exc)
        finally:
            self._verifying.discard(id(entry))
            await self.workers.disk(self.cache.release, entry)
