"""Write path (DESIGN §5): sealing, the upload journal, the uploader, recovery, the barrier.

A file written through the mount lives in its tier-1 cache file. Closing or
fsyncing it *seals* it: the cache fsyncs the file, records its chunk
checksums and marks the object `sealed` in the synced LMDB index. That index
record is the journal: after a crash every sealed object is found again and
uploaded; an object still `dirty` was never closed and is quarantined
(kept under `quarantine/`, reported, never uploaded half-written).

Write-back classes return from close once sealed; the uploader (tasks in the
daemon nursery) uploads in the background with parallel multipart parts and
retries until the store takes it. Write-through classes wait for the upload
in close. An upload is verified (size, and the whole-object digest stored as
user metadata) before the cache file is marked clean; it then stays cached
as the object's tier-1 copy, no re-download.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from tierfs.cache import Cache, Entry
from tierfs.policy import Policy
from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)

DIGEST_META = "tierfs-xxh3tree"  # xxh3-128 over per-1 MiB-chunk xxh3-64 digests
MTIME_META = "tierfs-mtime"
RETRY_CAP = 30.0


class UploadCancelled(Exception):
    """A writer reopened the file: this upload is void, a newer one will follow."""


@dataclass
class LocalFile:
    """A file whose bytes exist only on this node (dirty or sealed)."""

    size: int
    mtime: float
    sealed_at: float | None = None  # monotonic; None while dirty
    uploaded: int = 0  # bytes acknowledged by the store in the current attempt
    done: trio.Event = field(default_factory=trio.Event)  # set when landed or dropped
    cancel: bool = False
    writers: int = 0  # handles open for writing: no upload starts while any is open
    uploading: trio.Event | None = None  # set while an upload runs, fired when it ends
    error: str | None = None  # last upload failure, for status


class WriteBack:
    def __init__(
        self,
        store: Store,
        cache: Cache,
        policy: Policy,
        workers: Workers,
        *,
        quarantine_dir: Path,
        max_uploads: int = 2,
        on_uploaded: Callable[[str, ObjectInfo], None] = lambda key, info: None,
        observe: Callable[[str, int], None] = lambda what, n: None,
        conditional: bool = True,
    ) -> None:
        self.store = store
        self.cache = cache
        self.policy = policy
        self.workers = workers
        self.quarantine_dir = quarantine_dir
        self.on_uploaded = on_uploaded
        self.observe = observe
        self.conditional = conditional
        self.conflicts_dir = quarantine_dir.parent / "conflicts"
        self.local: dict[str, LocalFile] = {}
        self.quarantined: list[dict[str, object]] = []
        self._send, self._recv = trio.open_memory_channel[str](math.inf)
        self._max_uploads = max_uploads
        self._store_back = trio.Event()

    # -- recovery and the uploader ---------------------------------------------

    async def recover(self) -> None:
        """Re-queue every sealed file; quarantine what was never sealed."""
        objs = await self.workers.disk(lambda: list(self.cache.iter_objects()))
        for obj in objs:
            # A sealed manifest was never published: publishing it now would skip
            # the barrier and the condition its writer was promised.
            if obj.state == "sealed" and self.policy.settings(obj.key).write_mode != "publish":
                lf = self.local[obj.key] = LocalFile(obj.size, obj.mtime, time.monotonic())
                log.info("resuming upload of %r (%d bytes) sealed before a restart", obj.key, lf.size)
                self._send.send_nowait(obj.key)
            elif obj.state in ("dirty", "sealed"):
                await self.workers.disk(self._quarantine, obj.key)

    def _quarantine(self, key: str) -> None:
        """Move a never-acknowledged local file out of the cache, keep it, report it."""
        entry = self.cache.open_existing(key)
        if entry is None:
            return
        try:
            self.quarantine_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            name = f"{stamp}-{entry.path.name}"
            dest = self.quarantine_dir / name
            os.link(entry.path, dest)
            info = {"key": key, "size": entry.size, "file": name, "when": stamp,
                    "reason": "written but never closed before the daemon stopped"}
            fd = os.open(self.quarantine_dir / f"{name}.json",
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "w") as f:  # private like the cache files (the daemon's umask may be 022)
                f.write(json.dumps(info))
        finally:
            self.cache.release(entry)
        self.cache.remove(key)
        self.quarantined.append(info)
        log.warning("quarantined %r (%d bytes): it was never closed; kept at %s", key, info["size"], dest)

    async def run(self) -> None:
        """The uploader: a few concurrent uploads, each with parallel parts."""
        async with trio.open_nursery() as nursery:
            for _ in range(self._max_uploads):
                nursery.start_soon(self._worker)

    async def _worker(self) -> None:
        async for key in self._recv:
            lf = self.local.get(key)
            if lf is None or lf.sealed_at is None or lf.uploading is not None:
                continue
            try:
                await self._upload_until_landed(key, lf)
            except Exception:  # the uploader must outlive any one file
                log.exception("upload of %r failed unexpectedly; it stays pending", key)

    async def _upload_until_landed(self, key: str, lf: LocalFile) -> None:
        attempt = 0
        while self.local.get(key) is lf and lf.sealed_at is not None:
            try:
                await self._upload_once(key, lf)
                return
            except UploadCancelled:
                if self.local.get(key) is lf and lf.sealed_at is not None and not lf.writers:
                    # No writer voided it, yet it stays pending: nothing would ever
                    # upload it and flush would wait forever. Say so where it shows.
                    lf.error = "pending, but its cache file is not sealed: not uploadable"
                    log.error("upload of %r refused: %s (a bug; please report)", key, lf.error)
                return
            except (StoreError, OSError, ValueError) as exc:
                attempt += 1
                lf.error = str(exc)
                delay = min(RETRY_CAP, 0.5 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)
                log.warning("upload of %r failed (%s); retrying in %.1fs", key, exc, delay)
                self.observe("upload_retry", 1)
                with trio.move_on_after(delay):
                    await self._store_back.wait()  # or sooner, once the store answers again

    async def _upload_once(self, key: str, lf: LocalFile, *, closing: bool = False) -> ObjectInfo:
        """One upload attempt. `closing`: called by the writer's own close (write-through)."""
        if lf.writers > (1 if closing else 0):
            raise UploadCancelled(key)  # the last writer's close queues it again
        lf.uploading = trio.Event()
        lf.cancel = False
        lf.uploaded = 0
        try:
            info, landed = await self.workers.data(self._upload_blocking, key, lf)
        finally:
            ended, lf.uploading = lf.uploading, None
            ended.set()
        lf.error = None
        if landed:  # the namespace already has the new ETag (_upload_blocking)
            self.observe("uploaded", info.size)
            if self.local.get(key) is lf:
                lf.sealed_at = None
                if not lf.writers:
                    del self.local[key]
            lf.done.set()
        return info

    def _upload_blocking(self, key: str, lf: LocalFile) -> tuple[ObjectInfo, bool]:
        """Upload a sealed file, verify it, mark the cache file clean. Returns the
        store's attributes and whether the file was marked clean."""
        entry = self.cache.open_existing(key)
        if entry is None:
            raise UploadCancelled(key)
        try:
            try:
                digest = entry.content_digest()
            except ValueError:  # dirty again: a writer got there first
                raise UploadCancelled(key) from None
            size = entry.size

            def progress(n: int) -> None:
                # A writer is waiting: abort between parts. Once the last part is in,
                # let it complete: the bytes sent are still the sealed ones (the
                # writer waits for us), and the store will hold them either way.
                if lf.cancel and lf.uploaded + n < size:
                    raise UploadCancelled(key)
                lf.uploaded += n

            # A journaled dir marker (make_dir) is a directory to stores like
            # SeaweedFS, which keep no user metadata on it: its size is its proof.
            marker = key.endswith("/")
            meta = {} if marker else {DIGEST_META: digest, MTIME_META: f"{lf.mtime:.9f}"}
            self.store.put_file(key, str(entry.path), metadata=meta, progress=progress)
            info = self.store.head(key)
            if info.size != size or (not marker and info.metadata.get(DIGEST_META) != digest):
                raise StoreError(
                    f"upload of {key!r} did not verify: store has {info.size} bytes, "
                    f"digest {info.metadata.get(DIGEST_META)!r}; expected {size}, {digest!r}"
                )
            if entry.state != "sealed":
                return info, False
            # The namespace takes the new ETag before the cache record turns clean:
            # an open racing with this then pairs the new ETag with a sealed record
            # (kept). The other order let an open pair the old ETag with a clean
            # record under the new one: dropped as replaced, refetched with the
            # old ETag, 412 (seen in test_write_model once uploads got fewer threads).
            trio.from_thread.run_sync(self.on_uploaded, key, info)
            entry.set_state("clean", etag=info.etag, mtime=info.mtime)
            return info, True
        finally:
            self.cache.release(entry)

    # -- what fs.py calls ------------------------------------------------------

    def store_back(self) -> None:
        """The store answers again after an outage: retry waiting uploads now."""
        self._store_back.set()
        self._store_back = trio.Event()

    def note_dirty(self, key: str, size: int) -> LocalFile:
        """A file is being written: it now exists only here until uploaded."""
        lf = self.local.get(key)
        if lf is None:
            lf = self.local[key] = LocalFile(size, time.time())
        lf.size, lf.mtime, lf.sealed_at = size, time.time(), None
        return lf

    def writer_opened(self, key: str, size: int) -> LocalFile:
        """A handle that may write `key` opened: uploads of it wait until it closes."""
        lf = self.local.get(key)
        if lf is None:
            lf = self.local[key] = LocalFile(size, time.time())
        lf.writers += 1
        return lf

    def writer_closed(self, key: str, entry: Entry) -> None:
        lf = self.local.get(key)
        if lf is None:
            return
        lf.writers = max(0, lf.writers - 1)
        if lf.writers:
            return
        if lf.sealed_at is not None:
            self._send.send_nowait(key)
        elif entry.state == "clean":  # opened for writing, never written: nothing local
            del self.local[key]
            lf.done.set()

    async def prepare_write(self, key: str) -> None:
        """Before bytes of `key` change: stop an upload reading them and wait for it."""
        lf = self.local.get(key)
        if lf is not None and lf.uploading is not None:
            lf.cancel = True
            await lf.uploading.wait()
            if self.local.get(key) is lf and lf.sealed_at is not None:
                # Still sealed: if the writer ends up writing nothing, the sealed
                # bytes must still land (the uploader skips it while it is dirty).
                self._send.send_nowait(key)

    async def seal(self, entry: Entry, *, write_through: bool) -> None:
        """close/fsync: make the file durable locally; then upload (now or later)."""
        key = entry.key
        await self.workers.disk(entry.set_state, "sealed")
        lf = self.local.get(key) or self.note_dirty(key, entry.size)
        lf.size, lf.sealed_at = entry.size, time.monotonic()
        if write_through:
            try:
                await self._upload_once(key, lf, closing=True)
                return
            except UploadCancelled:
                return
            except (StoreError, OSError) as exc:
                # Not acknowledged to the writer; keep trying behind it all the same.
                log.warning("write-through upload of %r failed: %s; will retry", key, exc)
                self._send.send_nowait(key)
                raise OSError(getattr(exc, "errno", errno.EIO) or errno.EIO, str(exc)) from None
        self._send.send_nowait(key)

    async def _drop_local(self, key: str) -> LocalFile | None:
        """Stop tracking a local file: cancel its upload (waiting for it to stop)."""
        lf = self.local.pop(key, None)
        if lf is not None:
            lf.cancel = True
            if lf.uploading is not None:
                await lf.uploading.wait()
            lf.done.set()
        return lf

    async def _move_local(self, old: str, new: str) -> bool:
        """Rename a local file: a journal update, no store request. False if `old` is
        not local, or its cache record is clean: a file opened for writing but not
        written yet, or one whose upload landed while being stopped, is a stored
        object, and only a store-side copy puts its bytes under `new`."""
        lf = await self._drop_local(old)
        if lf is None:
            return False
        if await self.workers.disk(self._is_clean, old):
            return False
        await self._drop_local(new)
        await self.workers.disk(self.cache.rename, old, new)
        moved = self.local[new] = LocalFile(lf.size, lf.mtime, lf.sealed_at, writers=lf.writers)
        if moved.sealed_at is not None:
            self._send.send_nowait(new)
        return True

    def _is_clean(self, key: str) -> bool:
        obj = self.cache.lookup(key)
        return obj is not None and obj.state == "clean"

    # -- namespace changes that reach the store ---------------------------------

    async def delete(self, key: str) -> None:
        """unlink: drop local bytes and pending upload, delete the object."""
        await self._drop_local(key)
        await self.workers.disk(self.cache.remove, key)
        await self.workers.meta(self.store.delete, key)

    async def make_dir(self, prefix: str, *, store_down: bool) -> None:
        """mkdir: an empty directory persists as a zero-byte `prefix/` marker. While
        the store is away (`store_down`, or the PUT says so) the marker is journaled
        like a sealed write-back file and lands with the uploads: a training job
        can still make `step-N/` and write its checkpoint into it."""
        if not store_down:
            try:
                await self.workers.meta(self.store.put_bytes, prefix, b"")
                return
            except StoreError as exc:
                if exc.kind not in UNREACHABLE_KINDS:
                    raise
        entry = await self.workers.disk(self.cache.open, prefix, "", 0, time.time())
        try:
            await self.workers.disk(entry.truncate, 0)
            await self.seal(entry, write_through=False)
        finally:
            await self.workers.disk(self.cache.release, entry)

    async def remove_dir(self, prefix: str) -> None:
        """rmdir: a journaled marker goes first, so it cannot land afterwards."""
        await self._drop_local(prefix)
        await self.workers.disk(self.cache.remove, prefix)
        await self.workers.meta(self.store.delete, prefix)

    async def rename_file(self, old: str, new: str) -> list[ObjectInfo]:
        """A pending file is re-keyed locally; a stored one is copied server-side and
        deleted. Returns the store attributes of what was copied."""
        if await self._move_local(old, new):
            # An older version of `old` may be in the store; it must not survive the rename.
            await self.workers.meta(self.store.delete, old)
            return []
        await self._drop_local(new)
        return [await self._move_stored(old, new)]

    async def _move_stored(self, old: str, new: str) -> ObjectInfo:
        info = await self.workers.meta(self.store.copy, old, new)
        await self.workers.meta(self.store.delete, old)
        await self.workers.disk(self._rekey_cached, old, new, info)
        return info

    def _rekey_cached(self, old: str, new: str, info: ObjectInfo) -> None:
        """Cached bytes of a server-side copy stay valid: move them under the copy's ETag.
        What the cache held for `new` is void either way: a sealed record left there
        by a cancelled upload would otherwise be uploaded again over the copy."""
        if not self.cache.rename(old, new):
            self.cache.remove(new)
            return
        entry = self.cache.open_existing(new)
        if entry is None:
            return
        try:
            if entry.state == "clean":
                entry.set_state("clean", etag=info.etag, mtime=info.mtime)
        finally:
            self.cache.release(entry)

    async def rename_tree(self, old: str, new: str) -> list[ObjectInfo]:
        """Directory rename (`old`, `new` are 'a/b/' prefixes): every object below is
        moved one by one (S3 has no atomic rename); markers keep empty dirs."""
        keys, dirs = await self._walk(old)
        local = [k for k in self.local if k.startswith(old)]
        for key in {*keys, *dirs, *local}:  # every new key must fit before anything moves
            self.store.check_key(new + key[len(old):])
        moved = set()
        for key in local:
            if await self._move_local(key, new + key[len(old):]):
                moved.add(key)
        copied = []
        for key in keys:
            if key in moved:  # pending under the new name already; this is a stale version
                await self.workers.meta(self.store.delete, key)
                continue
            target = new + key[len(old):]
            await self._drop_local(target)
            copied.append(await self._move_stored(key, target))
        for d in [old, *dirs]:
            await self.workers.meta(self.store.put_bytes, new + d[len(old):], b"")
        for d in [*reversed(dirs), old]:
            await self.workers.meta(self.store.delete, d)
        return copied

    async def _walk(self, prefix: str) -> tuple[list[str], list[str]]:
        """Every object key and every sub-prefix below `prefix`, from the store."""
        keys: list[str] = []
        dirs: list[str] = []
        todo = [prefix]
        while todo:
            p = todo.pop()
            listing = await self.workers.meta(self.store.list_dir, p)
            keys.extend(info.key for info in listing.files)
            for name in listing.dirs:
                sub = f"{p}{name}/"
                dirs.append(sub)
                todo.append(sub)
        return keys, dirs

    def local_children(self, prefix: str) -> tuple[dict[str, LocalFile], set[str]]:
        """Local files directly under `prefix`, and sub-directories implied by deeper ones."""
        files: dict[str, LocalFile] = {}
        dirs: set[str] = set()
        for key, lf in self.local.items():
            if not key.startswith(prefix):
                continue
            head, sep, _ = key[len(prefix):].partition("/")
            if sep:
                dirs.add(head)
            elif head:
                files[head] = lf
        return files, dirs

    async def flush(self, prefix: str = "", exclude: frozenset[str] = frozenset()) -> None:
        """Barrier: return once every file pending under `prefix` right now has landed."""
        waits = [lf for key, lf in self.local.items()
                 if key.startswith(prefix) and lf.sealed_at is not None and key not in exclude]
        for lf in waits:
            await lf.done.wait()

    # -- manifests: barrier + conditional PUT (DESIGN §2) -----------------------

    async def publish(self, entry: Entry, *, if_match: str | None) -> ObjectInfo:
        """Close/fsync of a manifest: seal, wait for every upload pending in its
        directory subtree, then PUT it only if the store still holds the version
        this writer read (`if_match`), or nothing at all (`if_match` None).
        A lost race: ESTALE, the rejected bytes kept under conflicts/."""
        key = entry.key
        await self.workers.disk(entry.set_state, "sealed")
        lf = self.local.get(key) or self.note_dirty(key, entry.size)
        lf.size, lf.sealed_at = entry.size, time.monotonic()
        await self.flush(_parent_prefix(key), exclude=frozenset({key}))
        try:
            info = await self.workers.data(self._put_manifest, entry, entry.path, key, if_match)
        except StoreError as exc:
            await self.workers.disk(self._keep_conflict, entry, str(exc))
            if self.local.get(key) is lf:
                del self.local[key]
            lf.done.set()
            if exc.kind == "precondition":
                log.warning("manifest %r lost a concurrent update: kept under %s, not published",
                            key, self.conflicts_dir)
                raise OSError(errno.ESTALE, f"{key}: changed in the store since it was opened") from None
            raise OSError(exc.errno or errno.EIO, str(exc)) from None
        if self.local.get(key) is lf:
            lf.sealed_at = None
            if not lf.writers:
                del self.local[key]
        lf.done.set()
        self.on_uploaded(key, info)
        return info

    async def publish_rename(self, src: Entry, dst: str, *, if_match: str | None) -> ObjectInfo:
        """rename(tmp, manifest): the same barrier and condition, then the source goes.
        `src` must be whole in tier 1. A lost race: ESTALE, the source stays."""
        await self.flush(_parent_prefix(dst), exclude=frozenset({src.key}))
        try:
            info = await self.workers.data(self._put_manifest, None, src.path, dst, if_match)
        except StoreError as exc:
            if exc.kind == "precondition":
                log.warning("rename onto manifest %r lost a concurrent update; %r kept", dst, src.key)
                raise OSError(errno.ESTALE, f"{dst}: changed in the store") from None
            raise
        await self._drop_local(dst)
        await self.workers.disk(self.cache.remove, dst)
        return info

    def _put_manifest(self, entry: Entry | None, path: Path, key: str, if_match: str | None) -> ObjectInfo:
        cond: dict[str, object] = {}
        if self.conditional:
            cond = {"if_match": if_match} if if_match else {"if_none_match": True}
        self.store.put_file(key, str(path), **cond)  # type: ignore[arg-type]
        info = self.store.head(key)
        if entry is not None and entry.state == "sealed":
            entry.set_state("clean", etag=info.etag, mtime=info.mtime)
        return info

    def _keep_conflict(self, entry: Entry, reason: str) -> None:
        """Keep bytes the store refused, named by hash, with a note; drop them from the cache."""
        self.conflicts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{entry.path.name}"
        os.link(entry.path, self.conflicts_dir / name)
        note = {"key": entry.key, "size": entry.size, "file": name, "reason": reason}
        (self.conflicts_dir / f"{name}.json").write_text(json.dumps(note))
        self.cache.remove(entry.key)

    def summary(self, prefix: str = "") -> dict[str, object]:
        now = time.monotonic()
        pending = [lf for k, lf in self.local.items() if k.startswith(prefix) and lf.sealed_at is not None]
        return {
            "count": len(pending),
            "bytes": sum(lf.size for lf in pending),
            "uploaded_bytes": sum(lf.uploaded for lf in pending),
            "oldest_age_s": max((now - lf.sealed_at for lf in pending if lf.sealed_at), default=0.0),
            "open_for_write": sum(1 for lf in self.local.values() if lf.sealed_at is None),
            "last_errors": [lf.error for lf in pending if lf.error][:5],
            "oldest": sorted(
                ((k, lf.size, lf.uploading is not None) for k, lf in self.local.items()
                 if k.startswith(prefix) and lf.sealed_at is not None),
                key=lambda t: self.local[t[0]].sealed_at or 0.0,
            )[:5],
            "quarantined": list(self.quarantined),
        }

    def close(self) -> None:
        with contextlib.suppress(trio.ClosedResourceError):
            self._send.close()


def _parent_prefix(key: str) -> str:
    """The directory subtree a manifest speaks for: 'a/b/.metadata' -> 'a/b/'."""
    head, sep, _ = key.rpartition("/")
    return head + sep
