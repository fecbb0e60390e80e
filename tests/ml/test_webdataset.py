"""webdataset tar shards written into the mount, then one epoch of a
DataLoader with two worker processes over them: every sample exactly once,
bytes intact, both workers reading. Hot and cold (fresh mount after flush)."""

from __future__ import annotations

import hashlib
import os

import pytest
import webdataset as wds
from torch.utils.data import DataLoader, get_worker_info

from tests.ml.conftest import TIERS, Rig, assert_cold, file_digest, flush

SHARDS = 8
SAMPLES = 32  # per shard
SAMPLE = 256 << 10  # 8 shards x 32 x 256 KiB = 64 MiB


def write_shards(root: str) -> dict[str, str]:
    """SHARDS tar shards of random samples; returns {sample key: sha256 of its bytes}."""
    expected: dict[str, str] = {}
    for s in range(SHARDS):
        with wds.TarWriter(f"{root}/train-{s:06d}.tar") as sink:
            for i in range(SAMPLES):
                key = f"{s:06d}_{i:04d}"
                data = os.urandom(SAMPLE)
                expected[key] = hashlib.sha256(data).hexdigest()
                sink.write({"__key__": key, "bin": data, "cls": str(i % 10).encode()})
    return expected


def with_worker(sample: dict) -> tuple[str, str, int, int]:
    info = get_worker_info()
    return (sample["__key__"], hashlib.sha256(sample["bin"]).hexdigest(), int(sample["cls"]),
            -1 if info is None else info.id)


@pytest.mark.parametrize("tier", TIERS)
def test_webdataset_dataloader_epoch(rig: Rig, tier: str) -> None:
    os.makedirs(rig.root / "data")
    expected = write_shards(str(rig.root / "data"))
    shards = sorted(os.listdir(rig.root / "data"))
    assert len(shards) == SHARDS

    reader = rig.reader(tier)
    urls = [str(reader.mountpoint / "data" / s) for s in shards]
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=True).map(with_worker)
    loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=120)
    seen: dict[str, str] = {}
    workers = set()
    for key, digest, cls, worker in loader:
        assert key not in seen, f"{key} delivered twice"
        seen[key] = digest
        assert cls == int(key.rsplit("_", 1)[1]) % 10
        workers.add(worker)
    assert seen == expected  # every sample once, every byte intact
    assert workers == {0, 1}  # the shards were split over both worker processes
    if tier == "cold":
        assert_cold(reader, SHARDS * SAMPLES * SAMPLE)
    flush(rig.writer)
    assert [k for k in rig.keys("data/") if not k.endswith("/")] == [f"data/{s}" for s in shards]
    for s in shards[:2]:
        assert rig.object_digest(f"data/{s}") == file_digest(rig.root / "data" / s)

