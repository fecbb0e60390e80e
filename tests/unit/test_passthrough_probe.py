"""tierfs.fuse.passthrough's probe: each reason it gives, from the texts the kernel writes."""

from __future__ import annotations

import os
from pathlib import Path

import pyfuse3
import pytest

from tierfs.fuse import passthrough

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
41 22 0:35 / /var/lib/docker/overlay2/x/merged rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
42 22 0:36 / /mnt/nvme\\040disk rw,relatime - xfs /dev/nvme0n1 rw
43 42 0:37 / /mnt/nvme\\040disk rw,relatime - overlay overlay rw,lowerdir=/a,upperdir=/b,workdir=/c
"""


@pytest.mark.parametrize(("release", "ok"), [
    ("6.18.44-fc-v1147", True), ("6.9.0", True), ("6.8.12-amd64", False), ("5.15.0-91-generic", False),
])
def test_kernel_release(release: str, ok: bool) -> None:
    why = passthrough.kernel_reason(release)
    assert (why is None) == ok
    if not ok:
        assert why == f"kernel {release} < 6.9"


def test_cap_sys_admin_from_proc_status() -> None:
    full = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n"
    no_admin = "CapEff:\t" + format(0x1FFFFFFFFFF & ~(1 << 21), "016x") + "\n"
    assert passthrough.has_cap_sys_admin(full)
    assert not passthrough.has_cap_sys_admin(no_admin)
    assert not passthrough.has_cap_sys_admin("Name:\tx\n")
    me = passthrough.has_cap_sys_admin(Path("/proc/self/status").read_text())
    assert me == (os.geteuid() == 0)  # root here has the full set; nobody else has it


def test_fs_type_of_the_deepest_last_mount() -> None:
    assert passthrough.fs_type(Path("/var/cache/tierfs"), MOUNTINFO) == "ext4"
    assert passthrough.fs_type(Path("/var/lib/docker/overlay2/x/merged/cache"), MOUNTINFO) == "overlay"
    # \040-escaped space; of two mounts on one point the later (on top) counts
    assert passthrough.fs_type(Path("/mnt/nvme disk/tierfs"), MOUNTINFO) == "overlay"
    assert passthrough.fs_type(Path("/mnt/nvme"), MOUNTINFO) == "ext4"  # a prefix, not a parent


def test_probe_of_a_cache_dir_not_made_yet(tmp_path: Path) -> None:
    """The filesystem that will hold it decides; here that is tmp_path's."""
    here = passthrough.fs_type(tmp_path.resolve(), Path("/proc/self/mountinfo").read_text())
    mode = passthrough.probe(tmp_path / "not" / "yet")
    assert mode.enabled == passthrough.probe(tmp_path).enabled
    if mode.enabled:
        assert mode.reason.endswith(f"cache dir on {here}")


def test_this_pyfuse3_build() -> None:
    """make setup built pyfuse3 with passthrough unless it said why not (PASSTHROUGH=0 or a
    failed build); the probe's reason matches what was installed."""
    why = passthrough.pyfuse3_reason()
    if getattr(pyfuse3, "HAVE_PASSTHROUGH", False):
        assert why is None
        assert passthrough.probe(Path("/tmp"), wanted=False) == passthrough.Mode(
            False, "turned off: --no-passthrough or [read] passthrough = false")
    else:
        assert why is not None and "pyfuse3" in why


def test_inode_backings_keep_one_mode_per_inode() -> None:
    """Daemon-path opens need no connection: the bookkeeping the kernel's rule asks for."""
    t = passthrough.InodeBackings()
    assert t.acquire(7, None) == 0 and t.mode(7) == 0
    assert t.acquire(7, None) == 0
    t.release(7)
    assert t.mode(7) == 0
    t.release(7)
    assert t.mode(7) is None
