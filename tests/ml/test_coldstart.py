"""`tierfs coldstart`: the stages of a model load, their bytes and where the
bytes came from, on a local directory and on a tierfs mount (cold, warm, hot),
and one-line errors for bad input. Through the real command line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.ml.conftest import GET_BYTES, Rig
from tests.support.mount import run_tierfs
from tierfs.cli import main

STAGES = ["discovery", "read", "materialize", "to-device"]


def sharded_model(root: Path, shards: int = 4, mib: int = 64) -> int:
    """A Hugging Face-style sharded safetensors model; returns its tensor bytes."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    per = mib // shards // 4  # 4 MiB fp32 matrices per shard
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {f"layers.{s}.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(per)}
        part[f"layers.{s}.norm"] = torch.ones(1024, dtype=torch.bfloat16)
        save_file(part, str(root / name))
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.nbytes for t in part.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return total


def coldstart(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    res = run_tierfs("coldstart", *args, "--json", env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def stage(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in report["stages"] if s["name"] == name)


def check_shape(report: dict[str, Any], weight_bytes: int, tensor_bytes: int) -> None:
    assert [s["name"] for s in report["stages"]] == STAGES
    assert report["weight_bytes"] == weight_bytes
    assert stage(report, "read")["bytes"] == weight_bytes
    assert stage(report, "materialize")["bytes"] == tensor_bytes
    assert stage(report, "to-device")["seconds"] is None  # cpu
    for name in ("read", "materialize"):
        s = stage(report, name)
        assert sum(s["from"].values()) == s["bytes"], s
        assert s["seconds"] > 0
    assert report["dominant"] in STAGES
    assert report["total_s"] == pytest.approx(sum(s["seconds"] or 0 for s in report["stages"]))


def test_local_sharded_and_single_safetensors(tmp_path: Path) -> None:
    tensor_bytes = sharded_model(tmp_path / "m")
    weight_bytes = sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors"))
    report = coldstart(str(tmp_path / "m"))
    check_shape(report, weight_bytes, tensor_bytes)
    assert (report["format"], report["files"], report["tierfs_mount"]) == ("safetensors", 4, None)
    assert set(stage(report, "read")["from"]) == {"page cache", "storage"}
    assert stage(report, "discovery")["bytes"] > 0

    one = tmp_path / "m/model-00002-of-00004.safetensors"
    single = coldstart(str(one))
    assert (single["files"], single["weight_bytes"]) == (1, one.stat().st_size)
    by_index = coldstart(str(tmp_path / "m/model.safetensors.index.json"))
    assert by_index["weight_bytes"] == weight_bytes


def test_torch_pt_and_sharded_bin(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    sd = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(8)}
    sd["tied"] = sd["w0"]  # one storage, saved and counted once
    torch.save(sd, tmp_path / "model.pt")
    tensor_bytes = sum(t.nbytes for k, t in sd.items() if k != "tied")
    report = coldstart(str(tmp_path / "model.pt"))
    check_shape(report, (tmp_path / "model.pt").stat().st_size, tensor_bytes)
    assert report["format"] == "torch"

    shards = tmp_path / "bin"
    shards.mkdir()
    torch.save({k: sd[k] for k in ("w0", "w1", "w2")}, shards / "pytorch_model-00001-of-00002.bin")
    torch.save({k: sd[k] for k in ("w3", "w4")}, shards / "pytorch_model-00002-of-00002.bin")
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        **dict.fromkeys(("w0", "w1", "w2"), "pytorch_model-00001-of-00002.bin"),
        **dict.fromkeys(("w3", "w4"), "pytorch_model-00002-of-00002.bin")}}))
    report = coldstart(str(shards))
    assert (report["format"], report["files"]) == ("torch", 2)
    assert stage(report, "materialize")["bytes"] == 5 * 512 * 1024 * 4


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="the warm run drops the page cache (root)")
def test_on_a_mount_cold_warm_hot_and_compare(rig: Rig, tmp_path: Path) -> None:
    local = tmp_path / "local-model"
    tensor_bytes = sharded_model(local)
    weight_bytes = sum(f.stat().st_size for f in local.glob("*.safetensors"))
    (rig.root / "models/m").mkdir(parents=True)
    for f in local.iterdir():
        shutil.copyfile(f, rig.root / "models/m" / f.name)
    reader = rig.reader("cold")  # flushed; a fresh mount, empty tier 1
    path = str(reader.mountpoint / "models/m")
    env = reader.env

    png = tmp_path / "cold.png"
    cold = coldstart(path, "--compare", str(local), "--png", str(png), env=env)
    check_shape(cold, weight_bytes, tensor_bytes)
    assert cold["tierfs_mount"] == str(reader.mountpoint)
    read = stage(cold, "read")["from"]
    assert set(read) == {"page cache", "tier 1", "store"}
    # Discovery's header reads leave a little in the page cache (kernel readahead).
    assert read["store"] >= 0.75 * weight_bytes, read
    assert stage(cold, "discovery")["from"].get("store", 0) > 0
    assert reader.metric(GET_BYTES) >= weight_bytes
    ref = cold["compare"]
    check_shape(ref, weight_bytes, tensor_bytes)
    assert ref["tierfs_mount"] is None and set(stage(ref, "read")["from"]) == {"page cache", "storage"}
    assert set(cold["ratios"]) == {*STAGES, "total"}
    assert cold["ratios"]["to-device"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    fetched = reader.metric(GET_BYTES)
    hot = coldstart(path, env=env)
    assert stage(hot, "read")["from"]["store"] == 0
    drop_page_cache()
    warm = coldstart(path, env=env)
    read = stage(warm, "read")["from"]
    assert read["store"] == 0 and read["tier 1"] >= 0.75 * weight_bytes, read
    assert reader.metric(GET_BYTES) == fetched  # hot and warm: nothing from the store

    table = run_tierfs("coldstart", path, env=env, timeout=300)
    assert table.returncode == 0, table.stderr
    for name in (*STAGES, "total", "dominant:", f"tierfs mount {reader.mountpoint}"):
        assert name in table.stdout


def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    sharded_model(tmp_path / "m", shards=2, mib=16)
    plain = run_tierfs("coldstart", str(tmp_path / "m"), timeout=120)
    assert plain.returncode == 0 and plain.stderr == ""
    forced = run_tierfs("coldstart", str(tmp_path / "m"),
                        env={**os.environ, "TIERFS_PROGRESS": "1"}, timeout=120)
    assert forced.returncode == 0
    assert "read" in forced.stderr and "materialize" in forced.stderr


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty").mkdir()
    (tmp / "junk.safetensors").write_bytes(b"\xff" * 64)
    good = tmp / "good.safetensors"
    save_file({"w": torch.ones(1024)}, str(good))
    (tmp / "cut.safetensors").write_bytes(good.read_bytes()[:-100])
    (tmp / "notzip.pt").write_bytes(b"not a zip file at all")
    (tmp / "idx").mkdir()
    (tmp / "idx/model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    (tmp / "weights.npy").write_bytes(b"\x93NUMPY")
    cases = [
        ([str(tmp / "missing")], "no such file or directory"),
        ([str(tmp / "empty")], "no model weights here"),
        ([str(tmp / "junk.safetensors")], "not a safetensors file"),
        ([str(tmp / "cut.safetensors")], "truncated safetensors file"),
        ([str(tmp / "notzip.pt")], "not a torch zip checkpoint"),
        ([str(tmp / "idx")], "names model-00001-of-00002.safetensors, which is missing"),
        ([str(tmp / "weights.npy")], "not a model file"),
        ([str(good), "--png", str(tmp / "no/such/dir/c.png")], "--png"),
        ([str(good), "--compare", str(tmp / "empty")], "no model weights here"),
    ]
    if not torch.cuda.is_available():
        cases.append(([str(good), "--device", "cuda"], "CUDA is not available"))
    return cases


def test_bad_input_is_one_line_and_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (cli.main, the console script's entry): PyTorch is imported once,
    # not once per case. test_without_torch below goes through a real subprocess.
    for args, fragment in _bad_inputs(tmp_path):
        code = main(["coldstart", *args])
        out, err = capsys.readouterr()
        assert code == 1, (args, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), (args, err)
        assert fragment in lines[0], (args, lines[0])


def test_without_torch_says_how_to_install_it(tmp_path: Path) -> None:
    # A real interpreter without PyTorch cannot be had in this venv; a shadowing
    # `torch` package that fails to import is what an absent one looks like.
    shadow = tmp_path / "shadow/torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    save_file({"w": torch.ones(16)}, str(tmp_path / "m.safetensors"))
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}:{os.environ.get('PYTHONPATH', '')}"}
    res = run_tierfs("coldstart", str(tmp_path / "m.safetensors"), env=env, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "tierfs: error: coldstart needs PyTorch to materialize tensors (No module named 'torch'); "
        "install it with pip install 'tierfs[ml]' (pins torch==2.13.0)"]
    # the rest of the command line does not need it
    assert run_tierfs("policy", "--help", env=env).returncode == 0
