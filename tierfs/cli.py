"""Command line only: parse, call, print. Every failure is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tierfs.config import (
    FLUSH_STALL,
    ConfigError,
    ConfigFileErrors,
    MountConfig,
    build_config,
    default_cache_root,
    load_config_file,
    parse_size,
)
from tierfs.control import ControlError, ControlUnreachable, find_socket, request

log = logging.getLogger("tierfs.cli")

DESCRIPTION = """\
Mount object storage (s3://bucket[/prefix] or file:///path) as a POSIX
filesystem with the node's local disk as a block cache, and operate the
mounts: status, flush, warmup, cache, policy, config check.
"""

EXIT_USAGE = 2
START_TIMEOUT = 30.0  # how long `tierfs mount` waits for the daemon to report
PROGRESS_LINE_EVERY = 3.0  # seconds between "waiting for" lines when not on a terminal


class CliError(Exception):
    """A user-facing failure: printed as one line, exit 1."""


def die(msg: str, code: int = 1) -> int:
    print(f"tierfs: error: {msg}", file=sys.stderr)
    return code


class LogfmtFormatter(logging.Formatter):
    """One line per record, logfmt: `ts=... level=info logger=tierfs.daemon msg="..."`.

    Under journald (JOURNAL_STREAM set) the timestamp is left to the journal.
    Tracebacks are folded into the line (exc="..."), never spread over many."""

    def __init__(self) -> None:
        super().__init__()
        self.stamp = "JOURNAL_STREAM" not in os.environ

    @staticmethod
    def _quote(v: str) -> str:
        if v and all(c.isalnum() or c in "-_./:@" for c in v):
            return v
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        if self.stamp:
            t = time.gmtime(record.created)
            parts.append(f"ts={time.strftime('%Y-%m-%dT%H:%M:%S', t)}.{int(record.msecs):03d}Z")
        parts += [f"level={record.levelname.lower()}", f"logger={record.name}",
                  f"msg={self._quote(record.getMessage())}"]
        if record.exc_info:
            parts.append(f"exc={self._quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # boto's own logging would print request details at debug level.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# -- mount ---------------------------------------------------------------------


def build_mount_config(args: argparse.Namespace) -> MountConfig:
    """Defaults (config.py) <- --config FILE <- command-line flags."""
    file = load_config_file(args.config) if args.config else None
    return build_config(
        file,
        args.source,
        args.mountpoint,
        cache_dir=Path(os.path.abspath(args.cache_dir)) if args.cache_dir else None,
        cache_size=parse_size(args.cache_size) if args.cache_size else None,
        endpoint_url=args.endpoint_url,
        shared_cache=args.shared_cache,
        shared_endpoint_url=args.shared_endpoint_url,
        foreground=args.foreground,
        allow_other=args.allow_other or None,
        uid=args.uid, gid=args.gid, file_mode=args.file_mode, dir_mode=args.dir_mode,
        nonempty=args.nonempty or None,
        allow_unsafe_manifests=args.allow_unsafe_manifests or None,
        log_level=args.log_level,
        metrics_addr=args.metrics_addr,
        metrics_allow_remote=args.metrics_allow_remote or None,
        passthrough=False if args.no_passthrough else None,
    )


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = build_mount_config(args)
    if not cfg.foreground:
        return spawn_daemon(args, cfg)
    ready_fd: int | None = args.ready_fd
    log_path = args.log_file or str(cfg.resolved_cache_dir() / "tierfs.log")
    if ready_fd is not None:
        # Detached daemon: it logs next to its cache from the start, so that a
        # failure to start is in the log too, not only in one line to the caller.
        _log_to(log_path)
    setup_logging(cfg.log_level)
    from tierfs.daemon import Daemon, MountError

    def report(line: str) -> None:
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (line + "\n").encode())

    def failed(msg: str) -> int:
        log.error("cannot mount %s at %s: %s", cfg.source, cfg.mountpoint, msg)
        report(f"ERR {msg}")
        return die(msg)

    daemon = Daemon(cfg)
    try:
        daemon.prepare()
    except MountError as exc:
        return failed(str(exc))
    except Exception as exc:
        log.exception("start-up failed")
        return failed(f"internal error during start-up: {exc} (see {log_path})")

    def on_ready(warnings: list[str]) -> None:
        nonlocal ready_fd
        from tierfs.sdnotify import notify

        for w in warnings:
            report(f"WARN {w}")
        report("OK")
        # systemd Type=notify: the mount answers a stat by now (mount.py: fuse.session.wait_ready)
        notify("READY=1", f"STATUS=serving {cfg.source} at {cfg.mountpoint}",
               f"MAINPID={os.getpid()}")
        if ready_fd is not None:
            os.close(ready_fd)
            ready_fd = None

    try:
        daemon.run(on_ready)
    except MountError as exc:
        return failed(str(exc))
    except RuntimeError as exc:  # pyfuse3.init failures (e.g. fuse device missing)
        return failed(f"cannot mount: {exc}")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        log.exception("tierfs stopped by an internal error")
        return failed(f"internal error: {exc} (see {log_path})")
    return 0


def _log_to(path: str) -> None:
    """Send stdout and stderr to the log file (its directory made 0700 if new);
    left as they are if it cannot be opened (the caller then reads them)."""
    try:
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def spawn_daemon(args: argparse.Namespace, cfg: MountConfig) -> int:
    """Start `mount --foreground` detached; return once it reports ready or failed."""
    r, w = os.pipe()
    argv = [sys.executable, "-m", "tierfs", "mount", cfg.source, str(cfg.mountpoint),
            "--foreground", "--ready-fd", str(w), "--log-level", cfg.log_level]
    if args.config:
        argv += ["--config", os.path.abspath(args.config)]
    if args.metrics_addr:
        argv += ["--metrics-addr", args.metrics_addr]
    if args.metrics_allow_remote:
        argv.append("--metrics-allow-remote")
    if args.cache_dir:
        argv += ["--cache-dir", str(cfg.cache_dir)]
    if args.cache_size:
        argv += ["--cache-size", args.cache_size]
    if args.endpoint_url:
        argv += ["--endpoint-url", args.endpoint_url]
    for flag, text in (("--shared-cache", args.shared_cache),
                       ("--shared-endpoint-url", args.shared_endpoint_url)):
        if text:
            argv += [flag, text]
    if args.allow_other:
        argv.append("--allow-other")
    for flag, value in (("--uid", args.uid), ("--gid", args.gid)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, value in (("--file-mode", args.file_mode), ("--dir-mode", args.dir_mode)):
        if value is not None:
            argv += [flag, f"{value:o}"]
    if args.nonempty:
        argv.append("--nonempty")
    if args.no_passthrough:
        argv.append("--no-passthrough")
    if args.allow_unsafe_manifests:
        argv.append("--allow-unsafe-manifests")
    if args.log_file:
        argv += ["--log-file", os.path.abspath(args.log_file)]
    # Until it has its log open, the daemon's stderr comes here: a failure before
    # that (say, an import error) is shown instead of a bare exit status.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=errors, pass_fds=(w,), start_new_session=True)
        os.close(w)
        return _await_ready(proc, r, errors, args, cfg)


def _await_ready(proc: subprocess.Popen[bytes], r: int, errors: Any,
                 args: argparse.Namespace, cfg: MountConfig) -> int:
    """Relay the starting daemon's report lines; 0 once it says OK."""
    buf = b""
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                from tierfs.fuse.fusermount import fusermount_unmount

                fusermount_unmount(cfg.mountpoint, lazy=True)
                return die(f"daemon did not become ready within {START_TIMEOUT:.0f}s")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 4096)
            if not chunk:
                code = proc.wait(timeout=10)
                errors.seek(0)
                lines = [ln for ln in errors.read().decode(errors="replace").splitlines() if ln.strip()]
                why = f": {lines[-1].strip()}" if lines else ""
                log_path = args.log_file or str(cfg.resolved_cache_dir() / "tierfs.log")
                return die(f"daemon exited during start-up (status {code}){why}; see {log_path}")
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text == "OK":
                    return 0
                if text.startswith("WARN "):
                    print(f"tierfs: warning: {text[5:]}", file=sys.stderr)
                elif text.startswith("ERR "):
                    proc.wait(timeout=10)
                    return die(text[4:])
    finally:
        os.close(r)


# -- umount / status -----------------------------------------------------------


def cmd_umount(args: argparse.Namespace) -> int:
    from tierfs.fuse.fusermount import fusermount_unmount, is_stale, mounted_fs

    mp = Path(os.path.abspath(args.mountpoint))
    busy = (f"{mp} is busy: a process has a file or its working directory in it; close "
            "them, or pass --lazy to detach it now and finish once it is no longer used")
    try:
        sock = find_socket(mp)
    except ControlError:
        sock = None  # no live daemon: a stale or foreign mount, cleaned below
    if sock is not None:
        try:
            if args.no_flush:
                reply = request(sock, "unmount", timeout=30.0, flush=False, lazy=args.lazy)
            else:
                reply = wait_for_uploads(sock, "unmount", args.timeout, flush=True,
                                         lazy=args.lazy)
        except ControlUnreachable as exc:
            print(f"tierfs: warning: {exc}; unmounting without a flush", file=sys.stderr)
        except ControlError as exc:
            return die(f"unmount of {mp} failed: {exc} (pending uploads stay journaled; "
                       "--no-flush unmounts without waiting)")
        else:
            if reply.get("busy"):
                return die(busy)
            if not reply.get("stopped", True):
                report_flush(reply["flush"], mp)
                return die(f"{mp} stays mounted: not everything is uploaded. --no-flush "
                           "unmounts anyway (pending uploads stay journaled and resume at "
                           "the next mount; refused ones stay in quarantine)")
            _wait_exit(int(reply["pid"]), timeout=60.0)
            if mounted_fs(mp) is None:
                return 0
    if mounted_fs(mp) is None:
        return die(f"{mp} is not mounted")
    # A dead daemon's mount serves nobody: detaching it can only help.
    res = fusermount_unmount(mp, lazy=args.lazy or is_stale(mp))
    if res.ok:
        return 0
    return die(busy if res.busy else f"could not unmount {mp}: {res.reason}")


def flush_prefix(mountpoint: Path, path: str) -> str:
    """A path inside a mount as the daemon names it: relative to the mount root.
    Absolute paths must be under the mount; relative ones are taken from its root
    (like `tierfs policy`), or from the current directory when that is inside it."""
    if os.path.isabs(path) or Path.cwd().is_relative_to(mountpoint):
        rel = os.path.relpath(os.path.abspath(path), mountpoint)
        if rel == ".." or rel.startswith("../"):
            raise CliError(f"{path} is not under the mount {mountpoint}")
    else:
        rel = os.path.normpath(path)
        if rel == ".." or rel.startswith("../"):
            raise CliError(f"{path} is not under the mount {mountpoint}")
    return "" if rel == "." else rel.rstrip("/")


def cmd_flush(args: argparse.Namespace) -> int:
    mp = Path(os.path.abspath(args.mountpoint))
    reply = wait_for_uploads(find_socket(mp), "flush", args.timeout,
                             prefix=flush_prefix(mp, args.path) if args.path else "")
    return 0 if report_flush(reply["flush"], mp) else 1


def report_flush(outcome: dict[str, Any], mp: Path) -> bool:
    """Say what a flush could not do; whether it succeeded."""
    for f in outcome.get("failed", []):
        print(f"tierfs: not uploaded: {f['key']}: {f['reason']} (kept in quarantine: "
              f"tierfs pending retry|discard {mp} {f['key']})", file=sys.stderr)
    for key in outcome.get("still_open", []):
        print(f"tierfs: warning: still open for writing, not flushed: {key}", file=sys.stderr)
    if outcome.get("gave_up"):
        waiting = outcome.get("waiting", [])
        print(f"tierfs: gave up: nothing uploaded for a while; still waiting for "
              f"{_waiting_text(waiting)}", file=sys.stderr)
    return bool(outcome.get("ok"))


def _waiting_text(waiting: list[dict[str, Any]], most: int = 5) -> str:
    def one(w: dict[str, Any]) -> str:
        why = f", {w['error']}" if w.get("error") else ""
        return f"{w['key']} ({human_bytes(w['uploaded'])} of {human_bytes(w['size'])} sent{why})"

    names = ", ".join(one(w) for w in waiting[:most])
    more = f" and {len(waiting) - most} more" if len(waiting) > most else ""
    return f"{len(waiting)} upload(s): {names}{more}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def wait_for_uploads(sock: str, op: str, stall: float, **kw: Any) -> dict[str, Any]:
    """Run a control request that waits for uploads (flush, unmount), giving up once
    nothing moved for `stall` seconds; say what it waits for meanwhile: a progress
    bar on a terminal, else a line every few seconds."""
    fancy = sys.stderr.isatty()
    last = [0.0]

    def plain(p: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_LINE_EVERY and p.get("waiting"):
            last[0] = now
            print(f"tierfs: waiting for {_waiting_text(p['waiting'])}", file=sys.stderr,
                  flush=True)

    # The daemon reports at least every second while it waits.
    timeout = stall + 30.0
    if not fancy:
        return request(sock, op, timeout=timeout, on_progress=plain, stall=stall, **kw)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("uploading", total=None)

        def draw(p: dict[str, Any]) -> None:
            waiting = p.get("waiting", [])
            first = f": {waiting[0]['key']}" if waiting else ""
            bar.update(task, total=sum(w["size"] for w in waiting) or None,
                       completed=sum(w["uploaded"] for w in waiting),
                       description=f"waiting for {len(waiting)} upload(s){first}")

        return request(sock, op, timeout=timeout, on_progress=draw, stall=stall, **kw)


def cmd_pending(args: argparse.Namespace) -> int:
    mp = Path(os.path.abspath(args.mountpoint))
    sock = find_socket(mp)
    if args.action == "list":
        reply = request(sock, "pending_list",
                        prefix=flush_prefix(mp, args.paths[0]) if args.paths else "")
        reply.pop("ok", None)
        if args.json:
            print(json.dumps(reply, indent=2))
            return 0
        for f in reply["files"]:
            why = f"  ({f['error']})" if f.get("error") else ""
            print(f"{f['state']:<9} {human_bytes(f['size']):>10}  {f['key']}{why}")
        for q in reply["quarantined"]:
            print(f"{'kept':<9} {human_bytes(q['size']):>10}  {q['key']}  ({q['kind']}, {q['when']}: "
                  f"{q['reason']}; file {q['file']})")
        if not reply["files"] and not reply["quarantined"]:
            print("nothing pending or quarantined")
        return 0
    if not args.paths:
        raise CliError(f"pending {args.action} needs at least one PATH")
    reply = request(sock, f"pending_{args.action}", timeout=300.0,
                    paths=[flush_prefix(mp, p) for p in args.paths])
    for d in reply["done"]:
        print(f"{d['key']}: {d['result']}")
    for f in reply["failed"]:
        print(f"tierfs: {args.action} {f['key']}: {f['error']}", file=sys.stderr)
    return 1 if reply["failed"] else 0


def _wait_exit(pid: int, timeout: float) -> None:
    """Until process `pid` has exited (or `timeout`): the cache dir stays locked
    until then. A detached daemon is reaped by whoever adopted it, maybe late: an
    exited, unreaped process (a zombie) counts as gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cmd_status(args: argparse.Namespace) -> int:
    reply = request(find_socket(args.mountpoint), "status")
    reply.pop("ok", None)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print_status(reply)
    return 0


def print_status(st: dict[str, Any]) -> None:
    from tierfs.cli_ops import print_status as table

    table(st)


# -- entry point ---------------------------------------------------------------


def _id(text: str) -> int:
    if not text.isdigit() or int(text) >= 0xFFFF_FFFF:
        raise argparse.ArgumentTypeError(f"{text!r} is not a numeric user or group id")
    return int(text)


def _mode(text: str) -> int:
    if not text or set(text) - set("01234567") or int(text, 8) > 0o7777:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal permission mode (e.g. 640)")
    return int(text, 8)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount SOURCE (s3://bucket[/prefix] or file:///path) at MOUNTPOINT")
    m.add_argument("source", nargs="?", help="may come from --config instead")
    m.add_argument("mountpoint", nargs="?", help="may come from --config instead")
    m.add_argument("--config", "-c", metavar="FILE", help="TOML config; flags override it")
    m.add_argument("--cache-dir", metavar="DIR",
                   help=f"tier-1 cache on local disk (default: {default_cache_root()}/<id of "
                        "the source>; a remount of the same source reuses it)")
    m.add_argument("--cache-size", metavar="SIZE",
                   help="tier-1 limit, e.g. 50G (default: 80%% of the cache filesystem's free "
                        "space, less what [cache] min_free keeps free)")
    m.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    m.add_argument("--shared-cache", metavar="s3://BUCKET[/PREFIX]",
                   help="a bucket near the nodes that tier-1 misses ask before the origin, "
                        "shared by every node's mount: a herd of nodes costs the origin one "
                        "copy (default: off; more in [shared] of the config)")
    m.add_argument("--shared-endpoint-url", metavar="URL",
                   help="the shared cache's S3 endpoint (default: the standard chain's)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached; unmount on SIGINT/SIGTERM")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    m.add_argument("--uid", type=_id, help="owner of objects whose POSIX attributes are "
                   "unknown (default: the mounting user)")
    m.add_argument("--gid", type=_id, help="their group (default: the mounting user's)")
    m.add_argument("--file-mode", type=_mode, metavar="OCTAL",
                   help="their permissions as files (default: 644)")
    m.add_argument("--dir-mode", type=_mode, metavar="OCTAL",
                   help="directories' permissions (default: 755)")
    m.add_argument("--nonempty", action="store_true",
                   help="mount over a directory that has files in it (hiding them)")
    m.add_argument("--no-passthrough", action="store_true",
                   help="serve every read through the daemon, never by FUSE passthrough "
                        "(keeps the kernel's write-back cache on)")
    m.add_argument("--allow-unsafe-manifests", action="store_true",
                   help="mount even if the store ignores conditional writes (manifests then "
                        "publish with plain PUTs)")
    m.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="default: info (or logging.level of the config)")
    m.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve Prometheus metrics, e.g. 127.0.0.1:9464 (default: off)")
    m.add_argument("--metrics-allow-remote", action="store_true",
                   help="allow a non-loopback --metrics-addr (no authentication!)")
    m.add_argument("--log-file", help="daemon log in background mode (default: tierfs.log in the cache dir)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and stop the daemon")
    u.add_argument("mountpoint", nargs="?", help="or the mountpoint of --config")
    u.add_argument("--config", "-c", metavar="FILE", help="take the mountpoint from this config")
    u.add_argument("--no-flush", action="store_true", help="do not wait for pending uploads")
    u.add_argument("--timeout", type=float, default=FLUSH_STALL, metavar="SECONDS",
                   help="give up (and stay mounted) once no upload moved for this long "
                        f"(default {FLUSH_STALL:g})")
    u.add_argument("--lazy", "-l", action="store_true",
                   help="detach even while busy (files open in it): the mount goes away once "
                        "they are closed")
    u.set_defaults(func=cmd_umount)

    f = sub.add_parser("flush", help="wait until everything pending (under PATH) is in the store")
    f.add_argument("mountpoint")
    f.add_argument("path", nargs="?", help="a directory or file inside the mount: absolute, or "
                   "relative to the mount root (to the current directory when inside the mount)")
    f.add_argument("--timeout", type=float, default=FLUSH_STALL, metavar="SECONDS",
                   help=f"give up once no upload moved for this long (default {FLUSH_STALL:g})")
    f.set_defaults(func=cmd_flush)

    pe = sub.add_parser("pending", help="list, discard or retry files not yet in the store "
                                        "(pending uploads, quarantined files)")
    pe.add_argument("action", choices=["list", "discard", "retry"])
    pe.add_argument("mountpoint")
    pe.add_argument("paths", nargs="*", metavar="PATH",
                    help="files (inside the mount, or relative to its root); list: a directory")
    pe.add_argument("--json", action="store_true")
    pe.set_defaults(func=cmd_pending)

    s = sub.add_parser("status", help="show a mount's state and counters")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    from tierfs.cli_ops import add_parsers, guard
    from tierfs.coldstart.command import add_parser as add_coldstart

    add_parsers(sub, guard)
    add_coldstart(sub)
    return p


def _umount_target(args: argparse.Namespace) -> None:
    """`tierfs umount --config FILE` (systemd's ExecStop) unmounts the file's mountpoint."""
    if args.mountpoint is None:
        if not args.config:
            raise CliError("umount needs MOUNTPOINT or --config FILE")
        mp = load_config_file(args.config).values.get("mountpoint")
        if mp is None:
            raise CliError(f"{args.config} has no mountpoint")
        args.mountpoint = str(mp)


def _version() -> str:
    try:
        return version("tierfs")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "umount":
            _umount_target(args)
        return int(args.func(args))
    except ConfigFileErrors as exc:
        for e in exc.errors:
            die(str(e))
        return 1
    except (CliError, ConfigError, ControlError) as exc:
        return die(str(exc))
    except KeyboardInterrupt:
        return die("interrupted", 130)
    except BrokenPipeError:
        # `tierfs cache ls MNT | head`: the reader has what it wanted. Quiet, like
        # any tool killed by SIGPIPE (and nothing more to flush at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13


def mount_helper(argv: list[str] | None = None) -> int:
    """Entry point of the `mount.tierfs` console script."""
    from tierfs.cli_ops import OpsError, helper_argv

    try:
        args = helper_argv(list(sys.argv[1:] if argv is None else argv))
    except OpsError as exc:
        return die(str(exc), 1)
    if args is None:
        return 0
    # mount(8) expects 0 on success, 32 on a mount failure.
    return 0 if main(args) == 0 else 32


if __name__ == "__main__":
    sys.exit(main())
