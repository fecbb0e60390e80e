"""Directory listings kept across remounts: the namespace's side (DESIGN §4, §6).

The namespace keeps each complete listing it gets from the store in the tier-1
index (cache/listings.py holds the record) and, the first time a directory is
needed after a mount, takes the kept one if it was taken less than the
directory's listing TTL ago: `ls -l` of a 10,000-object dataset directory after
a remount sends no LIST. Only classes with `keep_listings` (dataset, by
default) are kept: a remount lists other directories again, as users of
mutable paths expect (an object replaced by another tool between two mounts
shows at once). A directory's listing follows its own class, or the class of
nearly all of its files (`listing_settings`): a directory of images is a
dataset directory even where its own path falls in the default class.

What this mount changes in a directory (a file created, removed, renamed or
uploaded) drops that directory's kept listing, in the background but before
anything reads it again (a pending drop hides the record), and a listing that
was being fetched while its directory changed is not kept: a kept listing
never hides or resurrects what this mount did.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable

import trio

from tierfs.cache import Cache
from tierfs.config import ClassSettings
from tierfs.store.base import Listing
from tierfs.workers import Workers

log = logging.getLogger(__name__)


# The share of a directory's files that must be of one class that keeps listings
# for the directory's listing to follow that class (a README or a labels file
# beside 2,000 images leaves it a dataset directory).
LISTING_SHARE = 0.9


def kept_ttl(settings: ClassSettings) -> float:
    """How long a kept listing of a directory of this class stays usable (0: not kept)."""
    return settings.list_ttl if settings.keep_listings else 0.0


def listing_settings(own: ClassSettings, files: Iterable[ClassSettings]) -> ClassSettings:
    """The class whose listing contract (list_ttl, keep_listings) a directory follows:
    its own, unless its own keeps no listings and at least LISTING_SHARE of its files
    are of one class that does: then that class (`ls -l` of a directory of 2,000
    images after a remount: no LIST within the dataset TTL)."""
    if own.keep_listings:
        return own
    counts: Counter[str] = Counter()
    by_name: dict[str, ClassSettings] = {}
    total = 0
    for s in files:
        total += 1
        if s.keep_listings:
            counts[s.name] += 1
            by_name[s.name] = s
    if not counts:
        return own
    name, n = counts.most_common(1)[0]
    return by_name[name] if n >= LISTING_SHARE * total else own


class KeptListings:
    def __init__(self, cache: Cache, workers: Workers) -> None:
        self.cache = cache
        self.workers = workers
        self._changes: dict[str, int] = {}  # prefix -> changes made here (this mount's life)
        self._drop: set[str] = set()  # prefixes whose record is to be dropped
        self._dropping: set[str] = set()  # ... being dropped right now
        self._wake = trio.Event()
        self._warned = False

    def generation(self, prefix: str) -> int:
        """How often this mount changed `prefix`; `keep` refuses a listing fetched
        across a change."""
        return self._changes.get(prefix, 0)

    def changed(self, prefix: str) -> None:
        """This mount changed the entries of the directory `prefix` (from the trio loop)."""
        self._changes[prefix] = self._changes.get(prefix, 0) + 1
        self._drop.add(prefix)
        self._wake.set()

    async def load(self, prefix: str) -> tuple[Listing, float] | None:
        """The listing kept for `prefix` and its age in seconds (the caller holds it
        against the TTL of the class the listing shows: `listing_settings`); None
        if there is none, or one taken by a clock ahead of ours."""
        if prefix in self._drop or prefix in self._dropping:
            return None
        try:
            kept = await self.workers.disk(self.cache.listings.kept, prefix)
        except OSError as exc:
            self._warn(f"cannot read a kept listing: {exc}")
            return None
        if kept is None or prefix in self._drop or prefix in self._dropping:
            return None
        listing, taken = kept
        age = time.time() - taken
        return None if age < 0 else (listing, age)

    async def keep(self, prefix: str, listing: Listing, taken: float, ttl: float,
                   generation: int) -> None:
        """Keep a complete store listing of `prefix` taken at `taken` (wall clock),
        unless this mount changed the directory since (`generation`) or it would never
        be used (a TTL of 0). A failure (index full) is logged once, never raised."""
        if ttl <= 0 or self.generation(prefix) != generation:
            return
        try:
            await self.workers.disk(self.cache.listings.keep, prefix, listing, taken)
        except OSError as exc:
            self._warn(f"cannot keep a listing of {prefix!r}: {exc}")

    async def run(self) -> None:
        """Drop the kept listings of changed directories, batched, for the mount's life."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            batch, self._drop = self._drop, set()
            self._dropping |= batch
            try:
                await self.workers.disk(self.cache.listings.drop, sorted(batch))
            except OSError as exc:
                self._warn(f"cannot drop kept listings: {exc}")
                self._drop |= batch  # hidden meanwhile; tried again in a second
                self._wake.set()
                await trio.sleep(1.0)
            finally:
                self._dropping -= batch

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s (listings are fetched from the store instead)", what)
        else:
            log.debug("%s", what)
