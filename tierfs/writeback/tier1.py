"""The write path's side of tier 1: opening a file's cache entry, local writes
that survive a full disk once, and the read path's fetch and the namespace's
refresh for the bytes a write needs first (DESIGN §5)."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from typing import Any

from tierfs.cache import Cache, Entry
from tierfs.store.base import ObjectInfo
from tierfs.workers import Workers


class Tier1:
    def __init__(
        self, cache: Cache, workers: Workers, *,
        fetch: Callable[[Entry, int, int], Awaitable[object]],
        refresh: Callable[[str], Awaitable[ObjectInfo]],
    ) -> None:
        self.cache = cache
        self.workers = workers
        self.fetch = fetch  # make bytes of an entry present in tier 1 (read path)
        self.refresh = refresh  # the store's current version of a key (namespace)

    async def open(self, key: str, etag: str, size: int, mtime: float) -> Entry:
        return await self.workers.disk(self.cache.open, key, etag, size, mtime)

    async def open_seen(self, key: str, etag: str, size: int, mtime: float) -> tuple[Entry, str]:
        """The entry of the version the namespace showed (Cache.open_seen: ETag "" is
        this mount's file, whatever became of it), and that version's store ETag
        ("" while only local). The store's current version if tier 1 no longer
        holds this mount's file (landed and evicted since the look)."""
        entry = await self.workers.disk(self.cache.open_seen, key, etag, size, mtime)
        if entry is None:
            info = await self.refresh(key)
            return await self.open(key, info.etag, info.size, info.mtime), info.etag
        return entry, etag or (entry.etag if entry.state == "clean" else "")

    async def release(self, entry: Entry) -> None:
        await self.workers.disk(self.cache.release, entry)

    async def disk(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.workers.disk(fn, *args)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A tier-1 write; on a full disk, evict clean data once and retry, else ENOSPC."""
        try:
            return await self.workers.disk(fn, *args)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            await self.workers.disk(self.cache.reclaim)
            return await self.workers.disk(fn, *args)

    async def flush_bytes(self, entry: Entry) -> None:
        """fsync the file's bytes ahead of a durable seal, holding no lock: the seal's
        own fsync (under the file's lock) then finds little left to write."""
        try:
            fd = entry.serve.backing_fd()
        except (OSError, ValueError):  # closed or removed meanwhile: its seal says so
            return
        await self.workers.disk(os.fsync, fd)

    def reetag(self, key: str, info: ObjectInfo) -> None:
        """The object's bytes did not change, only its ETag (new metadata): its cached
        bytes stay valid under the new one. Blocking."""
        entry = self.cache.open_existing(key)
        if entry is None:
            return
        try:
            if entry.state == "clean":
                entry.local.clean(etag=info.etag, mtime=info.mtime)
        finally:
            self.cache.release(entry)

    def rekey(self, old: str, new: str, info: ObjectInfo) -> None:
        """Cached bytes of a server-side copy stay valid: move them under the copy's
        ETag. What the cache held for `new` is void either way: a sealed record left
        there by a cancelled upload would otherwise be uploaded again over the
        copy. Blocking."""
        if not self.cache.rename(old, new):
            self.cache.remove(new)
            return
        self.reetag(new, info)
