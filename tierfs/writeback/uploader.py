"""Uploads of files written through the mount (DESIGN §5).

`land` is one upload: the sealed cache file goes up as one PUT or as a
multipart upload whose parts this module sends itself, in parallel: each
part's buffer comes from the memory budget and each request takes an upload
worker slot (never a slot reads need). The store then must show the size and
the whole-object digest (xxh3 over the per-chunk checksums, in user metadata)
before the cache file is marked clean; it then stays cached as the object's
tier-1 copy.

Write-back files are uploaded in the background by a few worker tasks, each
after its class's quiet delay (a temporary name's grace period; `hurry` ends
it for flush and umount), with backoff between attempts that waits in trio, and wakes early once the store
answers again. A permanent refusal (PERMANENT_KINDS: AccessDenied,
KeyTooLong, ...) is not retried: the file is quarantined with a note. A writer
that is about to change a file stops its upload first (`stop`).
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from tierfs.budget import BufferPool
from tierfs.cache import Cache, ChunkCorrupt, Entry, tree_digest
from tierfs.config import UPLOAD_RETRY_CAP, UPLOAD_VERIFY_ATTEMPTS
from tierfs.health import StoreHealth
from tierfs.posix import SYMLINK_MAX, Attrs, listing_misleads, upload_metadata
from tierfs.store.base import PERMANENT_KINDS, ObjectInfo, Store, StoreError, part_size_for
from tierfs.workers import Workers
from tierfs.writeback.journal import Condition, Journal, PendingFile
from tierfs.writeback.quarantine import DAMAGED, REFUSED, Quarantine
from tierfs.writeback.streaming import Stream, Streams, fresh, stream_metadata

log = logging.getLogger(__name__)

DIGEST_META = "tierfs-xxh3tree"  # xxh3-128 over per-1 MiB-chunk xxh3-64 digests


class NotVerified(Exception):
    """The store took an upload but does not show the bytes that were sent."""


class Uploader:
    def __init__(
        self,
        store: Store,
        cache: Cache,
        journal: Journal,
        quarantine: Quarantine,
        workers: Workers,
        parts: BufferPool,
        health: StoreHealth,
        streams: Streams,
        *,
        part_size: int,
        parallel_parts: int,
        max_files: int,
        on_landed: Callable[[str, ObjectInfo], Awaitable[None]],
        on_dropped: Callable[[str], None],
        on_conflict: Callable[[PendingFile, Entry, StoreError], Awaitable[None]],
        observe: Callable[[str, int], None],
    ) -> None:
        self.store = store
        self.cache = cache
        self.journal = journal
        self.quarantine = quarantine
        self.workers = workers
        self.parts = parts
        self.health = health
        self.streams = streams
        self.part_size = part_size
        self.parallel_parts = parallel_parts
        self.max_files = max_files
        self.on_landed = on_landed  # the namespace takes the store's attributes
        self.on_dropped = on_dropped  # the namespace forgets a local file
        self.on_conflict = on_conflict  # a manifest's conditional PUT lost its race
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
        """Take the checksums `entry`'s seal left to take (Entry.take_digests), in the
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
                    while not await self.workers.disk(entry.take_digests):
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
                pf.error = "unexpected failure (see the log); retried by tierfs pending retry"

    def _due(self, pf: PendingFile) -> bool:
        return (self.journal.get(pf.key) is pf and pf.sealed and not pf.sessions
                and pf.upload is None and not pf.unlinked
                and pf.barrier is None)  # a manifest goes up once its barrier landed

    async def _until_landed(self, pf: PendingFile) -> None:
        attempt = unverified = 0
        while self._due(pf):
            with trio.CancelScope() as scope:
                pf.upload, pf.upload_ended = scope, trio.Event()
                try:
                    entry = await self.workers.disk(self.cache.open_existing, pf.key)
                    if entry is None:  # gone from the cache meanwhile (unlinked, renamed)
                        return
                    try:
                        cond = pf.condition
                        try:
                            info = await self.land(
                                pf, entry, if_match=cond.if_match if cond else None,
                                if_none_match=cond.if_none_match if cond else False)
                        except StoreError as exc:
                            if cond is None or exc.kind != "precondition":
                                raise
                            await self.on_conflict(pf, entry, exc)
                            return
                        if cond is not None and (cond.if_match or cond.if_none_match):
                            pf.condition = Condition(info.etag, False)  # the next publish's
                    finally:
                        with trio.CancelScope(shield=True):
                            await self.workers.disk(self.cache.release, entry)
                    self.journal.landed(pf)
                    return
                except StoreError as exc:
                    if exc.kind in PERMANENT_KINDS:
                        await self.refuse(pf, str(exc))
                        return
                    pf.error = str(exc)
                except NotVerified as exc:
                    unverified += 1
                    pf.error = str(exc)
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
                except OSError as exc:  # reading the local copy failed
                    pf.error = f"reading the local copy: {exc}"
                finally:
                    pf.upload = None
                    pf.upload_ended.set()
                    self.journal.notify()
            if scope.cancelled_caught:
                return  # a writer stopped it; its last close queues it again
            attempt += 1
            delay = min(UPLOAD_RETRY_CAP, 0.5 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)
            log.warning("upload of %r failed (%s); retrying in %.1fs", pf.key, pf.error, delay)
            self.observe("upload_retry", 1)
            await self._backoff(pf, delay)

    async def _backoff(self, pf: PendingFile, delay: float) -> None:
        """Wait `delay` seconds, or less: until the store answers again, or a retry
        is asked for (`tierfs pending retry`)."""
        pf.nudged = trio.Event()
        with trio.move_on_after(delay):
            async with trio.open_nursery() as nursery:
                for wait in (self.health.wait_back, pf.nudged.wait):
                    nursery.start_soon(self._first, wait, nursery.cancel_scope)

    @staticmethod
    async def _first(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
        await wait()
        scope.cancel()

    async def stop(self, pf: PendingFile) -> None:
        """Stop a background upload of `pf` (bytes are about to change) and wait
        until it let go of the file."""
        self._ready.pop(id(pf), None)
        self._later.pop(id(pf), None)
        if pf.upload is not None:
            pf.upload.cancel()
            await pf.upload_ended.wait()

    async def refuse(self, pf: PendingFile, reason: str, kind: str = REFUSED) -> None:
        """The store will never take the file as it is (or its local copy is damaged:
        `kind`): keep it aside, report it."""
        why = "refused by the store" if kind == REFUSED else "not uploaded"
        log.error("upload of %r %s: %s; quarantined, not retried", pf.key, why, reason)
        pf.error = reason
        self.streams.abandon(pf)
        await self.workers.disk(self.quarantine.keep, pf.key, kind, reason)
        self.on_dropped(pf.key)
        self.observe("quarantined", 1)
        self.journal.leave(pf, "refused")

    # -- one upload -------------------------------------------------------------------------

    async def land(
        self,
        pf: PendingFile | None,
        entry: Entry,
        *,
        key: str | None = None,
        mtime: float | None = None,
        attrs: Attrs | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
        mark_clean: bool = True,
    ) -> ObjectInfo:
        """Upload `entry` under `key` (default: its own), verify it, and (if still
        sealed and `mark_clean`) mark the cache file clean under the new ETag.
        `pf` (if any) counts the bytes acknowledged. Raises StoreError, NotVerified,
        OSError (reading tier 1), or Cancelled (a stopped upload is aborted)."""
        key = key or entry.key
        size = entry.size
        sealed = entry.state == "sealed"
        sums = await self.workers.disk(entry.chunk_sums) if sealed else None
        digest = None if sums is None else tree_digest(sums)
        # A journaled dir marker (make_dir) is a directory to stores like SeaweedFS,
        # which keep no user metadata on it: its size is its proof.
        meta = {} if key.endswith("/") or digest is None else {
            DIGEST_META: digest,
            **upload_metadata(pf.attrs if pf is not None else attrs,
                              pf.mtime_ns if pf is not None else round((mtime or 0.0) * 1e9)),
        }
        cond = Condition(if_match, if_none_match)
        if pf is not None:
            pf.uploaded = 0
            pf.fresh = False  # its key may hold an object from here on (a PUT cut short)
        # Parts sent while the file was written (streaming.py) complete here.
        taken = None if pf is None else await self.streams.take(
            pf, key, size, stream_metadata(pf.attrs, pf.mtime_ns),
            usable=digest is not None and cond == (None, False))
        if taken is not None:
            assert pf is not None and sums is not None and digest is not None
            await self._put_streamed(pf, entry, key, size, sums, digest, taken)
        elif self.store.uploads_files and not (size <= SYMLINK_MAX and listing_misleads(meta)):
            await self._put_file(pf, entry, key, meta, cond)
        elif size <= self.part_size:
            await self._put_whole(pf, entry, key, size, meta, cond)
        else:
            await self._put_parts(pf, entry, key, size, meta, cond)
        info = await self.workers.meta(self.store.head, key)
        # A streamed upload carries its digest as a tag (S3 took its metadata at create).
        got = ((await self.workers.meta(self.store.get_tags, key)).get(DIGEST_META)
               if taken is not None else info.metadata.get(DIGEST_META))
        if info.size != size or (meta and got != digest):
            raise NotVerified(
                f"upload of {key!r} did not verify: store has {info.size} bytes, "
                f"digest {got!r}; expected {size}, {digest!r}")
        self.observe("uploaded", size)
        if mark_clean and entry.state == "sealed":
            # The namespace takes the new ETag before the cache record turns clean:
            # an open racing with this then pairs the new ETag with a sealed record
            # (kept). The other order let an open pair the old ETag with a clean
            # record under the new one: dropped as replaced, refetched with the
            # old ETag, 412 (seen in test_write_model once uploads got fewer threads).
            await self.on_landed(key, info)
            await self.workers.disk(
                partial(entry.set_state, "clean", etag=info.etag, mtime=info.mtime))
        return info

    async def _put_file(
        self, pf: PendingFile | None, entry: Entry, key: str, meta: dict[str, str],
        cond: Condition,
    ) -> None:
        """The store's transfer engine reads the sealed cache file itself (parts in
        parallel, checksummed, in its own threads: store/crt.py). Not cancelled
        midway: a stop (`stop`) waits for it to end, as for a single PUT, since
        a cancelled request's fate at the store is unknown (it may complete after
        a rename's DELETE of the old name). A file with chunks not yet verified
        against their checksums since this daemon started (one recovered after a
        crash) is read back first, as the parts path reads it: the engine does not
        check them, and damaged bytes are never uploaded (ChunkCorrupt)."""
        if entry.unverified() and entry.size:
            buf = await self.parts.take(min(self.part_size, entry.size))
            try:
                for off in range(0, entry.size, len(buf)):
                    await self._read(entry, off, buf[: min(len(buf), entry.size - off)])
            finally:
                self.parts.give(buf)

        def progress(n: int) -> None:  # from the engine's threads: a plain count
            if pf is not None:
                pf.uploaded += n

        await self.workers.upload(partial(
            self.store.put_file, key, str(entry.path), metadata=meta,
            if_match=cond.if_match, if_none_match=cond.if_none_match, progress=progress))
        if pf is not None:
            self.journal.notify()

    async def _put_whole(
        self, pf: PendingFile | None, entry: Entry, key: str, size: int,
        meta: dict[str, str], cond: Condition,
    ) -> None:
        # (a small executable or private file: listings must show it may be typed)
        put = partial(self.store.put_bytes, metadata=meta, if_match=cond.if_match,
                      if_none_match=cond.if_none_match,
                      typed=size <= SYMLINK_MAX and listing_misleads(meta))
        if not size:
            await self.workers.upload(partial(put, key, b""))
            return
        buf = await self.parts.take(size)
        try:
            await self._read(entry, 0, buf)
            await self.workers.upload(partial(put, key, buf))
        finally:
            self.parts.give(buf)
        self._acknowledged(pf, size)

    async def _put_parts(
        self, pf: PendingFile | None, entry: Entry, key: str, size: int,
        meta: dict[str, str], cond: Condition,
    ) -> None:
        part = part_size_for(size, self.part_size)
        count = -(-size // part)
        upload_id = await self.workers.upload(
            partial(self.store.create_upload, key, metadata=meta))
        try:
            etags: list[str] = [""] * count
            slots = trio.Semaphore(self.parallel_parts)

            async def send(i: int) -> None:
                try:
                    off = i * part
                    n = min(part, size - off)
                    buf = await self.parts.take(n)
                    try:
                        await self._read(entry, off, buf)
                        etags[i] = await self.workers.upload(
                            self.store.upload_part, key, upload_id, i + 1, off, buf)
                    finally:
                        self.parts.give(buf)
                    self._acknowledged(pf, n)
                finally:
                    slots.release()

            try:
                async with trio.open_nursery() as nursery:
                    for i in range(count):
                        await slots.acquire()
                        nursery.start_soon(send, i)
            except BaseExceptionGroup as group:
                raise _one_error(group) from None
            await self.workers.upload(partial(
                self.store.complete_upload, key, upload_id, list(enumerate(etags, 1)), size,
                if_match=cond.if_match, if_none_match=cond.if_none_match))
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.workers.upload(self.store.abort_upload, key, upload_id)
            raise

    async def _put_streamed(
        self, pf: PendingFile, entry: Entry, key: str, size: int, sums: bytes, digest: str,
        s: Stream,
    ) -> None:
        """Complete the upload the writer's parts went into: parts still as sent are
        kept (`sums`: the sealed file's chunk checksums), the others (the tail,
        parts written again) go now; the digest (`tree_digest(sums)`) follows as a tag."""
        part = s.part
        count = -(-size // part)
        etags: list[str] = [""] * count
        todo = []
        per = part // entry.chunk_size * 8
        for i in range(count):
            n = min(part, size - i * part)
            kept = fresh(s, i, sums[i * per:(i + 1) * per]) if n == part else None
            if kept is not None:
                etags[i] = kept
                self._acknowledged(pf, n)
            else:
                todo.append((i, n))
        assert s.upload_id is not None
        try:
            slots = trio.Semaphore(self.parallel_parts)

            async def send(i: int, n: int) -> None:
                try:
                    etags[i] = (await self.streams.send_part(s, entry, i, n))[0]
                    self._acknowledged(pf, n)
                finally:
                    slots.release()

            try:
                async with trio.open_nursery() as nursery:
                    for i, n in todo:
                        await slots.acquire()
                        nursery.start_soon(send, i, n)
            except BaseExceptionGroup as group:
                raise _one_error(group) from None
            await self.workers.upload(partial(
                self.store.complete_upload, key, s.upload_id, list(enumerate(etags, 1)), size))
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.streams.aborted(s)
            raise
        await self.streams.completed(s)
        self.observe("streamed_parts", count - len(todo))
        await self.workers.meta(self.store.put_tags, key, {DIGEST_META: digest})

    async def _read(self, entry: Entry, off: int, buf: memoryview) -> None:
        got = await self.workers.disk(entry.readinto, off, buf)
        if got != len(buf):
            raise OSError(errno.EIO, f"{entry.key}: tier-1 copy ended at {off + got} bytes")

    def _acknowledged(self, pf: PendingFile | None, n: int) -> None:
        if pf is not None:
            pf.uploaded += n
            self.journal.notify()


def _one_error(group: BaseExceptionGroup) -> BaseException:
    """The parts' nursery groups its failures (trio's strict groups, even for one);
    the upload failed as its first part did, so the caller's `except StoreError`
    (retry, quarantine) sees it. A group holding anything but plain errors (a
    cancellation, an interrupt) stays whole."""
    rest = group.split(Exception)[1]
    if rest is not None:
        return group
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf
