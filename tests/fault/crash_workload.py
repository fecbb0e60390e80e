"""A mixed read/write workload for kill -9 trials: `python -m tests.fault.crash_workload MNT TAG LOG SEED`.

Writes checkpoint files (write-back `*.pt`, torch.save-style: tmp file then
os.replace) and small `*.txt` files (default class), re-reads files it closed
earlier and checks them. LOG gets one line per event, fsynced before the
next step:

  intent KEY SHA     about to os.replace a tmp file onto KEY
  closed KEY SHA     KEY's bytes acknowledged (close or os.replace returned)
  corrupt KEY        a re-read returned other bytes than were closed
  exit REASON        the mount went away (expected after kill -9)

The verifier accepts for KEY the last `closed` SHA, or the SHA of a later
`intent` (the kill may fall between os.replace and the log line).
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from pathlib import Path
from typing import TextIO

KiB = 1 << 10


def payload(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def main(mnt: str, tag: str, log_path: str, seed: int, max_size: int = 6 << 20) -> None:
    rng = random.Random(seed)
    root = Path(mnt)
    closed: dict[str, str] = {}
    with open(log_path, "a", buffering=1) as log:
        _run(rng, root, tag, max_size, closed, log)


def _run(rng: random.Random, root: Path, tag: str, max_size: int, closed: dict[str, str],
         log: TextIO) -> None:
    def note(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())

    try:
        (root / "ck").mkdir(exist_ok=True)
        (root / "wt").mkdir(exist_ok=True)
        i = 0
        while True:
            i += 1
            r = rng.random()
            if r < 0.45 or not closed:
                key = f"ck/{tag}-{rng.randrange(6)}.pt"  # a few names: overwrites happen
                data = payload(rng, rng.randrange(64 * KiB, max_size))
                sha = hashlib.sha256(data).hexdigest()
                tmp = root / f"{key}.tmp{i}"
                with open(tmp, "wb") as f:
                    for off in range(0, len(data), 1 << 20):
                        f.write(data[off : off + (1 << 20)])
                note(f"intent {key} {sha}")
                os.replace(tmp, root / key)
                closed[key] = sha
                note(f"closed {key} {sha}")
            elif r < 0.65:
                key = f"wt/{tag}-{i}.txt"
                data = payload(rng, rng.randrange(1, 256 * KiB))
                (root / key).write_bytes(data)
                closed[key] = hashlib.sha256(data).hexdigest()
                note(f"closed {key} {closed[key]}")
            else:
                key = rng.choice(sorted(closed))
                got = hashlib.sha256((root / key).read_bytes()).hexdigest()
                if got != closed[key]:
                    note(f"corrupt {key}")
    except OSError as exc:
        note(f"exit {exc.errno}")


def expected(log_path: str | Path) -> tuple[dict[str, set[str]], list[str]]:
    """From a log: every acknowledged KEY -> its acceptable SHAs, and the keys
    read back corrupt. A key only ever `intent`ed was never acknowledged."""
    last: dict[str, str] = {}
    later: dict[str, set[str]] = {}
    corrupt: list[str] = []
    for line in Path(log_path).read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "closed":
            last[parts[1]] = parts[2]
            later[parts[1]] = set()
        elif parts[0] == "intent":
            later.setdefault(parts[1], set()).add(parts[2])
        elif parts[0] == "corrupt":
            corrupt.append(parts[1])
    return {k: {sha, *later.get(k, ())} for k, sha in last.items()}, corrupt


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
         *(int(a) for a in sys.argv[5:6]))
