"""Command line for operating mounts: status table, warmup, cache, policy,
config check, and the `mount.tierfs` helper that mount(8) runs.

Like cli.py: parse, call the daemon over its control socket, print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierfs.config import ConfigError, human_size, load_config_file
from tierfs.control import ControlError, find_socket, request

MiB = 1 << 20


class OpsError(Exception):
    """A user-facing failure: one line, exit 1."""


def human(n: float | None) -> str:
    return "-" if n is None else human_size(float(n))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.2f} ms"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


# -- finding the mount of a path ----------------------------------------------------


def mount_of(path: str | Path) -> tuple[Path, str, str]:
    """(mount root, control socket, path relative to the root) of a path inside
    a live tierfs mount: the nearest mount root above it must be a tierfs one."""
    p = Path(os.path.abspath(path))
    for cand in (p, *p.parents):
        if not os.path.ismount(cand):
            continue
        try:
            sock = find_socket(cand)
        except ControlError:
            break
        rel = os.path.relpath(p, cand)
        return cand, sock, "" if rel == "." else rel
    raise OpsError(f"{path}: not inside a live tierfs mount")


# -- status ---------------------------------------------------------------------------


def _shared_row(metrics: dict[str, Any]) -> str | None:
    """The shared tier's counters (tierfs_shared_*), where the mount has one."""
    if "tierfs_shared_hits_total" not in metrics:
        return None

    def n(what: str) -> int:
        return int(metrics.get(f"tierfs_shared_{what}_total", 0))

    return (f"{n('hits')} blocks taken, {n('misses')} missed, {n('corrupt_blocks')} corrupt; "
            f"claims won {n('claims_won')}, lost {n('claims_lost')}, expired "
            f"{n('claims_expired')}; bytes from it {human(n('bytes_from_shared'))}, from the "
            f"origin {human(n('bytes_from_origin'))}"
            + (f"; errors {n('errors')}" if n("errors") else ""))


