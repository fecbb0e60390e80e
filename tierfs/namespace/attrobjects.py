"""Directories' attribute objects (dirattrs.py) against the store: read for
listings, written for what this mount changes.

Reading: a listing that shows a directory's attribute object takes its table
from memory, from the tier-1 index (kept with the object's ETag across
remounts), or with one GET pinned to the listed ETag. Anything wrong with it
(gone meanwhile, unreadable) leaves the listing as it would be without it.

Writing: what this mount changes (uploads landed, symlinks, FIFOs and devices
made, chmod/chown/utimens of stored objects, mkdir, unlink, rmdir, rename) is
queued per directory and written by one task, coalesced: one PUT per
directory at most every DIR_ATTRS_DELAY seconds (longer for big tables), so
`cp -a` of 10,000 files rewrites its directory's object a few dozen times,
not 10,000. Each PUT is conditional (If-Match the version it was made from,
If-None-Match: * for a new one); a 412 means another node wrote it
meanwhile: read it again, make this mount's changes on it, put again. A crash
between an upload and its entry costs HEADs, never a wrong attribute: the
object's own metadata stays the truth, and an entry missing from a table
written before the object was is asked for by HEAD (listings.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping

import trio

from tierfs.cache import Cache
from tierfs.config import DIR_ATTRS_CACHED, DIR_ATTRS_DELAY, DIR_ATTRS_PER_SECOND, UPLOAD_RETRY_CAP
from tierfs.namespace.dirattrs import BadTable, Entry, Table, key_of
from tierfs.store.base import UNREACHABLE_KINDS, ObjectInfo, Store, StoreError
from tierfs.workers import Workers

log = logging.getLogger(__name__)

_CONFLICTS = 5  # 412s in a row before a write is put off (another node keeps writing)


class AttrObjects:
    def __init__(self, store: Store, cache: Cache, workers: Workers) -> None:
        self.store = store
        self.cache = cache
        self.workers = workers
        # prefix -> (ETag of its attribute object, None: there is none; its table)
        self._tables: OrderedDict[str, tuple[str | None, Table]] = OrderedDict()
        self._held = 0  # entries in _tables
        self._pending: dict[str, dict[str, Entry | None]] = {}  # prefix -> name -> entry
        self._due: dict[str, float] = {}  # prefix -> monotonic time its write is due
        self._backoff: dict[str, float] = {}
        self._writing: dict[str, trio.Event] = {}  # prefix -> the end of its write in flight
        self._moved: dict[str, Table] = {}  # new prefix -> table, until its copy is seen
        self._moving: set[str] = set()  # directories being renamed (their old prefixes)
        self._wake = trio.Event()
        self._warned: set[str] = set()

    # -- reading -------------------------------------------------------------------------

    def listed(self, prefix: str, info: ObjectInfo | None) -> None:
        """A whole listing of `prefix` showed its attribute object `info` (None: none)."""
        if info is None and prefix not in self._tables and prefix not in self._writing:
            self._hold(prefix, None, Table())

    async def table(self, prefix: str, info: ObjectInfo) -> Table | None:
        """The table of the attribute object `info` of `prefix` (None: unreadable)."""
        held = self._tables.get(prefix)
        if held is not None and held[0] == info.etag:
            self._tables.move_to_end(prefix)
            return held[1]
        key = key_of(prefix)
        raw: bytes | None = None
        kept = (await self.workers.disk(self.cache.attrs_of, [key])).get(key)
        if kept is not None:
            etag, _, body = kept.partition(b"\0")
            if etag.decode("utf-8", "surrogateescape") == info.etag:
                raw = body
        fetched = raw is None
        if raw is None:
            try:
                raw = await self.workers.meta(self.store.get_range, key, 0, info.size + 1,
                                              info.etag)
            except StoreError as exc:  # gone or rewritten since the listing: later ones show it
                self._warn(prefix, f"cannot read {key!r}: {exc}")
                return None
        try:
            table = Table.decode(raw)
        except BadTable as exc:
            self._warn(prefix, f"ignoring {key!r}: {exc}")
            return None
        self._hold(prefix, info.etag, table)
        if fetched:
            await self._keep(prefix, info.etag, raw)
        return table

    # -- writing -------------------------------------------------------------------------

    def change(self, prefix: str, name: str, entry: Entry | None) -> None:
        """`name`'s entry in directory `prefix` is now `entry` (None: it has none).
        Below a directory being renamed, nothing: its objects are being copied to
        the new name (their copies bring their entries), and an object written
        under the old name now would outlive the rename (a phantom directory)."""
        if any(prefix.startswith(old) for old in self._moving):
            return
        if entry is None and name not in self._pending.get(prefix, ()):
            held = self._tables.get(prefix)
            if held is not None and name not in held[1].entries and prefix not in self._writing:
                return  # it has none: nothing to write
        self._pending.setdefault(prefix, {})[name] = entry
        if prefix not in self._due:
            held = self._tables.get(prefix)
            size = len(held[1].entries) if held is not None else 0
            self._due[prefix] = time.monotonic() + DIR_ATTRS_DELAY + size / DIR_ATTRS_PER_SECOND
            self._wake.set()

    def created(self, prefix: str) -> None:
        """The directory `prefix` was made here: it has no attribute object yet."""
        self._hold(prefix, None, Table())

    def copied(self, prefix: str, info: ObjectInfo) -> None:
        """A directory rename copied the attribute object of `prefix` (its new name)."""
        table = self._moved.pop(prefix, None)
        if table is not None:
            self._hold(prefix, info.etag, table)

    async def moving(self, old: str, new: str) -> None:
        """Directory `old` is about to be renamed to `new`, objects copied one by one:
        what is pending below it is written first (so the copies carry it), and
        nothing more is written below it until `moved`."""
        self._moving.add(old)
        await self.settle(old)
        for prefix in [p for p in self._tables if p.startswith(old)]:
            etag, table = self._drop(prefix)
            if etag is not None:
                self._moved[new + prefix[len(old):]] = table

    def moved(self, old: str) -> None:
        """The rename of directory `old` is over (done or failed)."""
        self._moving.discard(old)

    async def removed(self, prefix: str) -> None:
        """rmdir of `prefix`: its attribute object goes with it, now (a leftover
        would keep the directory in listings)."""
        self._pending.pop(prefix, None)
        self._due.pop(prefix, None)
        writing = self._writing.get(prefix)
        if writing is not None:
            await writing.wait()
        held = self._tables.get(prefix)
        if held is None or held[0] is not None:
            await self.workers.meta(self.store.delete, key_of(prefix))
            await self._keep(prefix, None, None)
        self._drop(prefix)

    async def settle(self, prefix: str = "") -> None:
        """Write now what is pending at or below `prefix` (flush, umount, rename).
        One try each: a store that is away leaves it pending, for `run`."""
        async with trio.open_nursery() as nursery:
            for p in {*self._pending, *self._writing}:
                if p.startswith(prefix):
                    nursery.start_soon(self._write, p)

    async def run(self) -> None:
        """Write the directories whose changes are due, for the mount's life."""
        async with trio.open_nursery() as nursery:
            while True:
                now = time.monotonic()
                due = [p for p, t in self._due.items() if t <= now and p not in self._writing]
                for p in due:
                    nursery.start_soon(self._write, p)
                wait = min((t for p, t in self._due.items() if p not in self._writing),
                           default=math.inf) - now
                with trio.move_on_after(max(wait, 0.01)):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _write(self, prefix: str) -> None:
        writing = self._writing.get(prefix)
        if writing is not None:  # one write per directory at a time: then ours, if still due
            await writing.wait()
        changes = self._pending.pop(prefix, None)
        self._due.pop(prefix, None)
        if not changes:
            return
        done = self._writing[prefix] = trio.Event()
        try:
            await self._put(prefix, changes)
            self._backoff.pop(prefix, None)
        except StoreError as exc:
            if exc.kind in UNREACHABLE_KINDS or exc.kind == "precondition":
                # kept, under any newer change of the same names, and tried again later
                self._pending[prefix] = {**changes, **self._pending.get(prefix, {})}
                delay = min(self._backoff.get(prefix, 0.5) * 2, UPLOAD_RETRY_CAP)
                self._backoff[prefix] = delay
                self._due[prefix] = time.monotonic() + delay
                self._wake.set()
            self._warn(prefix, f"cannot write {key_of(prefix)!r}: {exc}")
        finally:
            del self._writing[prefix]
            done.set()

    async def _put(self, prefix: str, changes: Mapping[str, Entry | None]) -> None:
        key = key_of(prefix)
        for _ in range(_CONFLICTS):
            etag, base = await self._current(prefix)
            table = base.changed(changes)
            if table == base:
                return
            try:
                if not table.entries:
                    await self.workers.meta(self.store.delete, key)
                    self._hold(prefix, None, table)
                    await self._keep(prefix, None, None)
                    return
                raw = table.encode()
                info = await self.workers.meta(self._conditional_put, key, raw, etag)
            except StoreError as exc:
                if exc.kind != "precondition":
                    raise
                self._drop(prefix)  # another node wrote it: read it again
                continue
            self._hold(prefix, info.etag, table)
            await self._keep(prefix, info.etag, raw)
            return
        raise StoreError(f"{key}: written by others {_CONFLICTS} times in a row",
                         kind="precondition")

    def _conditional_put(self, key: str, raw: bytes, etag: str | None) -> ObjectInfo:
        if not self.store.supports_conditional_put:  # last writer wins; a lost entry costs a HEAD
            return self.store.put_bytes(key, raw)
        return self.store.put_bytes(key, raw, if_match=etag, if_none_match=etag is None)

    async def _current(self, prefix: str) -> tuple[str | None, Table]:
        """The store's attribute object of `prefix` (its ETag, None: none), as last
        seen here or read now."""
        held = self._tables.get(prefix)
        if held is not None:
            return held
        key = key_of(prefix)
        for _ in range(_CONFLICTS):
            try:
                info = await self.workers.meta(self.store.head, key)
                raw = await self.workers.meta(self.store.get_range, key, 0, info.size + 1,
                                              info.etag)
            except StoreError as exc:
                if exc.kind == "not_found":
                    return None, Table()
                if exc.kind == "changed":
                    continue
                raise
            try:
                table = Table.decode(raw)
            except BadTable as exc:  # what is there is not ours to keep: it is replaced
                self._warn(prefix, f"replacing {key!r}: {exc}")
                table = Table()
            self._hold(prefix, info.etag, table)
            return info.etag, table
        raise StoreError(f"{key}: changing faster than it can be read", kind="precondition")

    def _hold(self, prefix: str, etag: str | None, table: Table) -> None:
        self._drop(prefix)
        self._tables[prefix] = (etag, table)
        self._held += len(table.entries)
        while self._held > DIR_ATTRS_CACHED and len(self._tables) > 1:
            self._drop(next(iter(self._tables)))

    def _drop(self, prefix: str) -> tuple[str | None, Table]:
        held = self._tables.pop(prefix, (None, Table()))
        self._held -= len(held[1].entries)
        return held

    async def _keep(self, prefix: str, etag: str | None, raw: bytes | None) -> None:
        """Keep the object's body in the index for a later mount (None: forget it)."""
        record = None if raw is None or etag is None else etag.encode("utf-8", "surrogateescape") + b"\0" + raw
        try:
            await self.workers.disk(self.cache.set_attrs, {key_of(prefix): record})
        except OSError as exc:
            self._warn(prefix, f"cannot keep {key_of(prefix)!r} in the index: {exc}")

    def _warn(self, prefix: str, what: str) -> None:
        if prefix not in self._warned:
            self._warned.add(prefix)
            log.warning("%s (its entries show as listings tell, or as HEADs do)", what)
        else:
            log.debug("%s", what)
