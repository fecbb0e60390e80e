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
import time
from pathlib import Path
from typing import Any

from tierfs.config import ConfigError, MountConfig, build_config, load_config_file, parse_size
from tierfs.control import ControlError, ControlUnreachable, find_socket, request

EXIT_USAGE = 2
START_TIMEOUT = 30.0  # how long `tierfs mount` waits for the daemon to report


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
        foreground=args.foreground,
        allow_other=args.allow_other or None,
        allow_unsafe_manifests=args.allow_unsafe_manifests or None,
        log_level=args.log_level,
        metrics_addr=args.metrics_addr,
        metrics_allow_remote=args.metrics_allow_remote or None,
    )


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = build_mount_config(args)
    if not cfg.foreground:
        return spawn_daemon(args, cfg)
    from tierfs.daemon import Daemon, MountError

    setup_logging(cfg.log_level)
    ready_fd: int | None = args.ready_fd

    def report(line: str) -> None:
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (line + "\n").encode())

    daemon = Daemon(cfg)
    try:
        daemon.prepare()
    except MountError as exc:
        report(f"ERR {exc}")
        return die(str(exc))
    if ready_fd is not None:
        # Detached daemon: from here on its log lives next to its cache.
        log_path = args.log_file or str(cfg.resolved_cache_dir() / "tierfs.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def on_ready(warnings: list[str]) -> None:
        nonlocal ready_fd
        from tierfs.sdnotify import notify

        for w in warnings:
            report(f"WARN {w}")
        report("OK")
        # systemd Type=notify: the mount answers a stat by now (Daemon._wait_ready)
        notify("READY=1", f"STATUS=serving {cfg.source} at {cfg.mountpoint}",
               f"MAINPID={os.getpid()}")
        if ready_fd is not None:
            os.close(ready_fd)
            ready_fd = None

    try:
        daemon.run(on_ready)
    except MountError as exc:
        report(f"ERR {exc}")
        return die(str(exc))
    except RuntimeError as exc:  # pyfuse3.init failures (e.g. fuse device missing)
        report(f"ERR cannot mount: {exc}")
        return die(f"cannot mount: {exc}")
    return 0


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
    if args.allow_other:
        argv.append("--allow-other")
    if args.allow_unsafe_manifests:
        argv.append("--allow-unsafe-manifests")
    if args.log_file:
        argv += ["--log-file", os.path.abspath(args.log_file)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, pass_fds=(w,), start_new_session=True)
    os.close(w)
    buf = b""
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                from tierfs.daemon import fusermount_unmount

                fusermount_unmount(cfg.mountpoint, lazy=True)
                return die(f"daemon did not become ready within {START_TIMEOUT:.0f}s")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 4096)
            if not chunk:
                code = proc.wait(timeout=10)
                return die(f"daemon exited during start-up (status {code})")
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
    from tierfs.daemon import fusermount_unmount, mounted_fs

    mp = Path(os.path.abspath(args.mountpoint))
    try:
        sock = find_socket(mp)
    except ControlError:
        sock = None  # no live daemon: a stale or foreign mount, cleaned below
    if sock is not None:
        try:
            if args.no_flush:
                reply = request(sock, "unmount", timeout=30.0, flush=False)
            else:
                reply = with_upload_progress(sock, "", "unmount", flush=True)
        except ControlUnreachable as exc:
            print(f"tierfs: warning: {exc}; unmounting without a flush", file=sys.stderr)
        except ControlError as exc:
            return die(f"unmount of {mp} failed: {exc} (pending uploads stay journaled; "
                       "--no-flush unmounts without waiting)")
        else:
            pid = int(reply["pid"])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if mounted_fs(mp) is None:
                return 0
    if mounted_fs(mp) is None:
        return die(f"{mp} is not mounted")
    if fusermount_unmount(mp) or fusermount_unmount(mp, lazy=True):
        return 0
    return die(f"could not unmount {mp}")


def cmd_flush(args: argparse.Namespace) -> int:
    mp = Path(os.path.abspath(args.mountpoint))
    prefix = ""
    if args.path:
        rel = os.path.relpath(os.path.abspath(args.path), mp)
        if rel.startswith(".."):
            raise CliError(f"{args.path} is not under the mount {mp}")
        prefix = "" if rel == "." else rel.rstrip("/")
    with_upload_progress(find_socket(mp), prefix, "flush", prefix=prefix)
    return 0


def with_upload_progress(sock: str, watch: str, op: str, **kw: Any) -> dict[str, Any]:
    """Run a control request that waits for uploads; draw a progress bar meanwhile
    when stderr is a terminal."""
    import threading

    result: dict[str, Any] = {}
    failure: list[BaseException] = []

    def call() -> None:
        try:
            result.update(request(sock, op, timeout=None, **kw))
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    if sys.stderr.isatty():
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress("uploading", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task("upload", total=None)
            while worker.is_alive():
                with contextlib.suppress(ControlError):
                    p = request(sock, "pending", timeout=5.0, prefix=watch)["pending"]
                    bar.update(task, total=p["bytes"] or None, completed=p["uploaded_bytes"])
                worker.join(0.25)
    worker.join()
    if failure:
        raise failure[0]
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("mount", help="mount SOURCE (s3://bucket[/prefix] or file:///path) at MOUNTPOINT")
    m.add_argument("source", nargs="?", help="may come from --config instead")
    m.add_argument("mountpoint", nargs="?", help="may come from --config instead")
    m.add_argument("--config", "-c", metavar="FILE", help="TOML config; flags override it")
    m.add_argument("--cache-dir")
    m.add_argument("--cache-size", help="tier-1 limit, e.g. 50G (default: 80%% of free space)")
    m.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached; unmount on SIGINT/SIGTERM")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
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
    u.set_defaults(func=cmd_umount)

    f = sub.add_parser("flush", help="wait until everything pending (under PATH) is in the store")
    f.add_argument("mountpoint")
    f.add_argument("path", nargs="?", help="a directory or file inside the mount")
    f.set_defaults(func=cmd_flush)

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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "umount":
            _umount_target(args)
        return int(args.func(args))
    except (CliError, ConfigError, ControlError) as exc:
        return die(str(exc))
    except KeyboardInterrupt:
        return die("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
