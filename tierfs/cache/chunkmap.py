"""What tier 1 holds of one object, chunk by chunk: pure bookkeeping, no locks, no I/O.

Each chunk of an object's tier-1 file is in one state (index.py):
ABSENT (a hole), STORED (fetched, checksum recorded, not yet checked by this
process), VERIFIED (checked, or written by this process's fetch) or WRITTEN
(local bytes of a file being written here). The names below mean one thing
each:

- present: not ABSENT (`present`, `missing` is its complement as byte ranges);
- complete: every chunk present;
- verified: every chunk VERIFIED (the kernel may serve the file itself);
- servable now: readable with a plain pread and nothing to verify (VERIFIED,
  WRITTEN, or held as pages).

Pins keep chunks from being punched out (eviction, dropping corrupt data)
while a read or a store uses them; `kernel` pins the whole file (passthrough:
the kernel reads it directly). Pages: absent chunks of which some 4 KiB pages
were fetched for small random reads (memory only, never checksummed).
The Entry holding a map guards it with its `_mu` lock.
"""

from __future__ import annotations

import re

from tierfs.cache.index import ABSENT, STORED, VERIFIED, WRITTEN

PAGE = 4096  # granularity of pages held for small random reads

_ABSENT_RUN = re.compile(bytes((ABSENT,)) + b"+")
CHECKSUMMED = (STORED, VERIFIED)


def nchunks(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


class ChunkCorrupt(Exception):
    """Cached chunks whose bytes no longer match their checksum (torn write, bit rot).
    They are already dropped: fetch them again."""

    def __init__(self, key: str, chunks: list[int]) -> None:
        super().__init__(f"{key}: checksum mismatch in cached chunk(s) {chunks}; dropped")
        self.key = key
        self.chunks = chunks


class ChunkMap:
    def __init__(self, chunk_size: int, size: int, states: bytearray,
                 pages: dict[int, int] | None = None) -> None:
        self.chunk_size = chunk_size
        self.size = size
        self.states = states
        self.pins: dict[int, int] = {}
        self.kernel = 0  # whole-file pins: the kernel reads the file (passthrough)
        self.discarding: set[int] = set()  # being punched out: no store into them
        self.last = (-1, -1)  # chunk range of the most recent store (never shed)
        # Absent chunk -> bitmask of its PAGE-sized pages held for small reads.
        self.pages: dict[int, int] = pages if pages is not None else {}

    def __len__(self) -> int:
        return len(self.states)

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.size - i * self.chunk_size)

    def chunks_of(self, start: int, end: int) -> tuple[int, int]:
        """First and last chunk (inclusive) of [start, end) clipped to the size; a
        range that is empty or past the end gives the chunk at `start`."""
        cs = self.chunk_size
        return max(start, 0) // cs, (max(min(end, self.size), start + 1) - 1) // cs

    # -- questions ------------------------------------------------------------

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """Chunk-aligned byte ranges [a, b) absent within [start, end), end clipped
        to the size, adjacent chunks coalesced: what a reader must fetch."""
        cs, size = self.chunk_size, self.size
        start, end = max(start, 0), min(end, size)
        if start >= end:
            return []
        runs = [m.span() for m in _ABSENT_RUN.finditer(self.states, start // cs, (end - 1) // cs + 1)]
        return [(a * cs, min(b * cs, size)) for a, b in runs]

    def present(self, start: int, end: int) -> bool:
        cs = self.chunk_size
        start, end = max(start, 0), min(end, self.size)
        return start >= end or self.states.find(ABSENT, start // cs, (end - 1) // cs + 1) < 0

    def complete(self) -> bool:
        """Every chunk present."""
        return ABSENT not in self.states

    def verified(self) -> bool:
        """Every chunk verified."""
        return self.states.count(VERIFIED) == len(self.states)

    def unverified(self) -> bool:
        """Some chunk has a checksum this process has not checked yet."""
        return STORED in self.states

    def missing_pages(self, start: int, end: int) -> list[tuple[int, int]]:
        """PAGE-aligned byte ranges [a, b) within [start, end) (end clipped to the size)
        held neither by a present chunk nor as pages: what a small random read
        must fetch."""
        per = self.chunk_size // PAGE
        out: list[tuple[int, int]] = []
        size = self.size
        start, end = max(start, 0), min(end, size)
        run: int | None = None
        for p in range(start // PAGE, -(-end // PAGE) if start < end else 0):
            c = p // per
            have = self.states[c] != ABSENT or (self.pages.get(c, 0) >> (p % per)) & 1
            if not have and run is None:
                run = p
            elif have and run is not None:
                out.append((run * PAGE, p * PAGE))
                run = None
        if run is not None:
            out.append((run * PAGE, min(-(-end // PAGE) * PAGE, size)))
        return out

    def servable_now(self, start: int, end: int) -> bool:
        """Whether [start, end) can be served by a plain pread with nothing to verify:
        every chunk verified or written here, or held as pages."""
        cs = self.chunk_size
        start, end = max(start, 0), min(end, self.size)
        for c in range(start // cs, (end - 1) // cs + 1 if start < end else 0):
            s = self.states[c]
            if s in (VERIFIED, WRITTEN):
                continue
            if s != ABSENT or not self.pages_held(c, max(start, c * cs), min(end, (c + 1) * cs)):
                return False
        return True

    def pages_held(self, c: int, start: int, end: int) -> bool:
        """Whether every page of [start, end) (within absent chunk `c`) is held."""
        per = self.chunk_size // PAGE
        mask = self.pages.get(c, 0)
        return all((mask >> (p % per)) & 1 for p in range(start // PAGE, -(-end // PAGE)))

    def pinned(self, i: int) -> bool:
        return i in self.pins or self.kernel > 0

    # -- changes ------------------------------------------------------------------

    def pin(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            self.pins[i] = self.pins.get(i, 0) + 1

    def unpin(self, lo: int, hi: int) -> None:
        for i in range(lo, hi + 1):
            left = self.pins[i] - 1
            if left:
                self.pins[i] = left
            else:
                del self.pins[i]

    def stored(self, lo: int, hi: int) -> None:
        """Chunks lo..hi were fetched and checked: verified; their pages superseded."""
        self.states[lo : hi + 1] = bytes((VERIFIED,)) * (hi - lo + 1)
        for i in range(lo, hi + 1):
            self.pages.pop(i, None)
        self.last = (lo, hi)

    def add_pages(self, start: int, end: int) -> None:
        """The pages of [start, end) are held (those of absent chunks count)."""
        per = self.chunk_size // PAGE
        for p in range(start // PAGE, -(-end // PAGE)):
            c = p // per
            if self.states[c] == ABSENT:
                self.pages[c] = self.pages.get(c, 0) | (1 << (p % per))

    def resize(self, size: int) -> None:
        """A local write's new length: chunks cut off go, new ones are WRITTEN."""
        n = -(-size // self.chunk_size)
        if n < len(self.states):
            del self.states[n:]
        else:
            self.states.extend(bytes((WRITTEN,)) * (n - len(self.states)))
        self.size = size
