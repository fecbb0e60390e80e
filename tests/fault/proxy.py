"""A fault-injecting HTTP/1.1 proxy for S3 tests.

`FaultProxy` sits between an S3 client (boto3, a tierfs daemon in another
process) and a real S3 server on loopback. It runs its own trio loop in a
background thread, so synchronous tests can drive it. Request and response
bytes are forwarded unchanged, Host header included: the client signs the
proxy's host:port and the server verifies the Host it receives, so SigV4 holds.

Each request is classified into an op and checked against the rules in order;
the first rule that matches and wins its draw decides the fault. All draws come
from one `random.Random(seed)` under a lock, so the same seed and the same
request sequence give the same decisions. Path-style addressing is assumed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import re
import select
import socket
import struct
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal, NamedTuple
from urllib.parse import parse_qsl, urlsplit
from xml.sax.saxutils import escape

import trio

Fault = Literal["403", "500", "501", "503", "reset", "truncate", "latency", "blackhole"]
FAULTS: frozenset[str] = frozenset(
    {"403", "500", "501", "503", "reset", "truncate", "latency", "blackhole"})
OPS: frozenset[str] = frozenset(
    {"get", "head", "put", "multipart", "list", "copy", "delete", "other"}
)

_CHUNK = 1 << 20  # relay unit: bodies are streamed, never held whole
_MAX_HEAD = 64 * 1024
_POLL = 0.05  # seconds between checks of blackhole release and partition end
_LINGER = 1.0  # seconds to drain a client before closing after an early answer
_BODY_GRACE = 0.1  # seconds to let the request-body relay finish after the answer

_ERRORS = {
    "403": ("403 Forbidden", "AccessDenied", "Access Denied."),  # a permanent error
    "500": ("500 Internal Server Error", "InternalError", "We encountered an internal error."),
    # What a store without conditional writes answers a PUT with If-None-Match.
    "501": ("501 Not Implemented", "NotImplemented",
            "A header you provided implies functionality that is not implemented."),
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
}

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    """Inject `fault` into matching requests.

    ops: ops to match (None: all). path: regex searched in the request target
    (path and query). header: a request header (lower-case name) the request
    must carry. probability: chance per matching request. count: apply at most
    this many times (None: no limit). delay: seconds, for "latency".
    """

    fault: Fault
    ops: AbstractSet[str] | None = None
    probability: float = 1.0
    count: int | None = None
    delay: float = 0.0
    path: str | None = None
    header: str | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}")
        if self.ops is not None:
            if not set(self.ops) <= OPS:
                raise ValueError(f"unknown ops {set(self.ops) - OPS}")
            object.__setattr__(self, "ops", frozenset(self.ops))
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be in [0, 1]")


class LogEntry(NamedTuple):
    """One request seen by the proxy; fault is "none" when passed through."""

    op: str
    method: str
    path: str
    fault: str
    range: str = ""  # its Range header, if any (what a resumed GET asked for)


def classify(method: str, target: str, headers: Mapping[str, str]) -> str:
    """The op of a path-style S3 request; headers have lower-case names."""
    path, _, query = target.partition("?")
    params = {k for k, _ in parse_qsl(query, keep_blank_values=True)}
    if "uploadId" in params or "uploads" in params:
        return "multipart"
    bucket_key = path.lstrip("/").split("/", 1)
    has_key = len(bucket_key) == 2 and bucket_key[1] != ""
    method = method.upper()
    if method == "GET":
        return "get" if has_key and "list-type" not in params else "list"
    if method == "HEAD":
        return "head"
    if method == "PUT" and has_key:
        return "copy" if "x-amz-copy-source" in headers else "put"
    if method == "DELETE" or (method == "POST" and "delete" in params):
        return "delete"
    return "other"


class _ProtocolError(Exception):
    """Malformed or prematurely ended HTTP message."""


class _Cut(Exception):
    """Raised by a `_Cutter` once its byte budget is spent."""


class _Body(NamedTuple):
    kind: Literal["none", "length", "chunked", "eof"]
    length: int = 0


@dataclass
class _Active:
    rule: Rule
    remaining: int | None


def _parse_head(raw: bytes) -> tuple[list[str], dict[str, str]]:
    """Start-line fields and headers (lower-case names, repeats joined by ", ")."""
    lines = raw.decode("latin-1").split("\r\n")
    start = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _ProtocolError(f"bad header line {line!r}")
        name = name.strip().lower()
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return start, headers


def _message_body(headers: Mapping[str, str]) -> _Body:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _Body("chunked")
    length = int(headers.get("content-length", "0") or 0)
    return _Body("length", length) if length > 0 else _Body("none")


def _response_body(method: str, status: int, headers: Mapping[str, str]) -> _Body:
    if method == "HEAD" or status < 200 or status in (204, 304):
        return _Body("none")
    if "chunked" not in headers.get("transfer-encoding", "").lower() and (
        "content-length" not in headers
    ):
        return _Body("eof")
    return _message_body(headers)


def _wants_close(version: str, headers: Mapping[str, str]) -> bool:
    tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
    return "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)


def _error_response(fault: str, method: str, target: str, request_id: str, keep: bool) -> bytes:
    status, code, message = _ERRORS[fault]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{escape(target.partition('?')[0])}</Resource>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


class _Reader:
    """Buffered reads from a trio stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> bool:
        if len(self.buf) > _MAX_HEAD:
            raise _ProtocolError("header or chunk line too long")
        data = await self.stream.receive_some(_CHUNK)
        self.buf += data
        return bool(data)

    async def head(self) -> bytes | None:
        """A message head through its blank line; None on EOF before any byte."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if not await self._fill():
                if self.buf:
                    raise _ProtocolError("EOF inside a message head")
                return None
        raw = bytes(self.buf[: end + 4])
        del self.buf[: end + 4]
        return raw

    async def line(self) -> bytes:
        """One line, LF included."""
        while (end := self.buf.find(b"\n")) < 0:
            if not await self._fill():
                raise _ProtocolError("EOF inside chunked framing")
        raw = bytes(self.buf[: end + 1])
        del self.buf[: end + 1]
        return raw

    async def some(self, limit: int) -> bytes:
        """Up to `limit` bytes; b"" on EOF."""
        if not self.buf:
            return await self.stream.receive_some(min(limit, _CHUNK))
        raw = bytes(self.buf[:limit])
        del self.buf[:limit]
        return raw


Send = Callable[[bytes], Awaitable[None]]


async def _discard(_: bytes) -> None:
    """A sink that drops what it is given."""


class _Cutter:
    """A sink that passes on `limit` bytes, then raises `_Cut`.

    With limit None the budget is half of the first piece.
    """

    def __init__(self, send: Send, limit: int | None) -> None:
        self.send = send
        self.left = limit

    async def __call__(self, data: bytes) -> None:
        if self.left is None:
            self.left = len(data) // 2
        if len(data) >= self.left:
            if self.left:
                await self.send(data[: self.left])
            raise _Cut
        self.left -= len(data)
        await self.send(data)


async def _relay_exact(src: _Reader, length: int, send: Send) -> None:
    while length:
        data = await src.some(length)
        if not data:
            raise _ProtocolError("EOF inside a message body")
        length -= len(data)
        await send(data)


async def _relay(src: _Reader, body: _Body, send: Send) -> None:
    """Copy one message body from `src` to `send`, framing bytes included."""
    if body.kind == "length":
        await _relay_exact(src, body.length, send)
    elif body.kind == "chunked":
        while True:
            line = await src.line()
            await send(line)
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                break
            await _relay_exact(src, size + 2, send)
        while True:  # trailers, then the final blank line
            line = await src.line()
            await send(line)
            if not line.strip():
                return
    elif body.kind == "eof":
        while data := await src.some(_CHUNK):
            await send(data)


def _is_expected(exc: BaseException) -> bool:
    """Whether `exc` (or every leaf of a group) is an ordinary connection end."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_expected(e) for e in exc.exceptions)
    return isinstance(
        exc, trio.BrokenResourceError | trio.ClosedResourceError | _ProtocolError | OSError
    )


class _Conn:
    """One client connection and the upstream connection paired with it."""

    def __init__(self, client: trio.SocketStream) -> None:
        self.client = client
        self.creader = _Reader(client)
        self.up: trio.SocketStream | None = None
        self.ureader: _Reader | None = None
        self.reset = False  # close the client with an RST

    async def upstream(self, host: str, port: int) -> tuple[trio.SocketStream, _Reader]:
        """The paired upstream connection, (re)opened when absent or stale."""
        if self.up is not None and self.ureader is not None:
            poller = select.poll()
            poller.register(self.up.socket.fileno(), select.POLLIN)
            if poller.poll(0) or self.ureader.buf:  # closed by the server, or junk
                await self.drop_upstream()
        if self.up is None or self.ureader is None:
            self.up = await trio.open_tcp_stream(host, port)
            self.ureader = _Reader(self.up)
        return self.up, self.ureader

    async def drop_upstream(self) -> None:
        up, self.up, self.ureader = self.up, None, None
        if up is not None:
            await up.aclose()

    async def aclose(self) -> None:
        """Close both sides; the client gets an RST (SO_LINGER 0) if `reset` is set."""
        if self.reset:
            linger = struct.pack("ii", 1, 0)
            self.client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        await self.client.aclose()
        await self.drop_upstream()


