"""The owner of a pending file's life (DESIGN §5): every step that moves a file
between the states of pending.py together with its tier-1 record, and what
follows from it (an upload, a publish, a drop), for the sessions writing it
and for the namespace changes (core.py, rename.py, recovery.py).

The file's lock guards these state changes only. Bulk work runs outside it:
a write's bytes, a fetch, the fsync ahead of a seal, a close's upload or
publish, the waits for a background upload to let go. What ran outside
checks the file's version after (transfer.py, Uploader.commit).
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import AsyncIterator
from functools import partial

import trio

from tierfs.cache import Entry
from tierfs.config import ClassSettings
from tierfs.events import Dropped, FileEvents
from tierfs.health import StoreHealth
from tierfs.policy import Policy
from tierfs.store.base import StoreError
from tierfs.writeback.journal import Journal
from tierfs.writeback.pending import DROPPED, LANDED, REPLACED, FileState, PendingFile
from tierfs.writeback.publish import Publisher
from tierfs.writeback.streaming import Followed, Streams
from tierfs.writeback.tier1 import Tier1
from tierfs.writeback.transfer import NotVerified, Superseded, Transfer
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(
        self, journal: Journal, tier1: Tier1, policy: Policy, health: StoreHealth,
        uploader: Uploader, transfer: Transfer, publisher: Publisher, streams: Streams,
        events: FileEvents,
    ) -> None:
        self.journal = journal
        self.tier1 = tier1
        self.policy = policy
        self.health = health
        self.uploader = uploader
        self.transfer = transfer
        self.publisher = publisher
        self.streams = streams
        self.events = events

    def settings(self, key: str) -> ClassSettings:
        return self.policy.settings(key)

    # -- changes of its bytes ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def changing(self, pf: PendingFile) -> AsyncIterator[None]:
        """Hold `pf`'s lock for a change of its bytes. A background upload of it
        stops (without waiting: it commits nothing of a version that moved on);
        a close's own upload (write-through, a publish waited for) is waited for
        first, holding no lock: its writer was promised what it closed."""
        while True:
            self.uploader.stop(pf)
            while pf.upload is not None and not pf.upload_cancellable:
                await pf.upload_ended.wait()
            async with pf.lock:
                if pf.upload is not None and not pf.upload_cancellable:
                    continue  # a close began uploading meanwhile
                self.uploader.stop(pf)
                yield
                return

    async def let_go(self, pf: PendingFile) -> None:
        """Any upload of `pf` stopped and finished (Uploader.let_go); no lock held."""
        await self.uploader.let_go(pf)

    @contextlib.asynccontextmanager
    async def settled(self, pf: PendingFile) -> AsyncIterator[None]:
        """Hold `pf`'s lock with no upload of it running or due: for an unlink or a
        rename, whose store requests must not race one. The wait for a running
        upload to let go holds no lock."""
        while True:
            await self.uploader.let_go(pf)
            async with pf.lock:
                if pf.upload is not None:
                    continue  # one began meanwhile
                self.uploader.stop(pf)
                yield
                return

    async def replaced(self, pf: PendingFile) -> None:
        """A rename or a special file replaces `pf`'s file: its pending bytes are void
        (its writers, if any, keep them, like those of an unlinked file)."""
        async with self.settled(pf):
            self.journal.leave(pf, REPLACED)

    def notify(self) -> None:
        self.journal.notify()

    def follow(self, pf: PendingFile, session: Followed) -> None:
        """The kernel writes `pf` through `session` (passthrough): parts may follow."""
        self.streams.follow(pf, session)

    def wrote(self, pf: PendingFile, off: int, n: int, settings: ClassSettings) -> None:
        self.streams.wrote(pf, off, n, settings)

    def truncated(self, pf: PendingFile) -> None:
        self.streams.truncated(pf)

    # -- seals --------------------------------------------------------------------------------

    async def seal(self, pf: PendingFile, entry: Entry, *, durable: bool = True) -> int:
        """(holding pf.lock) Kept here: its sealed record in the index, with its
        checksums or, for bytes the kernel wrote itself, a mark that they follow
        (a daemon crash loses nothing); `durable`: the file fsynced too (a
        machine crash neither). The version sealed."""
        await self.tier1.disk(partial(entry.local.seal, durable=durable))
        if entry.local.unhashed:
            self.uploader.digest_soon(entry)
        pf.mark_sealed(entry.size)
        return pf.version

    async def sync_sealed(self, entry: Entry) -> None:
        """An fsync(2) of a file a close sealed without fsyncing its bytes."""
        if entry.state != "dirty":
            await self.tier1.disk(entry.local.sync)

    async def journal_barrier(self, pf: PendingFile, *, if_match: str | None) -> None:
        await self.publisher.journal_barrier(pf, if_match=if_match)

    def close_upload_began(self, pf: PendingFile) -> None:
        """(holding pf.lock) A close uploads what it sealed before it returns:
        writers of the file wait for it (`changing`), nothing else does."""
        pf.upload_began(trio.CancelScope(), cancellable=False)

    async def close_upload_ended(self, pf: PendingFile, version: int, ok: bool) -> None:
        """A close's upload ended; if it failed, the version it sealed never lands."""
        pf.upload_finished()
        if not ok:
            with trio.CancelScope(shield=True):
                async with pf.lock:
                    if pf.version == version and pf.state is FileState.SEALED:
                        pf.mark_unsaved()

    async def land_now(self, pf: PendingFile, entry: Entry, version: int) -> None:
        """A write-through close: upload now; the close fails if the store does not
        take it, and then nothing of it is uploaded later (`last_closed`)."""
        if self.health.degraded:
            raise OSError(errno.EIO, f"{pf.key}: store unreachable; not saved")
        try:
            info = await self.transfer.land(entry, pf=pf, version=version)
        except StoreError as exc:
            raise OSError(exc.errno or errno.EIO, str(exc)) from None
        except (NotVerified, Superseded, OSError) as exc:
            raise OSError(errno.EIO, str(exc)) from None
        await self.uploader.commit(pf, entry, version, info)

    async def publish(self, pf: PendingFile, entry: Entry, version: int, *,
                      if_match: str | None) -> str:
        """A manifest's close with `publish = "wait"`: its new ETag."""
        info = await self.publisher.publish(pf, entry, version, if_match=if_match)
        return info.etag

    # -- its last writer ------------------------------------------------------------------------

    async def last_closed(self, pf: PendingFile, failed: bool) -> None:
        """(holding pf.lock) No writer left: the uploader takes a sealed write-back
        file; a file no close of which succeeded is dropped (never acknowledged)."""
        if pf.state is FileState.GONE:
            return
        if not pf.local:  # never written here, or in the store already
            self.journal.leave(pf, LANDED)
        elif (failed or pf.state is not FileState.SEALED or not self.hand_over(pf)):
            # never acknowledged, or sealed by a close whose upload or publish failed
            await self.drop(pf, DROPPED)

    def hand_over(self, pf: PendingFile) -> bool:
        """A sealed file with no writer left goes up as the class of its name says:
        write-back after the class's quiet delay, a journaled manifest once its
        barrier landed. False if its class uploads only in close (its close did)."""
        if pf.moving:
            return True  # the rename moving it hands it over (rename.py)
        settings = self.policy.settings(pf.key)
        if settings.write_mode == "writeback" or pf.key.endswith("/"):
            pf.not_a_manifest()  # (renamed away from a manifest name)
            self.uploader.kick(pf, settings.upload_delay)
            return True
        if settings.write_mode == "publish" and pf.barrier is not None:
            self.publisher.submit(pf)
            return True
        return False

    async def drop(self, pf: PendingFile, outcome: str) -> None:
        """Forget a local file's bytes (the store's version, if any, shows again)."""
        self.uploader.stop(pf)
        self.streams.abandon(pf)
        await self.tier1.disk(self.tier1.cache.remove, pf.key)
        await self.events.emit(Dropped(pf.key, outcome))
        self.journal.leave(pf, outcome)