def status_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, text) of every row of `tierfs status`, whatever prints them."""
    rows: list[tuple[str, str]] = []
    add = rows.append
    add(("source", st["source"]))
    add(("state", "DEGRADED (store unreachable)" if st["degraded"] else "ok"))
    add(("pid", str(st["pid"])))
    if st.get("config_file"):
        add(("config", st["config_file"]))
    c = st["cache"]
    cap = c["capacity_bytes"] or 0
    pct = f" ({100 * c['used_bytes'] / cap:.0f}%)" if cap else ""
    add(("tier 1", f"{human(c['used_bytes'])} of {human(cap)}{pct}, {c['objects']} objects "
         f"({c.get('open_objects', 0)} open)"))
    add(("cache dir", st["cache_dir"]))
    if "evictions" in c:
        add(("evictions", f"{c['evictions']} ({human(c['evicted_bytes'])}); "
             f"corrupt chunks dropped: {c['corrupt_chunks']}"))
    r = st.get("reads") or {}
    hit = r.get("hit_ratio")
    add(("reads", f"{human(r.get('total_bytes', 0))}: tier 1 {human(r.get('cache_bytes', 0))}, "
         f"store {human(r.get('store_bytes', 0))}; hit ratio "
         f"{'-' if hit is None else f'{100 * hit:.1f}%'}"))
    pt = st.get("passthrough")
    if pt:
        opens = pt.get("opens") or {}
        n_pt = sum((opens.get("passthrough") or {}).values())
        daemon = opens.get("daemon") or {}
        why = ", ".join(f"{k} {v}" for k, v in sorted(daemon.items()))
        add(("passthrough", f"{'on' if pt['enabled'] else 'off'} ({pt['reason']}); opens: "
             f"{n_pt} passthrough, {sum(daemon.values())} daemon" + (f" ({why})" if why else "")))
        if "splice" in pt:
            add(("splice", f"{'on' if pt['splice'] else 'off'}; {pt.get('spliced_reads', 0)} reads "
                 "answered from tier-1 files by libfuse"))
    lat = st.get("read_latency") or {}
    add(("read latency", f"p50 {_ms(lat.get('p50'))}  p95 {_ms(lat.get('p95'))}  "
         f"p99 {_ms(lat.get('p99'))}  ({lat.get('count', 0)} reads)"))
    s = st.get("store") or {}
    reqs = s.get("requests") or {}
    req_txt = ", ".join(
        f"{op} {sum(by.values())}" + (
            " (" + ", ".join(f"{k} {v}" for k, v in sorted(by.items()) if k != "ok") + ")"
            if any(k != "ok" for k in by) else "")
        for op, by in sorted(reqs.items())
    ) or "none"
    add(("store", f"fetched {human(s.get('get_bytes', 0))}, uploaded "
         f"{human(s.get('put_bytes', 0))}; requests: {req_txt}"))
    shared = _shared_row(st.get("metrics") or {})
    if shared:
        add(("shared tier", shared))
    if s.get("engine"):
        cpu = s.get("cpu_seconds") or {}
        moved = s.get("runtime_bytes") or {}
        by_runtime = (f"the runtime moved {human(moved.get('get', 0))} in, "
                      f"{human(moved.get('put', 0))} out; " if moved else "")
        add(("transfers", f"engine {s['engine']}: {by_runtime}daemon CPU "
             f"{cpu.get('python', 0.0):.1f} s in {cpu.get('python_threads', 0)} Python "
             f"threads, {cpu.get('runtime', 0.0):.1f} s in "
             f"{cpu.get('runtime_threads', 0)} runtime threads (AwsEventLoop*)"))
    p = st.get("pending") or {}
    if p.get("available"):
        hashing = p.get("checksums_pending") or 0
        add(("pending uploads", f"{p.get('count', 0)} files, {human(p.get('bytes', 0))}, "
             f"oldest {_duration(p.get('oldest_age_s')) if p.get('count') else '-'}"
             + (f"; checksums still being taken for {hashing}" if hashing else "")))
    else:
        add(("pending uploads", "0 (no write path)"))
    mem = st.get("memory") or {}
    if mem:
        add(("memory", f"{human(mem['used'])} of {human(mem['budget'])} budget in flight "
             f"(peak {human(mem['peak'])})"))
    q = st.get("quarantined") or {}
    qn = q.get("count", 0) if isinstance(q, dict) else q
    add(("quarantined", f"{qn} file(s)" + (f" in {st['cache_dir']}/quarantine" if qn else "")))
    errs = st.get("errors") or {}
    add(("errors", ", ".join(f"{k} {v}" for k, v in sorted(errs.items())) or "none"))
    if st.get("metrics_addr"):
        add(("metrics", st["metrics_addr"]))
    return rows


CLASS_COLUMNS = ("class", "attr ttl", "list ttl", "revalidate", "page cache", "write",
                 "after close", "readahead", "direct writes")


def class_rows(st: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per class, in CLASS_COLUMNS order."""

    def secs(v: Any) -> str:
        return "inf" if v == "inf" else f"{float(v):g}s"

    rows: list[tuple[str, ...]] = []
    for name, cs in (st.get("classes") or {}).items():
        is_default = name == st.get("default_class") and name != "default"
        rows.append((name + (" (default)" if is_default else ""),
                     secs(cs["attr_ttl"]), secs(cs["list_ttl"]),
                     "yes" if cs["revalidate_on_open"] else "no",
                     "keep" if cs["keep_cache"] else "drop",
                     cs["write_mode"].replace("write", ""), _after_close(cs),
                     human(cs["readahead_max"]),
                     "yes" if cs.get("direct_writes") else "no"))
    return rows


def _rules_line(st: dict[str, Any]) -> str:
    rules = st.get("rules") or []
    return ("rules (first match wins): "
            + ", ".join(f"{r['glob']} -> {r['class']}" for r in rules)) if rules else ""


def print_status(st: dict[str, Any], console: Any = None) -> None:
    """A table at the terminal's width (cells wrap, nothing is cut); into a pipe or
    a log, the same rows as `name: value` lines wrapped at 80 columns. `--json` is
    the form for scripts."""
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal:
        _print_plain(st, console.file)
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"tierfs {st['mountpoint']}", show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for name, text in status_rows(st):
        t.add_row(name, Text(text, style="red" if name == "state" and st["degraded"] else ""))
    console.print(t)
    rows = class_rows(st)
    if rows:
        from rich.measure import Measurement

        ct = Table(title="classes", title_justify="left")
        for col in CLASS_COLUMNS:
            ct.add_column(col, no_wrap=True)
        for row in rows:
            ct.add_row(*row)
        natural = Measurement.get(console, console.options.update(max_width=10_000), ct).maximum
        if natural <= console.width:
            console.print(ct)
        else:  # too narrow for the table: a block per class, as into a pipe
            _print_classes(rows, lambda t, i, m: _wrapped(t, i, m, console.width, console.file))
        if rules := _rules_line(st):
            console.print(rules, highlight=False, markup=False)


def _wrapped(text: str, indent: str, more: str, width: int, out: Any) -> None:
    import textwrap

    for line in textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more,
                              break_on_hyphens=False) or [indent.rstrip()]:
        print(line, file=out)


