"""`tierfs coldstart PATH [--compare DIR] [--device cpu|cuda] [--json] [--png FILE]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tierfs.coldstart.model import ModelError
from tierfs.coldstart.report import compare_table, png, report_dict, table
from tierfs.coldstart.stages import NoProgress, Progress, Run, coldstart


class BarProgress:
    """A rich progress bar per stage on stderr (a terminal, or TIERFS_PROGRESS=1)."""

    def __init__(self, label: str, force: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        console = Console(stderr=True, force_terminal=True, width=100) if force else Console(stderr=True)
        self.bar = Progress(TextColumn(f"{label} {{task.description:<12}}"), BarColumn(),
                            DownloadColumn(binary_units=True), TransferSpeedColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
        self.task: Any = None

    def begin(self, stage: str, total: int) -> None:
        if self.task is None:
            self.bar.start()
        else:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(stage, total=total or None)

    def advance(self, nbytes: int) -> None:
        self.bar.advance(self.task, nbytes)

    def end(self) -> None:
        self.bar.refresh()

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


def _load(path: Path, device: str | None, args: argparse.Namespace, label: str) -> Run:
    force = os.environ.get("TIERFS_PROGRESS") == "1"
    bar = BarProgress(label, force) if (sys.stderr.isatty() or force) and not args.json else None
    progress: Progress = bar or NoProgress()
    try:
        return coldstart(path, device, progress)
    finally:
        if bar is not None:
            bar.close()


def cmd_coldstart(args: argparse.Namespace) -> int:
    try:
        run = _load(Path(os.path.abspath(args.path)), args.device, args, "this")
        ref = None
        if args.compare:
            ref = _load(Path(os.path.abspath(args.compare)), run.device, args, "compare")
            if ref.model.weight_bytes != run.model.weight_bytes:
                print(f"tierfs: warning: {args.compare} holds {ref.model.weight_bytes} weight bytes, "
                      f"{args.path} {run.model.weight_bytes}: not the same model", file=sys.stderr)
        if args.png:
            png([run] if ref is None else [run, ref], Path(args.png))
    except ModelError as exc:
        print(f"tierfs: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_dict(run, ref), indent=2))
        return 0
    print(table(run))
    if ref is not None:
        print()
        print(table(ref))
        print()
        print(compare_table(run, ref))
    if args.png:
        print(f"chart: {args.png}")
    return 0


def add_parser(sub: Any) -> None:
    """Register `coldstart` on cli.parser()'s subparsers."""
    c = sub.add_parser(
        "coldstart",
        help="load a model the way a server does and time each stage "
             "(discovery, read, materialize, to-device)",
        description="Load the model at PATH (a directory, a .safetensors/.pt/.bin file, or an "
                    "index .json) and time each stage of its cold start, with the bytes each "
                    "moved and where they came from (page cache, tier 1, store). Works on any "
                    "filesystem; the tier split needs PATH on a tierfs mount. Needs PyTorch "
                    "(pip install 'tierfs[ml]').")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--compare", metavar="DIR", help="run the same load on DIR (e.g. a local copy) "
                   "right after, and print both with ratios")
    c.add_argument("--device", choices=["cpu", "cuda"],
                   help="where tensors go (default: cuda when available, else cpu)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.add_argument("--png", metavar="FILE", help="also draw the stages as a bar chart (matplotlib)")
    c.set_defaults(func=cmd_coldstart)
