"""Control socket: one Unix socket per mount, JSON lines, 0600.

The CLI talks to a daemon only through here. A running daemon publishes its
socket as a symlink named after the mount's device number (`st_dev` of the
mount root, unique while mounted) in a per-user run directory, so any tool
that can stat the mountpoint finds it.

Not an xattr of the root (as before): answering any getxattr makes the kernel
ask `security.capability` on every write(2) to decide whether to drop setuid
bits, a round trip per write (8 KiB writes: 8 s/GiB instead of 1.5 s). With
getxattr unimplemented (ENOSYS) the kernel stops asking.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# A streaming handler gets `emit`, which sends one progress line
# ({"progress": {...}}, no "ok" key) before the final reply.
Emit = Callable[[dict[str, Any]], Awaitable[None]]
StreamHandler = Callable[[dict[str, Any], Emit], Awaitable[dict[str, Any]]]
MAX_REQUEST = 1 << 20
REPLY_TIMEOUT = 5.0  # seconds a final reply may take to send
# What a handler raises for a request it cannot do as asked (no such path, a bad
# argument): answered as an error, logged in one line, no traceback.
REQUEST_ERRORS: tuple[type[Exception], ...] = (ValueError, LookupError, OSError)
SUN_PATH_MAX = 100


class ControlError(Exception):
    """The daemon could not be reached or refused the request (one-line message)."""


class ControlUnreachable(ControlError):
    """Nothing answers on the control socket (daemon gone or socket removed)."""


class ClientGone(Exception):
    """The client of a streaming request went away; the request is abandoned."""


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


class ControlServer:
    def __init__(
        self,
        path: Path,
        handlers: dict[str, Handler],
        stream_handlers: dict[str, StreamHandler] | None = None,
        request_errors: tuple[type[Exception], ...] = (),
    ) -> None:
        self.path = path
        self.handlers = handlers
        self.stream_handlers = stream_handlers or {}
        self.request_errors = REQUEST_ERRORS + request_errors

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._client, [listener])
        finally:
            with contextlib.suppress(OSError):
                self.path.unlink()

    async def _client(self, stream: trio.SocketStream) -> None:
        """One connection; whatever it does, it never ends the server (nor the
        nursery the daemon shares with it)."""
        try:
            await self._serve_client(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("control client went away: %s", exc)
        except Exception:
            log.exception("control request failed unexpectedly")

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\n" not in buf:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_REQUEST:
                    return
            handler: Handler
            try:
                request = json.loads(buf.split(b"\n", 1)[0])
                op = request["op"]
                if op in self.stream_handlers:
                    streamer = self.stream_handlers[op]

                    async def emit(progress: dict[str, Any]) -> None:
                        try:
                            await _send(stream, {"progress": progress})
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            raise ClientGone() from None

                    def streaming(req: dict[str, Any]) -> Awaitable[dict[str, Any]]:
                        return streamer(req, emit)

                    handler = streaming
                else:
                    handler = self.handlers[op]
            except (ValueError, KeyError, TypeError):
                await _send(stream, {"ok": False, "error": "bad request"})
                return
            try:
                reply = await handler(request)
                reply.setdefault("ok", True)
            except ClientGone:
                log.info("control %s: client went away; abandoned", request.get("op"))
                return
            except self.request_errors as exc:  # a bad path or argument: the caller's mistake
                log.info("control %s refused: %s", request.get("op"), exc)
                reply = {"ok": False, "error": str(exc)}
            except Exception as exc:
                log.exception("control %s failed", request.get("op"))
                reply = {"ok": False, "error": str(exc)}
            # Shielded: the reply to `unmount` races the shutdown it starts.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(REPLY_TIMEOUT),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await _send(stream, reply)


async def _send(stream: trio.SocketStream, obj: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(obj).encode() + b"\n")


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