def _print_classes(rows: list[tuple[str, ...]], emit: Callable[[str, str, str], None]) -> None:
    emit("classes", "", "")
    for row in rows:
        emit(f"{row[0]}: " + ", ".join(f"{h} {v}" for h, v in zip(CLASS_COLUMNS[1:], row[1:],
                                                                   strict=True)), "  ", "      ")


def _print_plain(st: dict[str, Any], out: Any, width: int = 80) -> None:
    def emit(text: str, indent: str, more: str) -> None:
        _wrapped(text, indent, more, width, out)

    emit(f"tierfs {st['mountpoint']}", "", "    ")  # a long mountpoint too: within width
    for name, text in status_rows(st):
        emit(f"{name}: {text}", "  ", "      ")
    rows = class_rows(st)
    if rows:
        _print_classes(rows, emit)
        if rules := _rules_line(st):
            emit(rules, "", "  ")


def _after_close(cs: dict[str, Any]) -> str:
    """What follows a close, per class: when the upload starts, or how a manifest publishes."""
    if cs["write_mode"] == "writeback":
        delay = float(cs.get("upload_delay", 0.0))
        return f"upload in {delay:g}s" if delay else "upload now"
    if cs["write_mode"] == "publish":
        return "publish behind" if cs.get("publish") == "background" else "waits for publish"
    return "uploaded in close"


# -- warmup ---------------------------------------------------------------------------


class _PlainProgress:
    """Progress for a non-terminal: one line per second to stderr."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, p: dict[str, Any], final: bool = False) -> None:
        if p.get("event") == "start":
            print(f"warmup: {p['files']} file(s), {human(p['bytes'])}", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        done, total, el = p["done_bytes"], p["bytes"], p["elapsed"]
        rate = done / el if el > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else None
        pct = 100.0 * done / total if total else 100.0
        print(f"warmup: {human(done)} / {human(total)} {pct:5.1f}% {human(rate)}/s "
              f"eta {'-' if eta is None else f'{eta:.1f}s' if eta < 10 else f'{eta:.0f}s'} files {p['done_files']}/{p['files']}"
              + (f" failed {p['failed']}" if p.get("failed") else ""),
              file=sys.stderr, flush=True)


def cmd_warmup(args: argparse.Namespace) -> int:
    groups: dict[str, tuple[Path, list[str]]] = {}
    for path in args.paths:
        root, sock, rel = mount_of(path)
        groups.setdefault(sock, (root, []))[1].append(rel)
    force = os.environ.get("TIERFS_PROGRESS") == "1"
    fancy = (sys.stderr.isatty() or force) and not args.no_progress
    failed: list[dict[str, str]] = []
    for sock, (root, rels) in groups.items():
        if fancy:
            reply = _warmup_rich(sock, rels, args, force)
        else:
            plain = _PlainProgress()
            last: dict[str, Any] = {}

            def on_progress(p: dict[str, Any], plain: Any = plain, last: dict = last) -> None:
                if not args.no_progress:
                    plain(p)
                if p.get("event") == "progress":
                    last.update(p)

            reply = request(sock, "warmup", timeout=300.0, on_progress=on_progress,
                            paths=rels, recursive=args.recursive, parallel=args.parallel)
            if last and not args.no_progress:
                plain(last, final=True)
        print(f"warmed {reply['warmed_files']}/{reply['files']} file(s), {human(reply['bytes'])} "
              f"({human(reply['fetched_bytes'])} fetched from the store) in "
              f"{reply['seconds']:.1f}s under {root}")
        failed += [{**f, "path": str(root / f["path"]) if f["path"] != "/" else str(root)}
                   for f in reply["failed"]]
    for f in failed:
        print(f"tierfs: warmup failed: {f['path']}: {f['error']}", file=sys.stderr)
    return 1 if failed else 0


def _warmup_rich(sock: str, rels: list[str], args: argparse.Namespace, force: bool) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        """Transfer rate in binary units, like the byte counts next to it."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{human(speed)}/s" if speed else "?", style="progress.data.speed")

    console = Console(stderr=True, force_terminal=True, width=100) if force else Console(stderr=True)
    with Progress(TextColumn("warmup"), BarColumn(), DownloadColumn(binary_units=True),
                  Rate(), TimeRemainingColumn(), TextColumn("{task.fields[files]}"),
                  console=console, transient=False) as bar:
        task = bar.add_task("warmup", total=None, files="")

        def on_progress(p: dict[str, Any]) -> None:
            if p.get("event") == "start":
                bar.update(task, total=p["bytes"], files=f"0/{p['files']} files")
            else:
                bar.update(task, completed=p["done_bytes"],
                           files=f"{p['done_files']}/{p['files']} files")

        return request(sock, "warmup", timeout=300.0, on_progress=on_progress,
                       paths=rels, recursive=args.recursive, parallel=args.parallel)


