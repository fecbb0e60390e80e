"""Whole reads of tier-1 files and their checksums (xxh3-64 per chunk)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterable, Iterator

import xxhash

MAP_WINDOW = 64 << 20  # file_digests maps this much of a file at a time
CACHESTAT = 451  # cachestat(2), Linux >= 6.5 (the same number on every architecture)
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """Up to `length` bytes; shorter only at EOF."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts = [data]
    got = len(data)
    while got < length and (more := os.pread(fd, length - got, offset + got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def preadv_full(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; fewer bytes only at EOF."""
    got = 0
    while got < len(buf) and (n := os.preadv(fd, [buf[got:]], offset + got)):
        got += n
    return got


def runs(indexes: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Coalesce chunk indexes into half-open runs [a, b)."""
    run: list[int] | None = None  # [start, end)
    for i in sorted(indexes):
        if run is not None and i == run[1]:
            run[1] = i + 1
            continue
        if run is not None:
            yield run[0], run[1]
        run = [i, i + 1]
    if run is not None:
        yield run[0], run[1]


def chunk_digests(data: memoryview, chunk_size: int) -> list[bytes]:
    """The checksum of each `chunk_size` piece of `data` (the last may be shorter)."""
    return [xxhash.xxh3_64_digest(data[o : o + chunk_size]) for o in range(0, len(data), chunk_size)]


def file_digests(fd: int, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
    """The checksums of the chunks of [start, end) of the file behind `fd`, read back
    (`start` chunk-aligned) from a read-only mapping of it: the hash
    reads the page cache's own pages, where a pread copies each byte first (1 GiB
    in page cache, here: 0.22 CPU-s mapped vs 0.65 through pread). The hash does
    not hold the GIL for the bytes (xxhash drops it above 64 KiB), page faults
    included. A file shorter than `end` is an OSError: what was said to be
    written there is not. The caller's claim on [start, end) (a fill) keeps the
    file from shrinking under the mapping."""
    if os.fstat(fd).st_size < end:
        raise OSError(errno.EIO, f"tier-1 file ends before {end}: the fill's bytes are not there")
    step = max(chunk_size, MAP_WINDOW - MAP_WINDOW % chunk_size)
    for a in range(start, end, step):
        lead = a % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        n = lead + min(step, end - a)
        with mmap.mmap(fd, n, offset=a - lead, prot=mmap.PROT_READ) as m, memoryview(m) as view:
            for o in range(lead, n, chunk_size):
                yield xxhash.xxh3_64_digest(view[o : min(o + chunk_size, n)])


def tree_digest(sums: bytes) -> str:
    """The whole-object digest stored with an upload: xxh3-128 over its chunks'
    xxh3-64 checksums in order (`LocalCopy.chunk_sums`)."""
    return xxhash.xxh3_128_hexdigest(sums)


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether every page of [offset, offset+length) of the file is in the page
    cache (cachestat(2): asks, reads nothing); False where the kernel cannot
    say. A read of them then waits for no device."""
    first, last = offset // mmap.PAGESIZE, (offset + length - 1) // mmap.PAGESIZE
    rng, st = _Range(first * mmap.PAGESIZE, (last - first + 1) * mmap.PAGESIZE), _Stat()
    if _libc.syscall(CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return False
    return bool(st.nr_cache >= last - first + 1)
