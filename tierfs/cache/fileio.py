"""Whole reads of tier-1 files and their checksums (xxh3-64 per chunk)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator

import xxhash


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
    (`start` chunk-aligned). Neither the pread nor the hash holds the GIL for the
    bytes (xxhash drops it above 64 KiB). A file shorter than `end` is an OSError:
    what was said to be written there is not."""
    buf = memoryview(bytearray(min(chunk_size, end - start)))
    for a in range(start, end, chunk_size):
        n = min(chunk_size, end - a)
        if preadv_full(fd, buf[:n], a) != n:
            raise OSError(errno.EIO, f"tier-1 file ends before {end}: the fill's bytes are not there")
        yield xxhash.xxh3_64_digest(buf[:n])


def tree_digest(sums: bytes) -> str:
    """The whole-object digest stored with an upload: xxh3-128 over its chunks'
    xxh3-64 checksums in order (`LocalCopy.chunk_sums`)."""
    return xxhash.xxh3_128_hexdigest(sums)