# -- cache ------------------------------------------------------------------------------


def cmd_cache(args: argparse.Namespace) -> int:
    if args.action == "evict":
        root, sock, rel = mount_of(args.target)
        reply = request(sock, "cache_evict", timeout=120.0, path=rel)
        if args.json:
            print(json.dumps(reply, indent=2))
        else:
            for e in reply["evicted"]:
                print(f"evicted {e['key']} ({human(e['bytes'])})")
            for k in reply["refused"]:
                print(f"tierfs: not evicted (not uploaded yet): {k}", file=sys.stderr)
        return 1 if reply["refused"] else 0
    sock = find_socket(args.target)
    if args.action == "ls":
        reply = request(sock, "cache_ls", timeout=120.0)
        objs = reply["objects"]
        if args.json:
            print(json.dumps(objs, indent=2))
            return 0
        print(f"{'STATE':<7} {'SIZE':>10} {'CACHED':>10} {'%':>4}  {'LAST ACCESS':<19}  KEY")
        for o in objs:
            pct = 100 * o["cached_bytes"] / o["size"] if o["size"] else 100.0
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["last_access"]))
            print(f"{o['state']:<7} {human(o['size']):>10} {human(o['cached_bytes']):>10} "
                  f"{pct:>4.0f}  {when:<19}  {o['key']}")
        print(f"{len(objs)} object(s), {human(sum(o['cached_bytes'] for o in objs))} cached")
        return 0
    if args.action == "verify":
        reply = request(sock, "cache_verify", timeout=None)
        if args.json:
            print(json.dumps(reply, indent=2))
        else:
            for b in reply["bad"]:
                print(f"bad chunk(s) {b['chunks']} in {b['key']}: dropped (refetched on next read)")
            nbad = sum(len(b["chunks"]) for b in reply["bad"])
            print(f"verified {reply['objects']} object(s) in {reply['seconds']:.1f}s: "
                  f"{nbad} bad chunk(s) dropped")
        return 0
    reply = request(sock, "cache_stats", timeout=30.0)
    st = reply["stats"]
    if args.json:
        print(json.dumps(reply, indent=2))
    else:
        print(f"cache dir:      {reply['cache_dir']}")
        print(f"used:           {human(st['used_bytes'])} of {human(st['capacity'])}")
        print(f"objects:        {st['objects']} ({st['open_objects']} open)")
        print(f"evictions:      {st['evictions_total']} ({human(st['evicted_bytes_total'])})")
        print(f"corrupt chunks: {st['corrupt_chunks_total']}")
    return 0


# -- policy -----------------------------------------------------------------------------


def cmd_policy(args: argparse.Namespace) -> int:
    mp = Path(os.path.abspath(args.mountpoint))
    sock = find_socket(mp)
    path = args.path
    if os.path.isabs(path):
        rel = os.path.relpath(path, mp)
        if rel.startswith(".."):
            raise OpsError(f"{path} is not under the mount {mp}")
        path = "" if rel == "." else rel
    reply = request(sock, "policy", path=path)
    if args.json:
        reply.pop("ok", None)
        print(json.dumps(reply, indent=2))
        return 0
    rule = f"rule {reply['rule']!r}" if reply["rule"] else "no rule matched (default class)"
    print(f"{reply['path'] or '/'}: class {reply['class']} ({rule})")
    s = reply["settings"]
    print("  " + ", ".join(f"{k}={v}" for k, v in s.items() if k != "name"))
    return 0


# -- config check -----------------------------------------------------------------------


def cmd_config_check(args: argparse.Namespace) -> int:
    from tierfs.config import build_config

    bad = 0
    for f in args.files:
        try:
            fs = load_config_file(f)
            if "source" in fs.values and "mountpoint" in fs.values:
                build_config(fs, None, None)
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)  # every problem of the file, one line each
            bad += 1
            continue
        print(f"{f}: ok")
    return 1 if bad else 0


# -- mount.tierfs: the helper mount(8) runs ---------------------------------------------

