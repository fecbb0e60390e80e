"""File calls the os module lacks: free a range, hold space past EOF (both
fallocate(2) with FALLOC_FL_KEEP_SIZE: the size is unchanged, only which blocks
are allocated), and start the writeback of a range (sync_file_range(2)).
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_sync_file_range = _libc.sync_file_range
_sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_KEEP_SIZE = 0x01
_PUNCH_HOLE = 0x02
_SYNC_FILE_RANGE_WRITE = 0x02


def _call(fd: int, mode: int, offset: int, length: int) -> None:
    if length > 0 and _fallocate(fd, mode, offset, length) != 0:
        _raise()


def _raise() -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free a byte range of a file; it reads back as zeros and the size stays."""
    _call(fd, _KEEP_SIZE | _PUNCH_HOLE, offset, length)


def hold(fd: int, offset: int, length: int) -> None:
    """Allocate blocks for a range (also past EOF) without changing the size, so
    later writes there cannot fail for want of space."""
    _call(fd, _KEEP_SIZE, offset, length)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue a range's dirty pages for writing to the device and return (no wait,
    no metadata): a later fsync then only waits for what is still in flight."""
    if length > 0 and _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        _raise()
