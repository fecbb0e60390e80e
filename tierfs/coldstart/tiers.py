"""Where a stage's bytes came from: the kernel page cache, tier 1, or the store.

- Page cache: mincore(2) over the stage's files just before it runs says which
  pages the kernel already holds, on any filesystem.
- The rest had to come from below. On a tierfs mount the daemon's counters
  (control socket `status`) split it: bytes the daemon served count as from
  the store up to what it fetched from the store since the load began (the
  whole-object prefetch of model files fetches ahead of the reader, so a
  fetch in one stage may serve the next), the remainder as tier 1. Elsewhere
  (local disk, NFS) it is "storage".
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.control import ControlError, request

PAGE_CACHE = "page cache"
TIER1 = "tier 1"
STORE = "store"
STORAGE = "storage"
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now (mincore of a mapping that is never
    touched, so it faults nothing in). 0 when the file cannot be mapped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return 0
        try:
            pages = -(-size // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return 0
            resident = sum(b & 1 for b in vec) * PAGE
            if vec[pages - 1] & 1:
                resident -= pages * PAGE - size  # the last page is partly past EOF
            return resident
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _mount_socket(path: Path) -> tuple[Path, str] | None:
    """(mount root, control socket) when `path` lies on a live tierfs mount."""
    from tierfs.cli_ops import OpsError, mount_of

    try:
        root, sock, _ = mount_of(path)
    except (OpsError, ControlError):
        return None
    return root, sock


@dataclass
class Split:
    nbytes: int = 0
    origins: dict[str, int] = field(default_factory=dict)


class Sources:
    """Splits each stage's bytes by origin; one per load of one path."""

    def __init__(self, path: Path) -> None:
        found = _mount_socket(path)
        self.mount: Path | None = found[0] if found else None
        self._sock = found[1] if found else None
        self._start = self._counters()

    def _counters(self) -> tuple[float, float]:
        """(bytes the daemon served to readers, bytes it fetched from the store)."""
        if self._sock is None:
            return 0.0, 0.0
        try:
            m = request(self._sock, "status", timeout=10.0)["metrics"]
        except (ControlError, KeyError):
            return 0.0, 0.0
        served = float(m.get("tierfs_read_bytes_total{tier=cache}", 0.0)) + \
            float(m.get("tierfs_read_bytes_total{tier=store}", 0.0))
        return served, float(m.get("tierfs_store_bytes_total{op=get}", 0.0))

    def _from_store(self, now: tuple[float, float]) -> float:
        """Served bytes that came from the store, cumulative since the load began."""
        return min(now[0] - self._start[0], now[1] - self._start[1])

    @contextlib.contextmanager
    def stage(self, files: Sequence[Path] | None) -> Iterator[Split]:
        """Measure one stage over `files` (None: not known beforehand, as in
        discovery). The caller sets `nbytes` on the yielded Split; `origins`
        is filled at exit, summing to it (empty when the split is unknown)."""
        resident = None if files is None else sum(resident_bytes(f) for f in files)
        before = self._counters()
        split = Split()
        yield split
        after = self._counters()
        nbytes = split.nbytes
        if resident is None:
            if self._sock is None:
                return  # neither mincore beforehand nor counters: unknown
            resident = nbytes - int(after[0] - before[0])
        resident = max(0, min(nbytes, resident))
        below = nbytes - resident
        split.origins[PAGE_CACHE] = resident
        if self._sock is None:
            split.origins[STORAGE] = below
            return
        store = int(min(below, max(0.0, self._from_store(after) - self._from_store(before))))
        split.origins[STORE] = store
        split.origins[TIER1] = below - store
