"""Disk-space calls the os module lacks: free a range, hold space past EOF.

Both are fallocate(2) with FALLOC_FL_KEEP_SIZE: the file's size is unchanged,
only which of its blocks are allocated.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_KEEP_SIZE = 0x01
_PUNCH_HOLE = 0x02


def _call(fd: int, mode: int, offset: int, length: int) -> None:
    if length > 0 and _fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free a byte range of a file; it reads back as zeros and the size stays."""
    _call(fd, _KEEP_SIZE | _PUNCH_HOLE, offset, length)


def hold(fd: int, offset: int, length: int) -> None:
    """Allocate blocks for a range (also past EOF) without changing the size, so
    later writes there cannot fail for want of space."""
    _call(fd, _KEEP_SIZE, offset, length)
