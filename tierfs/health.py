"""Whether the store answers: the one owner of degraded mode (DESIGN §4, §7).

Any part that finds the store away says so (`observe`, from the store's
request observer in a worker thread, or `mark_down`); everyone else reads
`degraded`, or waits for the store to come back (`wait_back`). While degraded,
`watch` probes the store in the background and leaves degraded mode as soon
as it answers; `epoch` counts those returns, so what was learnt while the
store was away (listings from the tier-1 index) is known to be stale.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable

import trio

from tierfs.store.base import UNREACHABLE_KINDS

log = logging.getLogger(__name__)


class StoreHealth:
    def __init__(self, *, probe_every: float) -> None:
        self._lock = threading.Lock()  # leaf: flag and log only
        self._degraded = False
        self._probe_every = probe_every
        self._back = trio.Event()
        self.epoch = 0

    @property
    def degraded(self) -> bool:
        return self._degraded

    def observe(self, op: str, outcome: str) -> None:
        """A store request ended (any thread): an unreachable store means degraded."""
        if outcome in UNREACHABLE_KINDS:
            self.mark_down(f"{op} failed: {outcome}")

    def mark_down(self, reason: str) -> None:
        """The store did not answer within a whole deadline (any thread)."""
        with self._lock:
            if self._degraded:
                return
            self._degraded = True
        log.warning("store unreachable (%s): degraded mode, serving from the cache", reason)

    async def wait_back(self) -> None:
        """Return once the store is next found answering again."""
        await self._back.wait()

    async def watch(self, probe: Callable[[], Awaitable[object]]) -> None:
        """While degraded, `probe` the store every few seconds; leave degraded
        mode (and wake `wait_back`) once it answers."""
        while True:
            await trio.sleep(self._probe_every)
            if not self._degraded:
                continue
            try:
                await probe()
            except Exception as exc:  # StoreError, or anything else a probe hits
                log.debug("store still unreachable: %s", exc)
                continue
            log.info("store reachable again: leaving degraded mode")
            with self._lock:
                self._degraded = False
            self.epoch += 1
            back, self._back = self._back, trio.Event()
            back.set()
