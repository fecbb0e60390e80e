"""The kernel's view of a mountpoint: what is mounted there, unmounting it,
and whether a directory may be mounted over.

Kept free of pyfuse3, trio and boto3 so that `tierfs umount` starts fast
(importing the daemon's modules cost 0.3 s of a 0.5 s budget).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class MountpointError(Exception):
    """A reason not to mount at (or unmount) a path; one line for the user."""


def mounted_fs(mountpoint: Path) -> str | None:
    """The filesystem type mounted exactly at `mountpoint`, if any."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].encode().decode("unicode_escape") == target:
                return parts[2]
    return None


@dataclass(frozen=True)
class Unmounted:
    ok: bool
    busy: bool = False  # files or working directories are open in it (EBUSY)
    reason: str = ""


def fusermount_unmount(mountpoint: Path, lazy: bool = False) -> Unmounted:
    """`fusermount3 -u` (or `-uz`: detach now, finish when no longer busy)."""
    args = ["fusermount3", "-uz" if lazy else "-u", str(mountpoint)]
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Unmounted(False, reason=str(exc))
    if res.returncode == 0:
        return Unmounted(True)
    reason = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
    return Unmounted(False, busy="busy" in reason.lower(), reason=reason)


def is_stale(mountpoint: Path) -> bool:
    """A FUSE mount whose daemon is gone answers ENOTCONN."""
    try:
        os.statvfs(mountpoint)  # never answered from the kernel's attribute cache
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def check_mountpoint(mountpoint: Path, *, nonempty: bool = False) -> None:
    """Raise MountpointError unless `mountpoint` can be mounted on; a stale tierfs
    mount left by a dead daemon is cleaned first. A directory with files in it is
    refused unless `nonempty` (FUSE's own option): mounting over them hides them."""
    fstype = mounted_fs(mountpoint)
    if fstype is not None:
        if fstype.startswith("fuse") and is_stale(mountpoint) and fusermount_unmount(
            mountpoint, lazy=True
        ).ok:
            log.warning("cleaned a stale mount left at %s by a dead daemon", mountpoint)
        else:
            raise MountpointError(f"mountpoint {mountpoint} is already mounted ({fstype})")
    if not mountpoint.exists():
        raise MountpointError(f"mountpoint {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise MountpointError(f"mountpoint {mountpoint} is not a directory")
    if not nonempty:
        try:
            with os.scandir(mountpoint) as it:
                first = next(it, None)
        except OSError as exc:
            raise MountpointError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        if first is not None:
            raise MountpointError(
                f"mountpoint {mountpoint} is not empty ({first.name!r} and maybe more would be "
                "hidden); empty it, or pass --nonempty to mount over it"
            )
