"""A seeded random model: thousands of mixed writes on the mount vs a local-directory oracle.

Both write contracts are exercised at once: `*.pt` files are write-back
(checkpoint class), `*.txt` files write-through (default class). After every
remount and at the end, the mount, the oracle and (after a flush) the bucket
must agree byte for byte.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from tests.integration.conftest import MountFactory
from tests.support.mount import run_tierfs
from tests.support.seaweed import SeaweedServer

OPS = 2500
NAMES = [f"{d}f{i}.{ext}" for d in ("", "d1/", "d1/d2/") for i in range(4) for ext in ("pt", "txt")]


def snapshot(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def differences(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """What differs, one short line per path (a plain `==` diff of the bytes is unreadably slow)."""
    out = []
    for name in sorted(got.keys() | want.keys()):
        g, w = got.get(name), want.get(name)
        if g == w:
            continue
        if g is None or w is None:
            out.append(f"{name}: {'missing on mount' if g is None else 'only on mount'}")
        else:
            n = min(len(g), len(w))
            first = next((i for i in range(n) if g[i] != w[i]), n)
            out.append(f"{name}: mount {len(g)} bytes, oracle {len(w)}, first difference at {first}")
    return out


def apply(root: Path, op: tuple, rng_bytes: bytes) -> str | None:  # type: ignore[type-arg]
    """Run one operation under `root`; returns the errno name on failure."""
    kind, a, b, c = op
    try:
        if kind == "write":
            (root / a).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / a, os.O_WRONLY | os.O_CREAT)
            try:
                os.pwrite(fd, rng_bytes, b)
            finally:
                os.close(fd)
        elif kind == "truncate":
            os.truncate(root / a, b)
        elif kind == "rename":
            (root / b).parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / a, root / b)
        elif kind == "unlink":
            os.unlink(root / a)
        elif kind == "append":
            with open(root / a, "ab") as f:
                f.write(rng_bytes)
        elif kind == "rewrite":  # open O_TRUNC and write fresh content
            (root / a).parent.mkdir(parents=True, exist_ok=True)
            (root / a).write_bytes(rng_bytes)
    except OSError as exc:
        return type(exc).__name__
    return None


def test_random_ops_match_local_oracle(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    rng = random.Random(20261202)
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    mismatches: list[str] = []
    for i in range(OPS):
        kind = rng.choices(["write", "truncate", "rename", "unlink", "append", "rewrite"],
                           weights=[40, 10, 10, 8, 12, 20])[0]
        a, b = rng.choice(NAMES), rng.choice(NAMES)
        size = rng.choice([1, 100, 4096, 65536, 300_000])
        data = rng.randbytes(size)
        op = (kind, a, b if kind == "rename" else rng.randrange(0, 400_000), None)
        want, got = apply(oracle, op, data), apply(m.mountpoint, op, data)
        if want != got:
            mismatches.append(f"op {i} {op[:3]}: oracle {want}, mount {got}")
        if i % 500 == 499:  # remount on the same cache, then compare everything
            m.umount()
            m = mount_factory(f"s3://{bucket}", cache_dir=cache, mountpoint=m.mountpoint)
            assert differences(snapshot(m.mountpoint), snapshot(oracle)) == [], f"after op {i}"
    assert mismatches == []
    assert differences(snapshot(m.mountpoint), snapshot(oracle)) == []
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr
    c = s3_server.client()
    in_bucket = {k: c.get_object(Bucket=bucket, Key=k)["Body"].read()
                 for k in s3_server.keys(bucket) if not k.endswith("/")}
    assert differences(in_bucket, snapshot(oracle)) == []
