"""A tierfs mount driven through the real CLI, always torn down (no pytest here:
bench/ and scripts/demo.py use it too).

Teardown never trusts the daemon: `tierfs umount`, then `fusermount3 -u`,
then a lazy `-uz`, then SIGKILL of the daemon's PID, so a failing test
cannot leave a mount (or a wedged CI) behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.cli import _alive
from tierfs.control import find_socket, request

TIERFS = [sys.executable, "-m", "tierfs"]
# TIERFS_TEST_PASSTHROUGH=0: every mount of the tests serves reads on the daemon
# path (--no-passthrough), the way `make test` runs its second pass.
PASSTHROUGH_OFF = os.environ.get("TIERFS_TEST_PASSTHROUGH") == "0"


def run_tierfs(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
               check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TIERFS, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=check, stdin=subprocess.DEVNULL)


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


@dataclass
class TierfsMount:
    source: str
    mountpoint: Path
    cache_dir: Path
    env: dict[str, str]
    extra: list[str] = field(default_factory=list)
    pid: int | None = None

    def start(self) -> TierfsMount:
        if not is_mounted(self.mountpoint):  # a stale mount is tierfs's to clean
            self.mountpoint.mkdir(parents=True, exist_ok=True)
        extra = [*self.extra, "--no-passthrough"] if PASSTHROUGH_OFF else self.extra
        res = run_tierfs("mount", self.source, str(self.mountpoint), "--cache-dir",
                         str(self.cache_dir), *extra, env=self.env)
        if res.returncode != 0:
            raise RuntimeError(f"mount failed ({res.returncode}): {res.stderr.strip()}")
        self.stderr = res.stderr
        self.pid = int(self.status()["pid"])
        return self

    def status(self) -> dict:
        """What `tierfs status --json` prints, asked over the control socket from
        this process: a `python -m tierfs` per call costs ~0.35 CPU-s, and tests
        poll it (the CLI's own output is tested where it is the point)."""
        reply = request(find_socket(self.mountpoint), "status")
        reply.pop("ok", None)
        return reply

    def metric(self, name: str) -> float:
        return float(self.status()["metrics"].get(name, 0.0))

    def umount(self) -> subprocess.CompletedProcess[str]:
        res = run_tierfs("umount", str(self.mountpoint), env=self.env, timeout=120)
        self._wait_dead()
        return res

    def kill9(self) -> None:
        """Simulate a daemon crash; the dead mount stays until cleaned."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        self._wait_dead()

    def _wait_dead(self, timeout: float = 30) -> None:
        if self.pid is None:
            return
        deadline = time.monotonic() + timeout
        # The daemon is not our child (it detached): init reaps it, here 2-3 s after
        # it exited, and kill(pid, 0) answers until then. An exited process is gone.
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.02)
        self.pid = None

    def cleanup(self) -> None:
        """Best-effort, escalating teardown; safe to call at any time."""
        if is_mounted(self.mountpoint):
            # What `tierfs umount --no-flush` does, from this process (a CLI start is
            # ~0.35 CPU-s, once per mount of the suite): unmount, then the daemon exits.
            with contextlib.suppress(Exception):
                reply = request(find_socket(self.mountpoint), "unmount", timeout=30.0,
                                flush=False)
                if reply.get("stopped"):  # not when busy: the escalation below goes on
                    self._wait_dead(timeout=60)
        for args in (["-u"], ["-uz"]):
            if not is_mounted(self.mountpoint):
                break
            subprocess.run(["fusermount3", *args, str(self.mountpoint)], capture_output=True,
                           timeout=30, check=False)
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._wait_dead()


def drop_page_cache() -> None:
    """Make the next reads reach the daemon, not the kernel's copy (root only:
    a test that needs it says so with `needs_root`; a failure here is a failure)."""
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)



def kill_daemon_with_open_writer(m: TierfsMount, path: Path, nbytes: int,
                                 before: Callable[[], None] | None = None) -> None:
    """kill -9 the daemon while another process has written `nbytes` to `path`
    and not closed it (the crash a quarantine exists for); `before` runs between
    the write and the kill."""
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; f=open(sys.argv[1],'wb'); "
         f"f.write(b'x'*{nbytes}); f.flush(); print('ok', flush=True); time.sleep(600)",
         str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ok"
        if before is not None:
            before()
        m.kill9()
    finally:
        writer.kill()
        writer.wait()
