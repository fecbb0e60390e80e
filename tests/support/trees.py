"""Local trees that tests and bench/ copy into a mount (pytest-free: bench/ uses it)."""

from __future__ import annotations

import os
from pathlib import Path

T0 = 1_600_000_000  # whole seconds, long before any upload: an mtime only metadata keeps


def preserved_files(root: Path, count: int) -> None:
    """`count` small files f00000.txt... under a new `root`, file i with mtime T0 + i
    and mode 0600 for every tenth (0644 otherwise): what `cp -a` must preserve."""
    root.mkdir(parents=True)
    for i in range(count):
        p = root / f"f{i:05d}.txt"
        p.write_bytes(b"%099d" % i)
        if i % 10 == 0:
            p.chmod(0o600)
        os.utime(p, (T0 + i, T0 + i))
