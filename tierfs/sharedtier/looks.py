"""One look at an object's blocks for all of a node's fills waiting on them.

Why: a herd's waiters each looked for their block (a HEAD) every 50-250 ms and
at the claim they waited on (another) every second: ~500 HEADs per node for a
512 MiB model in a herd of 4 on the bench machine, where the herd used both
cores throughout and the shared store's gateway took as much CPU as the four
daemons together. One LIST of the object's block prefix answers for every block
and claim of it at once; a node's fills share it while it is fresh (`fresh`
seconds, counted from when it was asked), and one LIST at a time per prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tierfs.store.base import ObjectInfo, Store


class Looks:
    def __init__(self, store: Store, meta: Callable[..., Awaitable[Any]], *, fresh: float,
                 now: Callable[[], float]) -> None:
        self._store = store
        self._meta = meta
        self._fresh = fresh
        self._now = now
        self._seen: dict[str, tuple[float, dict[str, ObjectInfo]]] = {}  # folder: (asked, by key)
        self._asking: dict[str, trio.Event] = {}

    async def find(self, key: str) -> ObjectInfo | None:
        """Object `key` as a fresh enough listing of its folder shows it (ETag,
        size, Last-Modified; no user metadata), or None. Raises StoreError."""
        return (await self._listing(_folder(key))).get(key)

    def forget(self, key: str) -> None:
        """What the last listing of `key`'s folder showed is known out of date (a
        claim in it was replaced): the next look lists again."""
        self._seen.pop(_folder(key), None)

    async def _listing(self, folder: str) -> dict[str, ObjectInfo]:
        while True:
            seen = self._seen.get(folder)
            if seen is not None and self._now() - seen[0] < self._fresh:
                return seen[1]
            asking = self._asking.get(folder)
            if asking is None:
                break
            await asking.wait()  # then the answer is fresh, or that LIST failed: ask again
        done = self._asking[folder] = trio.Event()
        asked = self._now()
        try:
            listing = await self._meta(self._store.list_dir, folder)
        finally:
            del self._asking[folder]
            done.set()
        entries = {o.key: o for o in listing.files}
        self._seen = {f: s for f, s in self._seen.items() if asked - s[0] < self._fresh}
        self._seen[folder] = (asked, entries)
        return entries


def _folder(key: str) -> str:
    """The folder a block or claim object is listed in (its prefix, with the slash)."""
    return key.rsplit("/", 1)[0] + "/"
