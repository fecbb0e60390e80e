"""What tier 1 remembers in memory of closed objects, for their next open.

The chunk map of a closed object (verified marks included: their next open
need not check those chunks again), and the pages of absent chunks fetched
for small random reads. Sound because a closed object's chunks only change by
dropping it whole, which forgets its stash (`forget`). Bounded: STATES_BYTES
of maps (1 byte per chunk), PAGES_OBJECTS objects' pages; oldest go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

STATES_BYTES = 16 << 20
PAGES_OBJECTS = 4096


class Stash:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._states: OrderedDict[bytes, bytearray] = OrderedDict()
        self._bytes = 0
        self._pages: OrderedDict[bytes, dict[int, int]] = OrderedDict()

    def keep_states(self, fid: bytes, states: bytearray) -> None:
        with self._mu:
            old = self._states.pop(fid, None)
            self._bytes += len(states) - (len(old) if old is not None else 0)
            self._states[fid] = states
            while self._bytes > STATES_BYTES:
                self._bytes -= len(self._states.popitem(last=False)[1])

    def take_states(self, fid: bytes, n: int) -> bytearray | None:
        """The map kept for `fid`, if it has `n` chunks."""
        with self._mu:
            states = self._states.pop(fid, None)
            if states is not None:
                self._bytes -= len(states)
        return states if states is not None and len(states) == n else None

    def keep_pages(self, fid: bytes, pages: dict[int, int]) -> None:
        with self._mu:
            self._pages[fid] = pages
            while len(self._pages) > PAGES_OBJECTS:
                self._pages.popitem(last=False)

    def take_pages(self, fid: bytes) -> dict[int, int]:
        with self._mu:
            return self._pages.pop(fid, None) or {}

    def forget(self, fid: bytes) -> None:
        """The object's file is gone (or lost)."""
        with self._mu:
            states = self._states.pop(fid, None)
            if states is not None:
                self._bytes -= len(states)
            self._pages.pop(fid, None)

    def clear(self) -> None:
        with self._mu:
            self._states.clear()
            self._bytes = 0
            self._pages.clear()
