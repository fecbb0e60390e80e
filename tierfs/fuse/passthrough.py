"""FUSE passthrough: whether this mount can use it (and why not), and the kernel's rules.

With passthrough (Linux >= 6.9, libfuse >= 3.17 through the pyfuse3 built by
third_party/build.sh) the kernel serves read, write and mmap of an open file
from a backing file the daemon registered: no READ or WRITE request reaches
the daemon. This module answers whether a mount can use it, with a one-line
reason when not, and registers backing files under the kernel's rule that all
concurrent opens of an inode use one backing id or none. Which files go
passthrough is the caller's decision.

Contract for callers (each point is a failure seen on this machine kind):
- every open of an inode goes through `InodeBackings.acquire`, daemon-path
  opens too, or a mixed open fails with EIO;
- the mount keeps `getxattr` unimplemented (ENOSYS), or each write(2) on a
  passthrough file costs a GETXATTR(security.capability) round trip;
- no kernel write-back cache: it excludes passthrough (pyfuse3 then does not
  ask for it, and registering fails with EPERM).
"""

from __future__ import annotations

import errno
import os
import platform
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyfuse3

MIN_KERNEL = (6, 9)
MIN_LIBFUSE = (3, 17)
CAP_SYS_ADMIN = 21
# Filesystems whose files cannot back a passthrough file: they stack on
# another one (s_stack_depth > 0), and the connection allows depth 0 only.
STACKED_FS = frozenset({"overlay", "ecryptfs", "aufs"})


@dataclass(frozen=True)
class Mode:
    """Passthrough on or off for a mount, and one line on why."""

    enabled: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.enabled else 'off'} ({self.reason})"


