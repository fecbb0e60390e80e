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

from tierfs.config import ConfigError, MountConfig, parse_size
from tierfs.control import ControlError, find_socket, request

EXIT_USAGE = 2
START_TIMEOUT = 30.0  # how long `tierfs mount` waits for the daemon to report


class CliError(Exception):
    """A user-facing failure: printed as one line, exit 1."""


def die(msg: str, code: int = 1) -> int:
    print(f"tierfs: error: {msg}", file=sys.stderr)
    return code


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # boto's own logging would print request details at debug level.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# -- mount ---------------------------------------------------------------------


def build_mount_config(args: argparse.Namespace) -> MountConfig:
    return MountConfig(
        source=args.source,
        mountpoint=Path(os.path.abspath(args.mountpoint)),
        cache_dir=Path(os.path.abspath(args.cache_dir)) if args.cache_dir else None,
        cache_size=parse_size(args.cache_size) if args.cache_size else None,
        endpoint_url=args.endpoint_url,
        foreground=args.foreground,
        allow_other=args.allow_other,
        log_level=args.log_level,
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
        for w in warnings:
            report(f"WARN {w}")
        report("OK")
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
    argv = [sys.executable, "-m", "tierfs", "mount", args.source, str(cfg.mountpoint),
            "--foreground", "--ready-fd", str(w), "--log-level", cfg.log_level]
    if args.cache_dir:
        argv += ["--cache-dir", str(cfg.cache_dir)]
    if args.cache_size:
        argv += ["--cache-size", args.cache_size]
    if args.endpoint_url:
        argv += ["--endpoint-url", args.endpoint_url]
    if args.allow_other:
        argv.append("--allow-other")
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
        reply = request(sock, "unmount", timeout=None if not args.no_flush else 30.0,
                        flush=not args.no_flush)
        pid = int(reply["pid"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if mounted_fs(mp) is None:
            return 0
    except ControlError:
        pass
    if mounted_fs(mp) is None:
        return die(f"{mp} is not mounted")
    if fusermount_unmount(mp) or fusermount_unmount(mp, lazy=True):
        return 0
    return die(f"could not unmount {mp}")


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
    from rich.console import Console
    from rich.table import Table

    m = st.get("metrics", {})
    table = Table(title=f"tierfs {st['mountpoint']}", show_header=False)
    table.add_row("source", st["source"])
    table.add_row("state", "DEGRADED (store unreachable)" if st["degraded"] else "ok")
    cache = st["cache"]
    table.add_row("tier 1", f"{cache['used_bytes'] / 2**20:.1f} MiB of "
                  f"{cache['capacity_bytes'] / 2**30:.1f} GiB, {cache['objects']} objects")
    for tier in ("cache", "store"):
        table.add_row(f"read from {tier}", f"{m.get(f'tierfs_read_bytes_total{{tier={tier}}}', 0) / 2**20:.1f} MiB")
    Console().print(table)


# -- entry point ---------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("mount", help="mount SOURCE (s3://bucket[/prefix] or file:///path) at MOUNTPOINT")
    m.add_argument("source")
    m.add_argument("mountpoint")
    m.add_argument("--cache-dir")
    m.add_argument("--cache-size", help="tier-1 limit, e.g. 50G (default: 80%% of free space)")
    m.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached; unmount on SIGINT/SIGTERM")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    m.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m.add_argument("--log-file", help="daemon log in background mode (default: tierfs.log in the cache dir)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and stop the daemon")
    u.add_argument("mountpoint")
    u.add_argument("--no-flush", action="store_true", help="do not wait for pending uploads")
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("status", help="show a mount's state and counters")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, ConfigError, ControlError) as exc:
        return die(str(exc))
    except KeyboardInterrupt:
        return die("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
