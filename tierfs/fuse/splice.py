"""Whether reads of tier-1 bytes are answered by libfuse from the file itself.

A read of bytes this process has checked in tier 1 can be handed to libfuse as
a range of the file (`pyfuse3.FileSlice`, third_party/pyfuse3): libfuse
splices it from the page cache into the reply without the GIL, so the trio
thread neither copies the bytes nor holds the GIL while the kernel takes
them. libfuse splices only through a pipe that holds the whole reply (a
1 MiB read needs more than 1 MiB: `fs.pipe-max-size` is 1 MiB by default,
and only CAP_SYS_RESOURCE may exceed it); otherwise it reads the range into
a fresh buffer of its own each time, which costs more than the copy it
replaces (page faults on every page: a cold 1 GiB read's reply thread went
from 0.6 to 1.5 CPU-s). So "auto" lends only where such a pipe can be made.
"""

from __future__ import annotations

import fcntl
import logging
import os

import pyfuse3

log = logging.getLogger(__name__)

FILE_SLICES = hasattr(pyfuse3, "FileSlice")  # the patched pyfuse3 (a stock one has none)
MAX_REPLY = 1 << 20  # the largest FUSE read (the kernel's 256 pages)
# libfuse's pipe for a reply: the reply, its header and a page per buffer and iovec.
PIPE_NEEDED = MAX_REPLY + 4 * 4096
PIPE_MAX_SIZE = "/proc/sys/fs/pipe-max-size"


def pipe_fits(size: int = PIPE_NEEDED) -> bool:
    """Whether this process may size a pipe to hold `size` bytes."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, size)
        return True
    except OSError:
        return False
    finally:
        os.close(r)
        os.close(w)


def decide(setting: str) -> bool:
    """Whether reads are answered from tier-1 files (`[read] splice`): "on" always
    (where libfuse cannot splice, it copies), "off" never, "auto" where a pipe
    can hold a whole reply."""
    if setting == "off" or not FILE_SLICES:
        return False
    if setting == "on" or pipe_fits():
        return True
    log.info("read replies from tier 1 are copied by the daemon: a pipe cannot hold a %d KiB "
             "reply here (%s is %s and the daemon lacks CAP_SYS_RESOURCE); "
             "sysctl fs.pipe-max-size=2097152 lets libfuse splice them",
             MAX_REPLY >> 10, PIPE_MAX_SIZE, _pipe_max())
    return False


def _pipe_max() -> str:
    try:
        with open(PIPE_MAX_SIZE) as f:
            return f.read().strip()
    except OSError:
        return "unknown"
