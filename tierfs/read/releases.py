"""Entries of closed read handles, released in batches (Cache.release_many).

A walk through 10,000 small files closes one a file: a worker hop and an index
commit each were a fifth of the daemon's CPU (issue 21). So a batch waits
RELEASE_GATHER_S for the closes that follow its first, and all of them go in
one hop and one transaction. A batch gathered for 5 ms held about ten closes,
and its hops were still a tenth of a warm walk's time (1.70 s vs 1.50 s for
3,000 files gathered for 50 ms: worker wake-ups and GIL hand-offs with the
loop). An entry released up to 50 ms late only stays unevictable that long.
"""

from __future__ import annotations

import logging

import trio

from tierfs.cache import Cache, Entry
from tierfs.workers import Workers

log = logging.getLogger(__name__)

RELEASE_GATHER_S = 0.05
RELEASE_BATCH_MAX = 256


class Releases:
    def __init__(self, cache: Cache, workers: Workers) -> None:
        self.cache = cache
        self.workers = workers
        self._releasing: list[Entry] = []
        self._due = trio.Event()

    def later(self, entry: Entry) -> None:
        """Release `entry` with the next batch (trio loop)."""
        self._releasing.append(entry)
        self._due.set()

    async def run(self) -> None:
        """For the mount's life: a batch whenever releases wait. A batch taken is
        released even if the mount stops meanwhile (cancelled before its hop
        started, its references were lost)."""
        while True:
            await self._due.wait()
            if len(self._releasing) < RELEASE_BATCH_MAX:
                await trio.sleep(RELEASE_GATHER_S)
            self._due = trio.Event()
            with trio.CancelScope(shield=True):  # a batch taken is released whole
                await self.flush()

    async def flush(self) -> None:
        """Release every entry waiting, now."""
        batch, self._releasing = self._releasing, []
        if not batch:
            return
        try:
            await self.workers.disk(self.cache.release_many, batch)
        except (OSError, ValueError) as exc:  # the index: its uses are lost, nothing else
            log.warning("releasing %d closed file(s): %s", len(batch), exc)
