"""Background uploads of sealed write-back files (DESIGN §5).

A few worker tasks take each sealed file with no writer open after its
class's quiet delay (a temporary name's grace period; `hurry` ends it for
flush and umount) and upload it (transfer.py), with backoff between attempts
that waits in trio and wakes early once the store answers again. A permanent
refusal (PERMANENT_KINDS: AccessDenied, KeyTooLong, ...) is not retried: the
file is quarantined with a note. A manifest's conditional PUT that loses its
race keeps the bytes aside (conflicts/).

A writer about to change a file stops its upload (`stop`: no wait; the upload
commits nothing once the file's version moved, transfer.py). Those whose next
step must not race the upload's store side effects (unlink, rename) wait for
it to let go (`let_go`), holding no lock meanwhile. Whoever uploaded a file
commits the result under the file's lock (`commit`): the namespace learns
the new ETag (a Landed event), the tier-1 record turns clean, the file
leaves the journal, all only if the version uploaded is still the file's.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from tierfs.cache import Cache, ChunkCorrupt, Entry
from tierfs.config import UPLOAD_RETRY_CAP, UPLOAD_VERIFY_ATTEMPTS
from tierfs.events import Conflict, Dropped, FileEvents, Landed
from tierfs.health import StoreHealth
from tierfs.store.base import PERMANENT_KINDS, ObjectInfo, StoreError
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal
from tierfs.writeback.pending import CONFLICT, REFUSED, Condition, FileState, PendingFile
from tierfs.writeback.quarantine import DAMAGED, Conflicts, Quarantine
from tierfs.writeback.quarantine import REFUSED as REFUSED_NOTE
from tierfs.writeback.records import BarrierRecords
from tierfs.writeback.streaming import Streams
from tierfs.writeback.transfer import NotVerified, Superseded, Transfer

log = logging.getLogger(__name__)


class Uploader:
    def __init__(
        self,
        transfer: Transfer,
        cache: Cache,
        journal: Journal,
        quarantine: Quarantine,
        conflicts: Conflicts,
        barriers: BarrierRecords,
        workers: Workers,
        health: StoreHealth,
        streams: Streams,
        events: FileEvents,
        *,
        max_files: int,
        observe: Callable[[str, int], None],
    ) -> None:
        self.transfer = transfer
        self.cache = cache
        self.journal = journal
        self.quarantine = quarantine
        self.conflicts = conflicts
        self.barriers = barriers
        self.workers = workers
        self.health = health
        self.streams = streams
        self.events = events
        self.max_files = max_files
        self.observe = observe
        # Files due for a background upload, oldest first; a file is in it once.
        self._ready: OrderedDict[int, PendingFile] = OrderedDict()
        self._idle = trio.lowlevel.ParkingLot()  # workers waiting for a file
        # Files in their quiet delay: id -> (due, file); the heap orders them
        # (entries whose due no longer matches are stale and skipped).
        self._later: dict[int, tuple[float, PendingFile]] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self._timer = trio.lowlevel.ParkingLot()
        self._again: dict[int, PendingFile] = {}  # kicked while an attempt let go
        self._nursery: trio.Nursery | None = None
        self._hashing = trio.CapacityLimiter(1)  # checksums taken after seals, one file at a time
        self.digesting = 0  # sealed files whose checksums are still being taken

    # -- the background uploader ------------------------------------------------------

    def kick(self, pf: PendingFile, delay: float = 0.0) -> None:
        """A sealed write-back file with no writer open: upload it (again), once it
        stayed quiet `delay` seconds."""
        if delay > 0:
            self._ready.pop(id(pf), None)
            due = trio.current_time() + delay
            self._later[id(pf)] = (due, pf)
            heapq.heappush(self._heap, (due, next(self._seq), id(pf)))
            self._timer.unpark()
            return
        self._later.pop(id(pf), None)
        if pf.upload is not None:  # an attempt still letting go: due again once it did
            self._again[id(pf)] = pf
            return
        self._ready[id(pf)] = pf
        self._ready.move_to_end(id(pf))
        self._idle.unpark()

    def hurry(self, pf: PendingFile) -> None:
        """End `pf`'s quiet delay now (flush and umount do not wait for it)."""
        if id(pf) in self._later:
            self.kick(pf)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._release_quiet)
            for _ in range(self.max_files):
                nursery.start_soon(self._worker)

    def digest_soon(self, entry: Entry) -> None:
        """Take the checksums `entry`'s seal left to take (LocalCopy.take_digests), in the
        background: done by the time its quiet delay ends, else its upload takes
        the rest itself."""
        if self._nursery is not None and self.cache.retain(entry):
            self.digesting += 1
            self._nursery.start_soon(self._take_digests, entry)

    async def _take_digests(self, entry: Entry) -> None:
        # Shielded: a daemon stopped on purpose (umount, SIGTERM before a reboot)
        # takes them first, so a clean reboot quarantines nothing as unchecked.
        with trio.CancelScope(shield=True):
            try:
                async with self._hashing:
                    while not await self.workers.disk(entry.local.take_digests):
                        pass
            except OSError as exc:  # its upload tries again, and reports what it finds
                log.warning("taking the checksums of %r: %s", entry.key, exc)
            except Exception:  # the uploader must outlive any one file
                log.exception("taking the checksums of %r failed unexpectedly", entry.key)
            finally:
                self.digesting -= 1
                await self.workers.disk(self.cache.release, entry)

    async def _release_quiet(self) -> None:
        """Hand files whose quiet delay ended to the workers."""
        while True:
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                due, _, ident = heapq.heappop(self._heap)
                held = self._later.get(ident)
                if held is not None and held[0] == due:
                    self.kick(held[1])
            with trio.move_on_at(self._heap[0][0] if self._heap else math.inf):
                await self._timer.park()

    async def _worker(self) -> None:
        while True:
            while not self._ready:
                await self._idle.park()
            _, pf = self._ready.popitem(last=False)
            if not self._due(pf):
                continue
            try:
                await self._until_landed(pf)
            except Exception:  # the uploader must outlive any one file
                log.exception("upload of %r failed unexpectedly; it stays pending", pf.key)
                pf.upload_failed("unexpected failure (see the log); retried by tierfs pending retry")

    def _due(self, pf: PendingFile) -> bool:
        return (self.journal.get(pf.key) is pf and pf.state is FileState.SEALED
                and not pf.sessions and pf.upload is None
                and pf.barrier is None)  # a manifest goes up once its barrier landed

    async def _until_landed(self, pf: PendingFile) -> None:
        attempt = unverified = 0
        while self._due(pf):
            version = pf.version
            with trio.CancelScope() as scope:
                pf.upload_began(scope)
                try:
                    if await self._attempt(pf, version):
                        return
                except StoreError as exc:
                    if exc.kind in PERMANENT_KINDS:
                        await self.refuse(pf, str(exc))
                        return
                    pf.upload_failed(str(exc))
                except NotVerified as exc:
                    unverified += 1
                    pf.upload_failed(str(exc))
                    if unverified >= UPLOAD_VERIFY_ATTEMPTS:
                        await self.refuse(pf, f"{exc} ({unverified} attempts)")
                        return
                except ChunkCorrupt as exc:
                    # Bytes a close sealed (checksums taken, no fsync) that a machine
                    # crash took before the kernel wrote them back, or a damaged
                    # disk: never uploaded as they are now.
                    await self.refuse(pf, f"the local copy no longer matches what was written "
                                          f"({exc}); never fsynced before a crash?", DAMAGED)
                    return
                except Superseded:
                    return  # written again: its writer's last close queues it again
                except OSError as exc:  # reading the local copy failed
                    pf.upload_failed(f"reading the local copy: {exc}")
                finally:
                    pf.upload_finished()
                    if self._again.pop(id(pf), None) is not None:
                        self.kick(pf)  # handed over again while this attempt let go
            if scope.cancelled_caught:
                return  # a writer stopped it; its last close queues it again
            attempt += 1
            delay = min(UPLOAD_RETRY_CAP, 0.5 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)
            log.warning("upload of %r failed (%s); retrying in %.1fs", pf.key, pf.error, delay)
            self.observe("upload_retry", 1)
            await self._backoff(pf, delay)

    async def _attempt(self, pf: PendingFile, version: int) -> bool:
        """One upload of `pf` at `version`; whether it is done with (landed, gone,
        or kept aside as a conflict)."""
        entry = await self.workers.disk(self.cache.open_existing, pf.key)
        if entry is None:  # gone from the cache meanwhile (unlinked, renamed)
            return True
        try:
            cond = pf.condition
            try:
                info = await self.transfer.land(
                    entry, pf=pf, version=version,
                    if_match=cond.if_match if cond else None,
                    if_none_match=cond.if_none_match if cond else False)
            except StoreError as exc:
                if cond is None or exc.kind != "precondition":
                    raise
                await self.lost_race(pf, entry, exc)
                return True
            if cond is not None and (cond.if_match or cond.if_none_match):
                pf.set_condition(Condition(info.etag, False))  # the next publish's
            await self.commit(pf, entry, version, info)
            return True
        finally:
            with trio.CancelScope(shield=True):
                await self.workers.disk(self.cache.release, entry)

    async def _backoff(self, pf: PendingFile, delay: float) -> None:
        """Wait `delay` seconds, or less: until the store answers again, or a retry
        is asked for (`tierfs pending retry`)."""
        nudged = pf.new_nudge()
        with trio.move_on_after(delay):
            async with trio.open_nursery() as nursery:
                for wait in (self.health.wait_back, nudged.wait):
                    nursery.start_soon(self._first, wait, nursery.cancel_scope)

    @staticmethod
    async def _first(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
        await wait()
        scope.cancel()

    # -- what writers and the namespace's changes ask of it -------------------------------

    def stop(self, pf: PendingFile) -> None:
        """A writer changes `pf` now: no background upload of it starts, and one
        running stops (it commits nothing of a version that moved on; no wait)."""
        self._ready.pop(id(pf), None)
        self._later.pop(id(pf), None)
        self._again.pop(id(pf), None)
        if pf.upload is not None and pf.upload_cancellable:
            pf.upload.cancel()

    async def let_go(self, pf: PendingFile) -> None:
        """Stop any upload of `pf` and wait until it let go of the file and of the
        store (its last request returned): before an unlink or a rename, whose
        store requests must not race it. Call it holding no lock."""
        self.stop(pf)
        while pf.upload is not None:
            self.stop(pf)
            await pf.upload_ended.wait()

    async def commit(self, pf: PendingFile, entry: Entry, version: int, info: ObjectInfo) -> bool:
        """`version` of `pf` is in the store as `info`: if it still is the file's,
        the namespace takes the new ETag, then the cache record turns clean (in
        that order: an open racing with this pairs the new ETag with a sealed
        record, kept; the other order let an open pair the old ETag with a clean
        record under the new one, refetched with the old ETag: 412), and the
        file leaves the journal unless a writer holds it. False if it was written
        since: the store has the version uploaded, the file stays local."""
        async with pf.lock:
            if pf.version != version or pf.state is not FileState.SEALED:
                return False
            with trio.CancelScope(shield=True):  # all three, or none: a stop waits for them
                if entry.state == "sealed":
                    await self.events.emit(Landed(info.key, info))
                    await self.workers.disk(
                        partial(entry.local.clean, etag=info.etag, mtime=info.mtime))
            return self.journal.landed(pf, version)

    async def refuse(self, pf: PendingFile, reason: str, kind: str = REFUSED_NOTE) -> None:
        """The store will never take the file as it is (or its local copy is damaged:
        `kind`): keep it aside, report it."""
        why = "refused by the store" if kind == REFUSED_NOTE else "not uploaded"
        log.error("upload of %r %s: %s; quarantined, not retried", pf.key, why, reason)
        pf.upload_failed(reason)
        self.streams.abandon(pf)
        await self.workers.disk(self.quarantine.keep, pf.key, kind, reason)
        await self.events.emit(Dropped(pf.key, kind))
        self.observe("quarantined", 1)
        self.journal.leave(pf, REFUSED)

    async def lost_race(self, pf: PendingFile, entry: Entry, exc: StoreError) -> None:
        """A manifest's background PUT lost its race: keep the bytes, say so everywhere."""
        note = await self.workers.disk(partial(self.conflicts.keep, entry, str(exc), told=False))
        kept = self.conflicts.root / note.file
        log.error("manifest %r changed in the store before its background publish: "
                  "not published, kept at %s", pf.key, kept)
        self.observe("publish_conflict", 1)
        pf.upload_failed(f"lost a concurrent update: kept at {kept}")
        await self.events.emit(Conflict(pf.key, str(kept)))
        await self.workers.disk(self.barriers.drop, pf.key, pf.record)
        self.journal.leave(pf, CONFLICT)