class FaultProxy:
    """An HTTP/1.1 proxy to `upstream` that injects faults chosen by rules.

    Thread-safe control (`set_rules`, `clear`, `blackhole_all`, `stats`) from
    any thread while the proxy serves on its own trio thread.
    """

    def __init__(self, upstream: str, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = upstream
        self._up_host = parts.hostname
        self._up_port = parts.port or 80
        self.port = 0
        self.log: list[LogEntry] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[_Active] = []
        self._stats: Counter[tuple[str, str]] = Counter()
        self._inflight: Counter[str] = Counter()  # requests of each op being answered now
        self._peak: Counter[str] = Counter()  # the most of each op answered at once
        self._generation = 0  # bumped on every rule change: releases held blackholes
        self._partitioned = False
        self._request_ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._failure: BaseException | None = None

    # -- control (any thread) -------------------------------------------------

    @property
    def endpoint(self) -> str:
        if not self.port:
            raise RuntimeError("proxy not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Bind a free 127.0.0.1 port and serve from a background thread."""
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        ready = threading.Event()

        def run() -> None:
            try:
                trio.run(self._main, ready)
            except BaseException as exc:  # raised again by stop()
                self._failure = exc
                ready.set()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10) or self._failure is not None:
            self.stop()
            raise RuntimeError("fault proxy did not start in 10 s")
        return self

    def stop(self) -> None:
        """Stop serving and drop every connection; raise if the loop had failed."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._token is not None and self._cancel is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._cancel.cancel)
        thread.join(10)
        self.port = 0
        failure, self._failure = self._failure, None
        if failure is not None:
            raise RuntimeError("fault proxy loop failed") from failure

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_rules(self, rules: Iterable[Rule]) -> None:
        """Replace the rules (first match wins); held blackholes are released."""
        with self._lock:
            self._rules = [_Active(r, r.count) for r in rules]
            self._generation += 1

    def clear(self) -> None:
        """No rules and no partition: pass everything through."""
        with self._lock:
            self._rules = []
            self._partitioned = False
            self._generation += 1

    def blackhole_all(self, on: bool = True) -> None:
        """Partition mode: every request is held unanswered and bytes in flight stall.

        New connections are still accepted by the kernel but never answered.
        Turning it off (or `clear`) closes held connections and resumes stalled ones.
        """
        with self._lock:
            self._partitioned = on
            self._generation += 1

    def stats(self) -> Counter[tuple[str, str]]:
        """Counts keyed (op, fault): fault "total" counts every request of that op,
        "none" those passed through; missing keys read 0."""
        with self._lock:
            return Counter(self._stats)

    def peak_inflight(self, op: str) -> int:
        """The most requests of `op` in flight at once (received, not yet answered
        in full) since the start or the last `reset_stats`: how parallel a client is,
        read from request timing rather than from a wall clock."""
        with self._lock:
            return self._peak[op]

    def reset_stats(self) -> None:
        """Zero the counters (peaks included) and empty the log."""
        with self._lock:
            self._stats.clear()
            self._peak = Counter(self._inflight)
            self.log.clear()

    # -- serving (trio thread) ------------------------------------------------

    async def _main(self, ready: threading.Event) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            ready.set()
            await trio.serve_listeners(self._serve_conn, listeners, handler_nursery=nursery)

    def _decide(
        self, op: str, method: str, target: str, headers: Mapping[str, str]
    ) -> tuple[str | None, float, int]:
        """(fault or None, delay, generation) for one request; counts it."""
        with self._lock:
            fault: str | None = None
            delay = 0.0
            for active in [] if self._partitioned else self._rules:
                rule = active.rule
                if rule.ops is not None and op not in rule.ops:
                    continue
                if rule.path is not None and not re.search(rule.path, target):
                    continue
                if rule.header is not None and rule.header not in headers:
                    continue
                if active.remaining == 0:
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                if active.remaining is not None:
                    active.remaining -= 1
                fault, delay = rule.fault, rule.delay
                break
            if self._partitioned:
                fault = "blackhole"
            name = fault or "none"
            self._stats[(op, "total")] += 1
            self._stats[(op, name)] += 1
            self.log.append(LogEntry(op, method, target, name, headers.get("range", "")))
            return fault, delay, self._generation

    async def _send(self, stream: trio.SocketStream, data: bytes) -> None:
        """send_all, stalled while partitioned."""
        while self._partitioned:
            await trio.sleep(_POLL)
        await stream.send_all(data)

    async def _serve_conn(self, client: trio.SocketStream) -> None:
        conn = _Conn(client)
        try:
            while await self._exchange(conn):
                pass
        except Exception as exc:
            if _is_expected(exc):
                _logger.debug("fault proxy: connection ended: %r", exc)
            else:
                _logger.warning("fault proxy: connection handler failed", exc_info=True)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def _exchange(self, conn: _Conn) -> bool:
        """Serve one request; whether the client connection stays open."""
        head = await conn.creader.head()
        if head is None:
            return False
        start, headers = _parse_head(head)
        if len(start) != 3:
            raise _ProtocolError(f"bad request line {start!r}")
        method, target, version = start
        op = classify(method, target, headers)
        fault, delay, generation = self._decide(op, method, target, headers)
        with self._lock:
            self._inflight[op] += 1
            self._peak[op] = max(self._peak[op], self._inflight[op])
        try:
            return await self._answer(conn, head, method, target, version, headers, fault, delay,
                                      generation)
        finally:
            with self._lock:
                self._inflight[op] -= 1

    async def _answer(
        self, conn: _Conn, head: bytes, method: str, target: str, version: str,
        headers: Mapping[str, str], fault: str | None, delay: float, generation: int,
    ) -> bool:
        """Serve one decided request; whether the client connection stays open."""
        body = _message_body(headers)
        close = _wants_close(version, headers)
        if fault == "blackhole":
            await self._hold(conn, generation)
            return False
        if fault in _ERRORS:
            return await self._answer_error(conn, fault, method, target, headers, body, close)
        if fault == "latency":
            await trio.sleep(delay)
        return await self._forward(conn, head, method, body, fault) and not close

    async def _hold(self, conn: _Conn, generation: int) -> None:
        """Read and drop client bytes until it hangs up or the rules change."""
        while self._generation == generation:
            with trio.move_on_after(_POLL):
                if not await conn.creader.some(_CHUNK):
                    return

    async def _answer_error(
        self,
        conn: _Conn,
        fault: str,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: _Body,
        close: bool,
    ) -> bool:
        """Answer an S3 error without asking upstream.

        A body announced with `Expect: 100-continue` is never invited: answer at
        once and close. Any other body is drained first to keep the connection.
        """
        keep = not close and (
            body.kind == "none" or headers.get("expect", "").lower() != "100-continue"
        )
        if keep:
            await _relay(conn.creader, body, _discard)
        request_id = f"FAULTPROXY{next(self._request_ids):08d}"
        await self._send(conn.client, _error_response(fault, method, target, request_id, keep))
        if not keep:
            await conn.client.send_eof()
            with trio.move_on_after(_LINGER):
                while await conn.creader.some(_CHUNK):
                    pass
        return keep

    async def _forward(
        self, conn: _Conn, head: bytes, method: str, body: _Body, fault: str | None
    ) -> bool:
        """Relay one exchange with upstream; whether both connections stay usable."""
        up, ureader = await conn.upstream(self._up_host, self._up_port)
        await self._send(up, head)
        body_sent = trio.Event()

        async def request_body() -> None:
            try:
                await _relay(conn.creader, body, lambda data: self._send(up, data))
            except trio.BrokenResourceError:
                return  # upstream answered early and stopped reading
            body_sent.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request_body)
            keep = await self._relay_response(conn, ureader, method, fault)
            with trio.move_on_after(_BODY_GRACE):
                await body_sent.wait()
            nursery.cancel_scope.cancel()
        if not body_sent.is_set():
            await conn.drop_upstream()
            return False
        return keep

    async def _relay_response(
        self, conn: _Conn, ureader: _Reader, method: str, fault: str | None
    ) -> bool:
        """Relay interim and final response; apply reset/truncate to the final one."""
        while True:
            rhead = await ureader.head()
            if rhead is None:
                raise _ProtocolError("upstream closed without answering")
            start, rheaders = _parse_head(rhead)
            status = int(start[1])
            if not 100 <= status < 200 or status == 101:
                break
            await self._send(conn.client, rhead)  # 100 Continue and friends
        body = _response_body(method, status, rheaders)
        if fault in ("reset", "truncate"):
            await self._cut_response(conn, ureader, rhead, body)
            conn.reset = fault == "reset"
            return False
        await self._send(conn.client, rhead)
        await _relay(ureader, body, lambda data: self._send(conn.client, data))
        if body.kind == "eof" or _wants_close(start[0], rheaders):
            await conn.drop_upstream()
            return False
        return True

    async def _cut_response(self, conn: _Conn, ureader: _Reader, rhead: bytes, body: _Body) -> None:
        """Send the head and half the body; with no body, half the status line.

        A cut status line is the only cut a client can detect on a bodyless
        answer: a head ended by EOF parses as complete.
        """
        if body.kind == "none":
            status_line = rhead[: rhead.index(b"\r\n")]
            await self._send(conn.client, status_line[: len(status_line) // 2])
        else:
            await self._send(conn.client, rhead)
            limit = body.length // 2 if body.kind == "length" else None
            send = _Cutter(lambda data: self._send(conn.client, data), limit)
            with contextlib.suppress(_Cut):
                await _relay(ureader, body, send)
        await conn.drop_upstream()
