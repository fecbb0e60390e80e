"""O_DIRECT writes to tier-1 files: aligned buffers and the aligned pwrite.

Why: the kernel already keeps a page-cache copy of every byte read through
the mount (the FUSE inode's pages, `keep_cache`). Filling tier 1 through the
page cache made a second copy of each byte, and on the 2-core bench VM that
fill was the most expensive step of a cold read: a buffered 1 GiB pwrite of
fetched parts cost ~1.0-1.6 s of CPU (fresh page allocation and later
writeback), the same write with O_DIRECT ~0.05 s. So fetched chunks go to
tier 1 through O_DIRECT whenever offset, length and memory are aligned, and
only unaligned tails (the end of an object) use the page cache. Reads of
tier 1 stay buffered (see `Serving.read_aligned`): O_DIRECT reads were cheaper in
CPU but left the device idle between requests, halving warm throughput.

O_DIRECT wants the file offset, the length and the buffer address aligned to
the device's logical block size; ALIGN (4 KiB) covers every common device.
"""

from __future__ import annotations

import ctypes
import mmap
import os

ALIGN = 4096


def aligned_buffer(size: int) -> memoryview:
    """Page-aligned anonymous memory of `size` bytes (an mmap), writable."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def is_aligned(mv: memoryview) -> bool:
    """True if `mv` starts on an ALIGN boundary. Read-only memory (bytes) cannot be
    asked for its address this way and counts as unaligned."""
    if not len(mv) or mv.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)) % ALIGN == 0


def reopen_direct(fd: int) -> int:
    """A second, O_DIRECT descriptor on the file behind `fd` (also when it is already
    unlinked), or -1 where the filesystem refuses O_DIRECT (then callers stay buffered)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def pwrite_direct(dfd: int, fd: int, data: memoryview, offset: int) -> None:
    """Write `data` at `offset`: its aligned part through `dfd` (O_DIRECT, when
    `dfd` >= 0 and memory and offset are aligned), the rest through `fd`."""
    n = len(data) - len(data) % ALIGN
    if dfd >= 0 and n and not offset % ALIGN and is_aligned(data):
        pwrite_all(dfd, data[:n], offset)
        data, offset = data[n:], offset + n
    if data:
        pwrite_all(fd, data, offset)
