"""Control socket: one Unix socket per mount, JSON lines, 0600.

The CLI talks to a daemon only through here. A running daemon publishes its
socket as a symlink named after the mount's device number (`st_dev` of the
mount root, unique while mounted) in a per-user run directory, so any tool
that can stat the mountpoint finds it.

Not an xattr of the root (as before): answering any getxattr makes the kernel
ask `security.capability` on every write(2) to decide whether to drop setuid
bits, a round trip per write (8 KiB writes: 8 s/GiB instead of 1.5 s). With
getxattr unimplemented (ENOSYS) the kernel stops asking.

This module is the CLI's side and imports no trio (every `tierfs status`,
`flush` or `umount` pays for what it imports); the daemon's side is
controlserver.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# A streaming handler gets `emit`, which sends one progress line
# ({"progress": {...}}, no "ok" key) before the final reply.
Emit = Callable[[dict[str, Any]], Awaitable[None]]
MAX_REQUEST = 1 << 20
SUN_PATH_MAX = 100


class ControlError(Exception):
    """The daemon could not be reached or refused the request (one-line message)."""


class ControlUnreachable(ControlError):
    """Nothing answers on the control socket (daemon gone or socket removed)."""


def run_dir() -> Path:
    """This user's directory for sockets and mount entries: /run/tierfs for root,
    else $XDG_RUNTIME_DIR/tierfs or /tmp/tierfs-UID. Created 0700; one that
    another user owns is refused (it could point us at their socket)."""
    if os.geteuid() == 0:
        path = Path("/run/tierfs")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "tierfs"
    else:
        path = Path(f"/tmp/tierfs-{os.geteuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.geteuid():
        raise ControlError(f"{path} belongs to another user; refusing to use it")
    return path


def socket_path(cache_dir: Path) -> Path:
    """Inside the cache dir (0700) unless that path is too long for a Unix socket."""
    path = cache_dir / "control.sock"
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(cache_dir)).hexdigest()[:16]
    return run_dir() / f"{digest}.sock"


def _entry(dev: int) -> str:
    return f"mount-{os.major(dev)}:{os.minor(dev)}.sock"


def publish(dev: int, sock: Path) -> Path:
    """Point this mount's entry at its control socket (atomically: an entry a
    crashed daemon left under the same device number is replaced)."""
    base = run_dir()
    link = base / _entry(dev)
    tmp = base / f".{link.name}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(sock)
    os.replace(tmp, link)
    return link


def find_socket(mountpoint: str | Path) -> str:
    """The control socket of the tierfs mount whose root is `mountpoint`."""
    try:
        st = os.stat(mountpoint)
    except OSError as exc:
        raise ControlError(f"{mountpoint}: not a live tierfs mount ({exc.strerror})") from None
    if not os.path.ismount(mountpoint):
        raise ControlError(f"{mountpoint}: not a live tierfs mount (not a mountpoint)")
    link = run_dir() / _entry(st.st_dev)
    if not link.is_symlink():
        raise ControlError(f"{mountpoint}: not a live tierfs mount (no daemon registered in {link.parent})")
    return str(link)


def request(
    sock_path: str,
    op: str,
    timeout: float | None = 30.0,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    **args: Any,
) -> dict[str, Any]:
    """Send one request and wait for its reply (blocking; for the CLI).

    Progress lines of a streaming op go to `on_progress` (the timeout then
    applies between lines, not to the whole request)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(sock_path)
        except OSError as exc:
            raise ControlUnreachable(f"cannot reach the daemon at {sock_path}: {exc.strerror}") from None
        try:
            s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            buf = b""
            while True:
                while b"\n" not in buf:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ControlError("daemon closed the control connection")
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                reply = json.loads(line)
                if "progress" in reply and "ok" not in reply:
                    if on_progress is not None:
                        on_progress(reply["progress"])
                    continue
                break
        except TimeoutError:
            raise ControlError(f"daemon did not answer {op!r} within {timeout:.0f}s") from None
        except OSError as exc:
            raise ControlError(f"cannot reach the daemon at {sock_path}: {exc.strerror}") from None
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "request failed"))
    return reply