# mount(8) options that mean nothing to tierfs (or are handled by mount/systemd).
GENERIC_OPTS = {
    "defaults", "rw", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser",
    "owner", "group", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime",
    "relatime", "norelatime", "strictatime", "diratime", "nodiratime", "sync", "async",
    "loud", "silent",
}
# -o key -> `tierfs mount` flag (None: a flag without value)
HELPER_OPTS: dict[str, tuple[str, bool]] = {
    "cache_dir": ("--cache-dir", True),
    "cache_size": ("--cache-size", True),
    "config": ("--config", True),
    "endpoint_url": ("--endpoint-url", True),
    "log_level": ("--log-level", True),
    "log_file": ("--log-file", True),
    "metrics_addr": ("--metrics-addr", True),
    "metrics_allow_remote": ("--metrics-allow-remote", False),
    "allow_other": ("--allow-other", False),
    "nonempty": ("--nonempty", False),
    "uid": ("--uid", True),
    "gid": ("--gid", True),
    "file_mode": ("--file-mode", True),
    "dir_mode": ("--dir-mode", True),
    "no_passthrough": ("--no-passthrough", False),
}


def helper_argv(argv: list[str]) -> list[str] | None:
    """`mount.tierfs SOURCE DIR [-sfnv] [-o OPTS] [-t TYPE]` -> `tierfs mount` argv;
    None for a fake (-f) mount."""
    p = argparse.ArgumentParser(prog="mount.tierfs", add_help=True)
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="opts", action="append", default=[])
    p.add_argument("-t", dest="type")
    p.add_argument("-s", action="store_true", help="sloppy: ignore unknown options")
    p.add_argument("-f", action="store_true", help="fake: parse, do nothing")
    p.add_argument("-n", action="store_true", help="no mtab (ignored)")
    p.add_argument("-v", action="store_true", help="verbose")
    a = p.parse_args(argv)
    out = ["mount", a.source, a.mountpoint]
    for opt in (o for group in a.opts for o in group.split(",") if o):
        key, eq, value = opt.partition("=")
        if key in GENERIC_OPTS or key.startswith(("x-", "comment")):
            continue
        if key == "ro":
            raise OpsError("-o ro: tierfs mounts read-write; the store's permissions decide")
        spec = HELPER_OPTS.get(key)
        if spec is None:
            if a.s:
                continue
            raise OpsError(f"unknown mount option {key!r} (known: {', '.join(HELPER_OPTS)})")
        flag, takes_value = spec
        if takes_value and not eq:
            raise OpsError(f"mount option {key} needs a value ({key}=...)")
        out += [flag, value] if takes_value else [flag]
    return None if a.f else out


def add_parsers(sub: Any, guarded: Callable[[Callable[[argparse.Namespace], int]],
                                             Callable[[argparse.Namespace], int]]) -> None:
    """Register warmup, cache, policy and config on cli.parser()'s subparsers."""
    w = sub.add_parser("warmup", help="fetch files (or trees) of a mount into tier 1")
    w.add_argument("paths", nargs="+", metavar="PATH")
    w.add_argument("--recursive", "-r", action="store_true", help="warm whole directories")
    w.add_argument("--parallel", "-j", type=int, default=4, help="files fetched at a time (default 4)")
    w.add_argument("--no-progress", action="store_true", help="print only the summary")
    w.set_defaults(func=guarded(cmd_warmup))

    c = sub.add_parser("cache", help="inspect or manage a mount's tier-1 cache")
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_, target, target_help in (
        ("ls", "list cached objects: state, size, cached bytes, last access",
         "MOUNTPOINT", "the mount's root"),
        ("evict", "drop the cached bytes of a file, or of everything under a directory "
         "(files not uploaded yet are refused)", "PATH", "a file or directory inside the mount"),
        ("verify", "re-check every cached chunk against its checksum; bad ones are dropped",
         "MOUNTPOINT", "the mount's root"),
        ("stats", "tier-1 use, capacity, evictions", "MOUNTPOINT", "the mount's root"),
    ):
        a = csub.add_parser(action, help=help_, description=help_)
        a.add_argument("target", metavar=target, help=target_help)
        a.add_argument("--json", action="store_true", help="machine-readable output")
        a.set_defaults(func=guarded(cmd_cache))

    p = sub.add_parser("policy", help="show the class (and the rule) a path gets")
    p.add_argument("mountpoint")
    p.add_argument("path", help="relative to the mount root, or an absolute path under it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=guarded(cmd_policy))

    cf = sub.add_parser("config", help="config file tools")
    csub = cf.add_subparsers(dest="config_cmd", required=True)
    ck = csub.add_parser("check", help="validate TOML config file(s): FILE:LINE: reason")
    ck.add_argument("files", nargs="+", metavar="FILE")
    ck.set_defaults(func=guarded(cmd_config_check))


def guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except OpsError as exc:
            print(f"tierfs: error: {exc}", file=sys.stderr)
            return 1
        except ControlError:
            raise

    return run
