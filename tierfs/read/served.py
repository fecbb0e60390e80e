"""What a read answers with: its bytes, or a range of the tier-1 file that whoever
replies reads itself (fuse/fs.py hands it to libfuse, which splices it from
the file's page cache without the GIL or a copy in Python)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeAlias


class FileRange(NamedTuple):
    """`length` bytes of the file behind `fd` from `offset` (a loan: Serving.lend).
    `done` ends the loan and must be called once, after the bytes were read."""

    fd: int
    offset: int
    length: int
    done: Callable[[], None]


Served: TypeAlias = "bytes | memoryview | FileRange"
