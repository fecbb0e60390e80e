"""The daemon's side of the control socket (control.py: the format, where the
socket is found, and the CLI's blocking client): JSON lines on a 0600 Unix
socket, one request per connection, streaming progress lines for long ops."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from tierfs.control import MAX_REQUEST, Emit

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
StreamHandler = Callable[[dict[str, Any], Emit], Awaitable[dict[str, Any]]]
REPLY_TIMEOUT = 5.0  # seconds a final reply may take to send
# What a handler raises for a request it cannot do as asked (no such path, a bad
# argument): answered as an error, logged in one line, no traceback.
REQUEST_ERRORS: tuple[type[Exception], ...] = (ValueError, LookupError, OSError)


class ClientGone(Exception):
    """The client of a streaming request went away; the request is abandoned."""


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
