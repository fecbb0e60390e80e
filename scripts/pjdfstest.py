"""pjdfstest (the POSIX conformance suite) as root on a fresh `--allow-other` tierfs
mount of a private SeaweedFS bucket: subtests passed per group, and each failure.

SRC is a pjdfstest source tree (github.com/pjd/pjdfstest: pjdfstest.c, tests/).
Its binary is built here with gcc when missing (a config.h for Linux, no
autotools). Counted as `prove` counts: a `not ok ... # TODO` is a pass.

Usage: sudo .venv/bin/python scripts/pjdfstest.py SRC [GROUP ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mount import TierfsMount  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

LINUX_CONFIG = "".join(f"#define {name} 1\n" for name in (
    "HAVE_SYS_SYSMACROS_H", "HAVE_FACCESSAT", "HAVE_FCHMODAT", "HAVE_FCHOWNAT", "HAVE_FSTATAT",
    "HAVE_LINKAT", "HAVE_MKDIRAT", "HAVE_MKFIFOAT", "HAVE_MKNODAT", "HAVE_OPENAT",
    "HAVE_POSIX_FALLOCATE", "HAVE_READLINKAT", "HAVE_RENAMEAT", "HAVE_SYMLINKAT",
    "HAVE_UNLINKAT", "HAVE_UTIMENSAT", "HAVE_STRUCT_STAT_ST_ATIM", "HAVE_STRUCT_STAT_ST_MTIM",
    "HAVE_STRUCT_STAT_ST_CTIM"))
TAP = re.compile(r"^(ok|not ok) (\d+)(.*)$", re.M)


def build(src: Path) -> None:
    if (src / "pjdfstest").exists():
        return
    if not (src / "config.h").exists():
        (src / "config.h").write_text(LINUX_CONFIG)
    subprocess.run(["gcc", "-O2", "-D_GNU_SOURCE", "-o", "pjdfstest", "pjdfstest.c"], cwd=src,
                   check=True)


@dataclass
class Result:
    total: int
    passed: int
    fails: list[str]


def run_file(t: Path) -> Result:
    """One .t file, run by bash in the current directory (the mount)."""
    out = subprocess.run(["bash", str(t)], capture_output=True, text=True, timeout=600).stdout
    lines = TAP.findall(out)
    plan = re.search(r"^1\.\.(\d+)", out, re.M)
    fails = [f"{n}{rest}" for status, n, rest in lines if status == "not ok" and "# TODO" not in rest]
    total = int(plan.group(1)) if plan else len(lines)
    return Result(total, total - len(fails), fails)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a pjdfstest source tree")
    p.add_argument("groups", nargs="*", help="test groups (default: all)")
    p.add_argument("--json", type=Path, help="write every file's result here")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("pjdfstest: run as root (it changes owners and makes devices)")
    tests = args.src.resolve() / "tests"
    if not (args.src / "pjdfstest.c").exists() or not tests.is_dir():
        raise SystemExit(f"pjdfstest: {args.src} is not a pjdfstest source tree")
    build(args.src)
    groups = args.groups or sorted(d.name for d in tests.iterdir() if d.is_dir())
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="tierfs-pjdfstest-") as tmp:
        work = Path(tmp)
        server = SeaweedServer(data_dir=work / "seaweed", volumes_per_bucket=1).start()
        mount = None
        try:
            server.make_bucket("pjdfstest")
            mount = TierfsMount(source="s3://pjdfstest", mountpoint=work / "mnt",
                                cache_dir=work / "cache", env={**os.environ, **server.env()},
                                extra=["--allow-other"]).start()
            os.chdir(mount.mountpoint)
            for group in groups:
                for t in sorted((tests / group).glob("*.t")):
                    results[f"{group}/{t.name}"] = r = run_file(t)
                    print(f"{group}/{t.name}: {r.passed}/{r.total}", flush=True)
        finally:
            os.chdir("/")
            if mount is not None:
                mount.cleanup()
            server.stop()
    total = sum(r.total for r in results.values())
    passed = sum(r.passed for r in results.values())
    print(f"pjdfstest: {passed}/{total} subtests passed ({100 * passed / max(total, 1):.1f}%)")
    for group in groups:
        mine = [r for name, r in results.items() if name.startswith(f"{group}/")]
        failed = sum(r.total - r.passed for r in mine)
        if failed:
            print(f"  {group}: {failed} failed of {sum(r.total for r in mine)}")
    if args.json:
        args.json.write_text(json.dumps({k: asdict(r) for k, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
