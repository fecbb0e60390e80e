"""Fixtures of the ML tests: the real libraries (PyTorch CPU, safetensors,
webdataset) against a real mount of a real SeaweedFS bucket.

"hot" reads what was just written, through the writer's own mount; "cold"
reads it through a fresh mount with an empty tier 1, after `tierfs flush` on
the writer (only then is the bucket the whole truth), and checks that the
bytes really came from the store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="tests/ml needs the ml extra: pip install -e '.[ml]'")

from tests.integration.conftest import MountFactory, mount_factory  # noqa: E402,F401 (fixture)
from tests.support.mount import TierfsMount, run_tierfs  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

MiB = 1 << 20
TIERS = ("hot", "cold")
GET_BYTES = "tierfs_store_bytes_total{op=get}"


def flush(m: TierfsMount) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


@dataclass
class Rig:
    """One bucket, the mount that writes into it, and fresh mounts that read it."""

    bucket: str
    server: SeaweedServer
    make: Callable[..., TierfsMount]
    writer: TierfsMount

    @property
    def root(self) -> Path:
        return self.writer.mountpoint

    def keys(self, prefix: str = "") -> list[str]:
        return self.server.keys(self.bucket, prefix)

    def object_digest(self, key: str) -> str:
        body = self.server.client().get_object(Bucket=self.bucket, Key=key)["Body"]
        h = hashlib.sha256()
        while chunk := body.read(8 * MiB):
            h.update(chunk)
        return h.hexdigest()

    def reader(self, tier: str) -> TierfsMount:
        """Where a `tier` read happens: the writer's mount (hot), or a fresh
        mount with an empty tier 1 after the writer's flush (cold)."""
        if tier == "hot":
            return self.writer
        assert tier == "cold", tier
        flush(self.writer)
        return self.make(f"s3://{self.bucket}")


@pytest.fixture
def rig(mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer) -> Rig:  # noqa: F811
    return Rig(bucket, s3_server, mount_factory, mount_factory(f"s3://{bucket}"))


def assert_cold(m: TierfsMount, nbytes: int) -> None:
    """A cold read fetched (at least) what it read from the store."""
    assert m.metric(GET_BYTES) >= nbytes, "a cold read that did not come from the store"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def state_dict(mib: int, seed: int = 0) -> dict[str, Any]:
    """A model-and-optimizer-like state dict of about `mib` MiB: fp32 matrices,
    bf16 and int64 tensors, a 0-dim step, nested dicts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // 4)  # 4 MiB fp32 matrices
    model = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n)}
    model["embed.bf16"] = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    model["positions"] = torch.arange(4096, dtype=torch.int64)
    optim = {"step": torch.tensor(seed + 1), "exp_avg": torch.randn(256, 256, generator=g)}
    return {"model": model, "optim": optim}


def empty_like(sd: Any) -> Any:
    """The same structure with uninitialized tensors (what DCP loads into)."""
    import torch

    if isinstance(sd, dict):
        return {k: empty_like(v) for k, v in sd.items()}
    assert isinstance(sd, torch.Tensor)
    return torch.zeros_like(sd)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Tensor by tensor: same keys, dtype, shape and values."""
    import torch

    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
        return
    assert isinstance(got, torch.Tensor), where
    assert got.dtype == want.dtype and got.shape == want.shape, where
    assert torch.equal(got, want), f"{where}: values differ"


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    return int(sd.nbytes)


def flat(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": t}} -> {"a.b": t} (safetensors takes a flat dict)."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def temp_keys(keys: list[str]) -> list[str]:
    """Keys that look like a saver's temporary names (never meant for readers)."""
    return [k for k in keys if ".tmp" in os.path.basename(k) or k.rstrip("/").endswith("~")]