def _version(text: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def kernel_reason(release: str) -> str | None:
    """Why this kernel release cannot do passthrough, if it cannot."""
    if _version(release) < MIN_KERNEL:
        return f"kernel {release} < {MIN_KERNEL[0]}.{MIN_KERNEL[1]}"
    return None


def pyfuse3_reason() -> str | None:
    """Why the loaded pyfuse3 cannot do passthrough, if it cannot."""
    have = getattr(pyfuse3, "HAVE_PASSTHROUGH", None)
    if have is None:
        return f"pyfuse3 {pyfuse3.__version__} is the stock build (see third_party/README.md)"
    if not have:
        return f"pyfuse3 was built against libfuse {pyfuse3.LIBFUSE_VERSION} (< 3.17)"
    return None


def has_cap_sys_admin(status: str) -> bool:
    """Whether the effective capabilities in a /proc/PID/status text include CAP_SYS_ADMIN."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status, re.M)
    return m is not None and bool(int(m[1], 16) >> CAP_SYS_ADMIN & 1)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def fs_type(path: Path, mountinfo: str) -> str:
    """Type of the filesystem holding the absolute, resolved `path`, from a
    /proc/PID/mountinfo text: the last-mounted of the longest mount points that
    contain it."""
    p = path
    best, best_len = "", -1
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mnt = Path(_unescape(fields[4]))
        if (p == mnt or mnt in p.parents) and len(mnt.parts) >= best_len:
            best, best_len = right.split()[0], len(mnt.parts)
    return best


def probe(cache_dir: Path, wanted: bool = True) -> Mode:
    """Before mounting: what can be known without a FUSE connection.

    `enabled` here means "ask the kernel for it" (`Operations.enable_passthrough`);
    `confirm` says after init whether it was granted and registration works."""
    if not wanted:
        return Mode(False, "turned off: --no-passthrough or [read] passthrough = false")
    release = platform.release()
    why = kernel_reason(release) or pyfuse3_reason()
    if why:
        return Mode(False, why)
    if not has_cap_sys_admin(Path("/proc/self/status").read_text()):
        return Mode(False, "registering backing files needs CAP_SYS_ADMIN")
    holder = cache_dir.resolve()
    while not holder.exists() and holder != holder.parent:  # a cache dir not made yet
        holder = holder.parent
    fstype = fs_type(holder, Path("/proc/self/mountinfo").read_text())
    if fstype in STACKED_FS:
        return Mode(False, f"cache dir {cache_dir} is on {fstype} (a stacked filesystem)")
    return Mode(True, f"kernel {release}, libfuse {pyfuse3.LIBFUSE_VERSION}, cache dir on {fstype}")


def confirm(mode: Mode, cache_dir: Path) -> Mode:
    """Once the kernel's INIT has been answered (the mount answered a request):
    was passthrough granted, and does registering a file of the cache dir work?
    The trial registers a nameless temporary file and drops its id at once."""
    if not mode.enabled:
        return mode
    if not pyfuse3.passthrough_granted():
        return Mode(False, "not granted at init (kernel without CONFIG_FUSE_PASSTHROUGH,"
                           " or the write-back cache is on)")
    try:
        with tempfile.TemporaryFile(dir=cache_dir) as f:
            unregister(register(f.fileno()))
    except OSError as exc:
        hint = {errno.EPERM: " (CAP_SYS_ADMIN? write-back cache?)",
                errno.ELOOP: " (cache dir on a stacked filesystem)"}.get(exc.errno or 0, "")
        return Mode(False, f"registering a cache file failed: {os.strerror(exc.errno or 0)}{hint}")
    return mode


def file_info(fh: int, keep_cache: bool, direct_io: bool, backing_id: int,
              *, noflush: bool) -> pyfuse3.FileInfo:
    """An open's reply; `backing_id` > 0 makes it passthrough; `noflush`: close(2)
    of its descriptors sends no FLUSH (the kernel sends it anyway while its
    write-back cache is on). Only the patched pyfuse3 has these two fields
    (third_party/pyfuse3); a stock one gets neither."""
    info = pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=direct_io)
    if backing_id:
        info.backing_id = backing_id
    if noflush and hasattr(info, "noflush"):
        info.noflush = True
    return info


def register(fd: int) -> int:
    """Register an open file as a backing file: its backing id (> 0). OSError
    as from `pyfuse3.passthrough_open` (ENOTSUP with a stock pyfuse3)."""
    fn = getattr(pyfuse3, "passthrough_open", None)
    if fn is None:
        raise OSError(errno.ENOTSUP, "stock pyfuse3: no passthrough")
    backing_id: int = fn(fd)
    return backing_id


def unregister(backing_id: int) -> None:
    """Drop a backing id; files already open on it keep working."""
    pyfuse3.passthrough_close(backing_id)


class InodeBackings:
    """The mode of each open inode: its backing id, shared by all its
    concurrent opens, or 0 for the daemon path.

    The kernel fails an open with EIO unless every concurrent open of an inode
    is passthrough on the same backing file, or none is (FOPEN_DIRECT_IO does
    not exempt an open). So an open inode keeps its mode, whatever a new open
    asks for; it changes only once every handle was released. Not thread-safe:
    call it from the trio loop (it does no disk I/O; registering is an ioctl)."""

    def __init__(self) -> None:
        # inode -> (backing id or 0, what the backing file holds, opens)
        self._open: dict[int, tuple[int, object, int]] = {}

    def acquire(self, inode: int, fd: int | None, owner: object = None,
                *, join: bool = True) -> int | None:
        """Count one more open of `inode`: the backing id its reply must carry
        (0: serve it on the daemon path). `fd`: a file to register if this open
        starts the inode's passthrough (the caller keeps and closes it); None
        asks for the daemon path. `owner`: what the backing file holds, for
        `owner()`. With `join=False` an inode open in passthrough is refused:
        None, nothing counted. OSError from registering counts nothing."""
        backing_id, held, opens = self._open.get(inode, (-1, None, 0))
        if opens == 0:
            backing_id, held = (register(fd), owner) if fd is not None else (0, None)
        elif backing_id and not join:
            return None
        self._open[inode] = (backing_id, held, opens + 1)
        return backing_id

    def release(self, inode: int) -> None:
        """Count one open less; the last one drops the inode's backing id."""
        backing_id, held, opens = self._open[inode]
        if opens > 1:
            self._open[inode] = (backing_id, held, opens - 1)
            return
        del self._open[inode]
        if backing_id:
            unregister(backing_id)

    def mode(self, inode: int) -> int | None:
        """The backing id (0: daemon path) of an open inode; None when not open."""
        entry = self._open.get(inode)
        return entry[0] if entry else None

    def owner(self, inode: int) -> object:
        """What the backing file of an inode open in passthrough holds (None otherwise)."""
        entry = self._open.get(inode)
        return entry[1] if entry else None

    def backed(self) -> int:
        """Inodes open in passthrough right now."""
        return sum(1 for b, _, _ in self._open.values() if b)
