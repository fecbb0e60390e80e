"""Peer S3 filesystems on the bench's bucket, measured next to tierfs (`--peers`).

Each peer is mounted the way a user of it would for these workloads (big
sequential reads, random reads, checkpoint writes): its disk cache on, inside
the bench work dir, empty for every fresh mount. The peer runs in the
foreground under Popen, so the bench owns its PID; the mount is awaited in
/proc/self/mounts, and teardown is `fusermount3 -u`, then `-uz`, then SIGKILL.
Every peer mount gets the kernel readahead tierfs and bench/passthrough.py use
(bdi read_ahead_kb = 1024), so the kernel's window is the same for all.

rclone (Debian `rclone`, 1.60):
  rclone mount :s3,provider=Other,endpoint='URL',env_auth=true:bench MNT
    --config /notfound              no rclone.conf: the remote is the connection
                                    string, the keys come from AWS_* (env_auth),
                                    never the command line
    --vfs-cache-mode full           reads cached on disk (sparse files), writes
                                    written back from the cache after close
    --cache-dir WORK/rclone-cacheN
    --vfs-read-chunk-size 32Mi      ranged GETs of 32 MiB, doubling (limit off)
    --vfs-write-back 1s             upload 1 s after close (default 5 s): a
                                    checkpoint should land promptly
    --s3-chunk-size 16Mi --s3-upload-concurrency 8
                                    multipart uploads with 8 x 16 MiB in flight
s3fs (Debian `s3fs`, s3fs-fuse 1.90):
  s3fs bench MNT -f -o url=URL,use_path_request_style,endpoint=us-east-1,
                       passwd_file=WORK/s3fs.passwd (ACCESS:SECRET, mode 0600),
                       use_cache=WORK/s3fs-cacheN,parallel_count=8,multipart_size=16
    use_cache                       objects cached on disk (sparse), so warm
                                    reads come from local disk
    parallel_count=8,multipart_size=16
                                    8 parallel 16 MiB ranged GETs / upload parts
JuiceFS is not packaged in Debian: it is listed as not installed and skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common import BUCKET, Bench

from tests.support.mount import is_mounted
from tierfs.fuse.kernel import set_kernel_readahead

MOUNT_TIMEOUT = 30.0
_seq = itertools.count(1)


def _rclone(b: Bench, mnt: Path, cache: Path) -> list[str]:
    remote = f":s3,provider=Other,endpoint='{b.server.endpoint}',env_auth=true:{BUCKET}"
    return ["rclone", "mount", remote, str(mnt), "--config", "/notfound",
            "--vfs-cache-mode", "full", "--cache-dir", str(cache), "--vfs-read-chunk-size", "32Mi",
            "--vfs-write-back", "1s", "--s3-chunk-size", "16Mi", "--s3-upload-concurrency", "8"]


def _s3fs(b: Bench, mnt: Path, cache: Path) -> list[str]:
    passwd = b.work / "s3fs.passwd"
    if not passwd.exists():
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{b.server.access_key}:{b.server.secret_key}\n")
    opts = (f"url={b.server.endpoint},use_path_request_style,endpoint=us-east-1,passwd_file={passwd},"
            f"use_cache={cache},parallel_count=8,multipart_size=16")
    return ["s3fs", BUCKET, str(mnt), "-f", "-o", opts]


@dataclass(frozen=True)
class Peer:
    name: str
    binary: str
    apt: str | None  # Debian package; None: not packaged
    command: Callable[[Bench, Path, Path], list[str]] | None

    def installed(self) -> bool:
        return self.command is not None and shutil.which(self.binary) is not None

    def version(self) -> str:
        res = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=False)
        out = (res.stdout or res.stderr).strip()
        return out.splitlines()[0] if out else "?"


PEERS = (
    Peer("rclone", "rclone", "rclone", _rclone),
    Peer("s3fs", "s3fs", "s3fs", _s3fs),
    Peer("juicefs", "juicefs", None, None),
)


def select(b: Bench) -> list[Peer]:
    """The installed peers when --peers is given (none otherwise); prints and
    records which are installed and which are not."""
    if not b.args.peers:
        return []
    status: dict[str, str] = {}
    for p in PEERS:
        if p.installed():
            status[p.name] = f"installed: {p.version()}"
        elif p.apt:
            status[p.name] = f"not installed (apt-get install {p.apt})"
        else:
            status[p.name] = "not installed (not packaged in Debian)"
    print("peers:")
    for name, s in status.items():
        print(f"  {name}: {s}")
    b.result["peers"] = status
    return [p for p in PEERS if p.installed()]


@dataclass
class PeerMount:
    name: str
    mountpoint: Path
    cache: Path
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cached_bytes(self) -> int:
        """Bytes the peer holds in its disk cache (allocated blocks: the caches
        are sparse), i.e. what it fetched and kept. Hard links count once
        (s3fs links its cache files into a .mirror dir)."""
        files = {(st.st_dev, st.st_ino): st.st_blocks * 512
                 for st in (f.stat() for f in self.cache.rglob("*") if f.is_file())}
        return sum(files.values())

    def stop(self) -> None:
        """Unmount, escalating; safe to call twice. A clean unmount lets the peer exit
        on its own (rclone finishes pending uploads first)."""
        for flag in ("-u", "-uz"):
            if not is_mounted(self.mountpoint):
                break
            subprocess.run(["fusermount3", flag, str(self.mountpoint)], capture_output=True,
                           timeout=60, check=False)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        return ""


@contextlib.contextmanager
def mount(b: Bench, peer: Peer) -> Iterator[PeerMount]:
    """A fresh mount of `peer` with an empty disk cache in the work dir; always unmounted,
    and the cache removed, on exit."""
    assert peer.command is not None
    n = next(_seq)
    mnt, cache = b.work / f"{peer.name}-mnt{n}", b.work / f"{peer.name}-cache{n}"
    mnt.mkdir()
    cache.mkdir()
    log = b.work / f"{peer.name}-{n}.log"
    # The endpoint is plain HTTP, and rclone 1.60's AWS SDK fails on any AWS_CA_BUNDLE
    # ("HTTPClient's transport unsupported type"), so the peers do not get one.
    env = {k: v for k, v in b.env.items() if k != "AWS_CA_BUNDLE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(peer.command(b, mnt, cache), env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pm = PeerMount(peer.name, mnt, cache, log, proc)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(mnt):
            if proc.poll() is not None:
                raise RuntimeError(f"{peer.name} exited with {proc.returncode} before mounting "
                                   f"{mnt}:\n{pm.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{peer.name} did not mount {mnt} within {MOUNT_TIMEOUT:.0f}s:\n"
                                   f"{pm.log_tail()}")
            time.sleep(0.05)
        set_kernel_readahead(mnt, 1024)
        yield pm
    finally:
        pm.stop()
        shutil.rmtree(cache, ignore_errors=True)
