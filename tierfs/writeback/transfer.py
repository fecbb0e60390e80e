"""One upload of a file's tier-1 copy (DESIGN §5): the seam a transfer engine
plugs into.

The sealed cache file goes up as one PUT or as a multipart upload whose parts
this module sends itself, in parallel: each part's buffer comes from the
memory budget and each request takes an upload worker slot (never a slot
reads need). Parts sent while the file was written (streaming.py) complete
here. The store then must show the size and the whole-object digest (xxh3
over the per-chunk checksums, in user metadata or a tag) before the upload
counts as landed.

An upload reads the file with no lock held: a writer may change it meanwhile
(it bumps the file's version first). What was read is committed to the store
(CompleteMultipartUpload, or the PUT) only if the version is still the one
sealed, checked after the last byte was read (`Superseded` otherwise): the
store never gets a mix of two versions. Once committed, a stop (cancel) no
longer interrupts it: its caller learns the new ETag (a manifest's next
conditional PUT names it).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable
from functools import partial

import trio

from tierfs.budget import BufferPool
from tierfs.cache import Entry, tree_digest
from tierfs.posix import SYMLINK_MAX, Attrs, listing_misleads, upload_metadata
from tierfs.store.base import ObjectInfo, Store, part_size_for
from tierfs.workers import Workers
from tierfs.writeback.pending import Condition, PendingFile
from tierfs.writeback.streaming import Stream, Streams, fresh, stream_metadata

DIGEST_META = "tierfs-xxh3tree"  # xxh3-128 over per-1 MiB-chunk xxh3-64 digests


class NotVerified(Exception):
    """The store took an upload but does not show the bytes that were sent."""


class Superseded(Exception):
    """The file was written while its upload read it: nothing was committed."""


class Transfer:
    def __init__(
        self, store: Store, workers: Workers, parts: BufferPool, streams: Streams, *,
        part_size: int, parallel_parts: int, observe: Callable[[str, int], None],
    ) -> None:
        self.store = store
        self.workers = workers
        self.parts = parts
        self.streams = streams
        self.part_size = part_size
        self.parallel_parts = parallel_parts
        self.observe = observe

    async def land(
        self,
        entry: Entry,
        *,
        pf: PendingFile | None = None,
        version: int = 0,
        key: str | None = None,
        mtime: float | None = None,
        attrs: Attrs | None = None,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> ObjectInfo:
        """Upload `entry` under `key` (default: its own) and verify it. With `pf`, the
        bytes are its sealed `version`, committed only if it is still that version
        once they were read; `pf` counts the bytes acknowledged. Raises
        StoreError, NotVerified, Superseded, OSError (reading tier 1), or
        Cancelled (a stopped upload is aborted)."""
        key = key or entry.key

        def unchanged() -> None:
            if pf is not None and pf.version != version:
                raise Superseded(f"{key!r} was written while it uploaded")

        unchanged()
        size = entry.size
        sums = None
        if entry.state == "sealed":
            try:
                sums = await self.workers.disk(entry.local.chunk_sums)
            except ValueError:  # dirty again: written since the check above
                raise Superseded(f"{key!r} was written while it uploaded") from None
        digest = None if sums is None else tree_digest(sums)
        # A journaled dir marker (make_dir) is a directory to stores like SeaweedFS,
        # which keep no user metadata on it: its size is its proof.
        meta = {} if key.endswith("/") or digest is None else {
            DIGEST_META: digest,
            **upload_metadata(pf.attrs if pf is not None else attrs,
                              pf.mtime_ns if pf is not None else round((mtime or 0.0) * 1e9)),
        }
        attrs_set = 0 if pf is None else pf.attrs_set  # the attributes `meta` holds
        cond = Condition(if_match, if_none_match)
        if pf is not None:
            pf.sending()  # its key may hold an object from here on (a PUT cut short)
        # Parts sent while the file was written (streaming.py) complete here.
        taken = None if pf is None else await self.streams.take(
            pf, key, size, stream_metadata(pf.attrs, pf.mtime_ns),
            usable=digest is not None and cond == (None, False))
        if taken is not None:
            assert pf is not None and sums is not None and digest is not None
            await self._put_streamed(pf, entry, key, size, sums, digest, taken, unchanged)
        elif self.store.uploads_files and not (size <= SYMLINK_MAX and listing_misleads(meta)):
            await self._put_file(pf, entry, key, meta, cond, unchanged)
        elif size <= self.part_size:
            await self._put_whole(pf, entry, key, size, meta, cond, unchanged)
        else:
            await self._put_parts(pf, entry, key, size, meta, cond, unchanged)
        with trio.CancelScope(shield=True):  # committed: a stop lets the caller learn it
            info = await self.workers.meta(self.store.head, key)
            # A streamed upload carries its digest as a tag (S3 took its metadata at create).
            got = ((await self.workers.meta(self.store.get_tags, key)).get(DIGEST_META)
                   if taken is not None else info.metadata.get(DIGEST_META))
        if info.size != size or (meta and got != digest):
            raise NotVerified(
                f"upload of {key!r} did not verify: store has {info.size} bytes, "
                f"digest {got!r}; expected {size}, {digest!r}")
        self.observe("uploaded", size)
        return await self._attrs_since(pf, key, info, attrs_set)

    async def _attrs_since(
        self, pf: PendingFile | None, key: str, info: ObjectInfo, seen: int
    ) -> ObjectInfo:
        """chmod, chown and utimens calls made while the upload ran (its metadata
        was taken at its start; the calls only changed the pending record) reach
        the store too, before the landing is committed: CopyObject onto the new
        version with the file's attributes as they are now. Without it such a
        call was lost: the store, and every other node, kept the old owner."""
        while pf is not None and pf.attrs_set != seen:
            seen = pf.attrs_set
            meta = upload_metadata(pf.attrs, pf.mtime_ns)
            info = await self.workers.meta(partial(
                self.store.replace_metadata, key, meta, etag=info.etag,
                typed=listing_misleads(meta)))
        return info

    async def _put_file(
        self, pf: PendingFile | None, entry: Entry, key: str, meta: dict[str, str],
        cond: Condition, unchanged: Callable[[], None],
    ) -> None:
        """The store's transfer engine reads the sealed cache file itself (parts in
        parallel, checksummed, in its own threads: store/crt.py), reading and
        completing in one call: no version check can sit between the two, so
        from here writers of the file wait for the upload to end (holding no
        lock: Lifecycle.changing), and a stop no longer cancels it (a cancelled
        request's fate at the store is unknown: it may complete after a rename's
        DELETE of the old name). A file with chunks not yet verified against
        their checksums since this daemon started (one recovered after a crash)
        is read back first, as the parts path reads it: the engine does not check
        them, and damaged bytes are never uploaded (ChunkCorrupt)."""
        if entry.serve.unverified() and entry.size:
            buf = await self.parts.take(min(self.part_size, entry.size))
            try:
                for off in range(0, entry.size, len(buf)):
                    await self._read(entry, off, buf[: min(len(buf), entry.size - off)])
            finally:
                self.parts.give(buf)
        if pf is not None:
            pf.upload_uncancellable()
        unchanged()

        def progress(n: int) -> None:  # from the engine's threads: a plain count
            if pf is not None:
                pf.acknowledged_elsewhere(n)

        with trio.CancelScope(shield=True):  # read and committed in one call
            await self.workers.upload(partial(
                self.store.put_file, key, str(entry.path), metadata=meta,
                if_match=cond.if_match, if_none_match=cond.if_none_match, progress=progress))
        if pf is not None:
            pf.acknowledged(0)

    async def _put_whole(
        self, pf: PendingFile | None, entry: Entry, key: str, size: int,
        meta: dict[str, str], cond: Condition, unchanged: Callable[[], None],
    ) -> None:
        # (a small executable or private file: listings must show it may be typed)
        put = partial(self.store.put_bytes, metadata=meta, if_match=cond.if_match,
                      if_none_match=cond.if_none_match,
                      typed=size <= SYMLINK_MAX and listing_misleads(meta))
        if not size:
            unchanged()
            with trio.CancelScope(shield=True):  # the commit point
                await self.workers.upload(partial(put, key, b""))
            return
        buf = await self.parts.take(size)
        try:
            await self._read(entry, 0, buf)
            unchanged()
            with trio.CancelScope(shield=True):  # the commit point
                await self.workers.upload(partial(put, key, buf))
        finally:
            self.parts.give(buf)
        self._acknowledged(pf, size)

    async def _put_parts(
        self, pf: PendingFile | None, entry: Entry, key: str, size: int,
        meta: dict[str, str], cond: Condition, unchanged: Callable[[], None],
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
            unchanged()
            with trio.CancelScope(shield=True):  # the commit point
                await self.workers.upload(partial(
                    self.store.complete_upload, key, upload_id, list(enumerate(etags, 1)),
                    size, if_match=cond.if_match, if_none_match=cond.if_none_match))
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.workers.upload(self.store.abort_upload, key, upload_id)
            raise

    async def _put_streamed(
        self, pf: PendingFile, entry: Entry, key: str, size: int, sums: bytes, digest: str,
        s: Stream, unchanged: Callable[[], None],
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
            unchanged()
            with trio.CancelScope(shield=True):  # the commit point
                await self.workers.upload(partial(
                    self.store.complete_upload, key, s.upload_id, list(enumerate(etags, 1)),
                    size))
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.streams.aborted(s)
            raise
        with trio.CancelScope(shield=True):
            await self.streams.completed(s)
            self.observe("streamed_parts", count - len(todo))
            await self.workers.meta(self.store.put_tags, key, {DIGEST_META: digest})

    async def _read(self, entry: Entry, off: int, buf: memoryview) -> None:
        got = await self.workers.disk(entry.local.read_into, off, buf)
        if got != len(buf):
            raise OSError(errno.EIO, f"{entry.key}: tier-1 copy ended at {off + got} bytes")

    @staticmethod
    def _acknowledged(pf: PendingFile | None, n: int) -> None:
        if pf is not None:
            pf.acknowledged(n)



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
