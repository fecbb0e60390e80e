"""Small objects tier 1 holds whole, loaded at their open (issue 21).

A warm pass over small objects (a second epoch, a pass after a remount) would
otherwise read each object twice in hops of their own: its first read
verifies it (a hop, a device read), then serves it. Loading it in the open's
own worker hop, verified, puts its bytes in memory (bodies.py) for the reads
that follow; with passthrough on, the kernel reads the file itself, so only
its pages are warmed and kept.
"""

from __future__ import annotations

from collections.abc import Callable

from tierfs.cache import Cache, ChunkCorrupt, Entry
from tierfs.read.bodies import Bodies, Body


class WarmLoads:
    def __init__(self, cache: Cache, bodies: Bodies, *, whole_max: int,
                 kernel_reads: Callable[[], bool]) -> None:
        self.cache = cache
        self.bodies = bodies
        self.whole_max = whole_max
        # Whether the kernel reads a verified object's tier-1 file itself (passthrough
        # on): the file's pages are then worth keeping and its bytes in memory not.
        self.kernel_reads = kernel_reads

    def small_complete(self, entry: Entry) -> bool:
        """A small clean object tier 1 holds whole."""
        return 0 < entry.size <= self.whole_max and entry.state == "clean" and entry.serve.complete()

    def loads(self, entry: Entry) -> bool:
        """Whether `load` reads `entry`: a small object tier 1 holds whole and none
        of which was served since the daemon started (a warm pass after a
        remount: its first read would verify it in a hop of its own, and
        passthrough takes verified files only). An object served before is not
        loaded: the kernel may well still hold its pages (keep_cache), and a load
        for nothing would cost a device read per open."""
        return (
            self.small_complete(entry)
            and entry.serve.unverified()
            and (self.kernel_reads() or (self.bodies.cap >= entry.size
                                         and not self.bodies.has(entry.key, entry.etag)))
        )

    def read_soon(self, entry: Entry) -> bool:
        """Whether the device is read for `entry` right after its open: it `loads`,
        or the kernel reads its file through passthrough (with no page cache of
        the mount's own in front: the next epoch reads tier 1 again)."""
        return self.loads(entry) or (self.kernel_reads() and self.small_complete(entry))

    def load(self, entry: Entry) -> tuple[Entry, Body | None]:
        """(In a worker) an open entry, verified if it `loads`, and its bytes for the
        daemon's reads (bodies.py); with passthrough the kernel reads the file, so
        its pages are kept instead. Released if this fails other than by tier 1
        lacking or spoiling the bytes (the read path refetches those)."""
        if not self.loads(entry):
            return entry, None
        kernel = self.kernel_reads()
        try:
            body = entry.serve.read_whole(keep_pages=kernel)
        except (KeyError, ChunkCorrupt):
            return entry, None
        except BaseException:
            self.cache.release(entry)
            raise
        return entry, None if kernel else body
