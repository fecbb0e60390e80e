"""The real checkpoint savers and loaders through the mount, each read back hot
(the writer's mount) and cold (a fresh mount after `tierfs flush`).

What the savers do on disk (strace'd, PyTorch 2.13, safetensors 0.8):
- DCP writes `__R_T.distcp` shards, then `.metadata.tmp`, renames it to
  `.metadata` (its commit point);
- `torch.save` users write `x.pt.tmp`, fsync, `os.replace` it;
- safetensors writes `.tmpXXXXXX` and renames it to the final name *before*
  closing it;
- Hugging Face Trainer fills `tmp-checkpoint-N/` and renames the directory.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter

from tests.ml.conftest import (
    TIERS,
    MiB,
    Rig,
    assert_cold,
    assert_same,
    empty_like,
    file_digest,
    flat,
    flush,
    state_dict,
    temp_keys,
    tensor_bytes,
)

# DCP without a process group runs as a single rank and warns about it once per call.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("saver", ["save", "async_save"])
def test_dcp_save_and_load(rig: Rig, saver: str, tier: str) -> None:
    sd = state_dict(64, seed=1)
    ckpt = rig.root / "run/step-100"
    # Four writer threads: four shard files at once, as a multi-threaded rank writes.
    writer = FileSystemWriter(str(ckpt), thread_count=4)
    if saver == "save":
        dcp.save(sd, storage_writer=writer)
    else:
        dcp.async_save(sd, storage_writer=writer).result(timeout=300)
    names = sorted(os.listdir(ckpt))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp"]

    reader = rig.reader(tier)
    out = empty_like(sd)
    dcp.load(out, checkpoint_id=str(reader.mountpoint / "run/step-100"))
    assert_same(out, sd)
    if tier == "cold":
        assert_cold(reader, tensor_bytes(sd))
    flush(rig.writer)
    keys = rig.keys("run/step-100/")
    assert [k for k in keys if not k.endswith("/")] == [f"run/step-100/{n}" for n in names]
    assert temp_keys(keys) == []


@pytest.mark.parametrize("tier", TIERS)
def test_torch_save_tmp_fsync_replace_then_mmap_load(rig: Rig, tier: str) -> None:
    sd = state_dict(64, seed=2)
    os.makedirs(rig.root / "ckpt")
    tmp, final = rig.root / "ckpt/model.pt.tmp", rig.root / "ckpt/model.pt"
    with open(tmp, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    assert os.listdir(rig.root / "ckpt") == ["model.pt"]
    digest = file_digest(final)

    reader = rig.reader(tier)
    path = reader.mountpoint / "ckpt/model.pt"
    got = torch.load(path, mmap=True, weights_only=True)
    assert_same(got, sd)
    del got
    if tier == "cold":
        assert_cold(reader, tensor_bytes(sd))
    flush(rig.writer)
    assert [k for k in rig.keys("ckpt/") if not k.endswith("/")] == ["ckpt/model.pt"]
    assert rig.object_digest("ckpt/model.pt") == digest


@pytest.mark.parametrize("tier", TIERS)
def test_safetensors_save_file_load_file_safe_open(rig: Rig, tier: str) -> None:
    tensors = flat(state_dict(64, seed=3))
    os.makedirs(rig.root / "model")
    save_file(tensors, str(rig.root / "model/model.safetensors"), metadata={"format": "pt"})
    assert os.listdir(rig.root / "model") == ["model.safetensors"]  # the temp name is gone
    digest = file_digest(rig.root / "model/model.safetensors")

    reader = rig.reader(tier)
    path = str(reader.mountpoint / "model/model.safetensors")
    assert_same(load_file(path), tensors)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
        rows = f.get_slice("model.layers.0.weight")[100:104]
        assert torch.equal(rows, tensors["model.layers.0.weight"][100:104])
    if tier == "cold":
        assert_cold(reader, tensor_bytes(tensors))
    flush(rig.writer)
    assert [k for k in rig.keys("model/") if not k.endswith("/")] == ["model/model.safetensors"]
    assert rig.object_digest("model/model.safetensors") == digest


def _open_for_write(rig: Rig) -> int:
    pending = rig.writer.status()["pending"]
    assert "open_for_write" in pending, pending
    return int(pending["open_for_write"])


# Issue 15 item 1: safetensors renames its temp file before closing it; on the old write
# path flush could return before the upload (a race: 10 of 10 saves on a loaded machine).
def test_safetensors_save_then_flush_is_in_the_bucket(rig: Rig) -> None:
    """flush is the remote durability barrier: right after save_file returns, a
    flush leaves the file in the bucket, and nothing stays open for write."""
    os.makedirs(rig.root / "m")
    for i in range(4):
        tensors = {"w": torch.randn(2048, 2048, generator=torch.Generator().manual_seed(i))}
        path = rig.root / f"m/model-{i}.safetensors"
        save_file(tensors, str(path))
        flush(rig.writer)  # at once: the race is between close and flush
        assert rig.object_digest(f"m/model-{i}.safetensors") == file_digest(path)
    deadline = time.monotonic() + 10  # RELEASE reaches the daemon after close(2) returns
    while _open_for_write(rig) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_for_write(rig) == 0


@pytest.mark.parametrize("tier", TIERS)
def test_trainer_style_checkpoint_directory_rename(rig: Rig, tier: str) -> None:
    """Hugging Face Trainer writes tmp-checkpoint-N/ and renames it to checkpoint-N/."""
    sd = state_dict(48, seed=4)
    optim = state_dict(16, seed=5)
    tmp = rig.root / "out/tmp-checkpoint-500"
    os.makedirs(tmp)
    save_file(flat(sd["model"]), str(tmp / "model.safetensors"))
    torch.save(optim, tmp / "optimizer.pt")
    torch.save({"last_epoch": 3}, tmp / "scheduler.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    (tmp / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    files = sorted(os.listdir(tmp))
    os.rename(tmp, rig.root / "out/checkpoint-500")
    assert os.listdir(rig.root / "out") == ["checkpoint-500"]
    assert sorted(os.listdir(rig.root / "out/checkpoint-500")) == files

    reader = rig.reader(tier)
    ck = reader.mountpoint / "out/checkpoint-500"
    assert sorted(os.listdir(ck)) == files
    assert_same(load_file(str(ck / "model.safetensors")), flat(sd["model"]))
    assert_same(torch.load(ck / "optimizer.pt", mmap=True, weights_only=True), optim)
    assert torch.load(ck / "scheduler.pt", weights_only=True) == {"last_epoch": 3}
    assert json.loads((ck / "trainer_state.json").read_text()) == {"global_step": 500}
    if tier == "cold":
        assert_cold(reader, tensor_bytes(sd["model"]) + tensor_bytes(optim))
    flush(rig.writer)
    assert rig.keys("out/tmp-checkpoint-500/") == []
    assert [k for k in rig.keys("out/checkpoint-500/") if not k.endswith("/")] == \
        [f"out/checkpoint-500/{n}" for n in files]


# Issue 15 item 2: close() of a file unlinked while open failed with EIO; TemporaryFile is that.
def test_tempfile_temporaryfile(rig: Rig) -> None:
    payload = os.urandom(3 * MiB)
    with tempfile.TemporaryFile(dir=rig.root) as f:  # created, unlinked at once, then used
        assert os.listdir(rig.root) == []
        f.write(payload)
        f.seek(0)
        assert f.read() == payload
    flush(rig.writer)
    assert rig.keys() == []  # nothing of an unlinked file is uploaded


def test_tempfile_named_and_replaced(rig: Rig) -> None:
    payload = os.urandom(3 * MiB)
    with tempfile.NamedTemporaryFile(dir=rig.root) as f:  # deleted on close
        f.write(payload)
        f.flush()
        with open(f.name, "rb") as again:
            assert again.read() == payload
    assert os.listdir(rig.root) == []
    # The write-to-temp-then-replace idiom many libraries use for atomic saves.
    with tempfile.NamedTemporaryFile(dir=rig.root, suffix=".partial", delete=False) as f:
        f.write(payload)
    os.replace(f.name, rig.root / "result.bin")
    assert os.listdir(rig.root) == ["result.bin"]
    assert (rig.root / "result.bin").read_bytes() == payload
    flush(rig.writer)
    assert rig.keys() == ["result.bin"]
    assert rig.object_digest("result.bin") == file_digest(rig.root / "result.bin")
