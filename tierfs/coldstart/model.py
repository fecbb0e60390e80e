"""Discovery: which files make up a model, and what their headers say.

Reads what a loader reads before the weights: the directory listing, the JSON
files beside the weights (index, config, tokenizer), each safetensors header
and each torch zip's central directory. Standard library only, so a bad path
is reported before PyTorch is imported.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

SAFETENSORS = "safetensors"
TORCH = "torch"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# The safetensors format caps its JSON header at 100 MB.
MAX_HEADER = 100_000_000


class ModelError(Exception):
    """The path is not a model this command can load (one-line message)."""


@dataclass(frozen=True)
class WeightFile:
    path: Path
    size: int
    tensors: int  # tensors (safetensors) or storages (torch zip) it holds
    meta_bytes: int  # header / central directory bytes read at discovery


@dataclass
class Model:
    root: Path  # what the user named: a file or a directory
    format: str  # SAFETENSORS or TORCH
    weights: list[WeightFile]
    meta_files: list[Path] = field(default_factory=list)  # JSON read at discovery
    index: Path | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(w.size for w in self.weights)

    @property
    def tensors(self) -> int:
        return sum(w.tensors for w in self.weights)

    @property
    def discovery_bytes(self) -> int:
        return sum(w.meta_bytes for w in self.weights) + sum(_size(p) for p in self.meta_files)

    def describe(self) -> str:
        n = len(self.weights)
        layout = "single file" if n == 1 and self.index is None else f"{n} shards"
        return f"{self.format}, {layout}, {self.tensors} tensors"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: unreadable JSON ({exc})") from None


def safetensors_header(path: Path) -> WeightFile:
    """Parse a safetensors header (u64 little-endian length, then JSON) and check
    that every tensor's data lies inside the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise ModelError(f"{path}: not a safetensors file (header length {n} does not fit "
                                 f"in {size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise ModelError(f"{path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise ModelError(f"{path}: not a safetensors file (bad header: {exc})") from None
    if 8 + n + end > size:
        raise ModelError(f"{path}: truncated safetensors file (tensor data ends at byte "
                         f"{8 + n + end}, the file has {size})")
    return WeightFile(path, size, len(entries), 8 + n)


def torch_zip(path: Path) -> WeightFile:
    """A `torch.save` zip archive: what `torch.load(mmap=True)` can map."""
    try:
        size = path.stat().st_size
        if not zipfile.is_zipfile(path):
            raise ModelError(f"{path}: not a torch zip checkpoint (torch.load(mmap=True) needs the "
                             "zip format torch.save writes by default)")
        with zipfile.ZipFile(path) as zf:
            storages = sum(1 for i in zf.infolist() if "/data/" in i.filename
                           and i.filename.rsplit("/", 1)[-1].isdigit())
            meta = size - zf.start_dir  # the central directory and its end record
    except OSError as exc:
        raise ModelError(f"{path}: {exc.strerror or exc}") from None
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{path}: not a torch zip checkpoint ({exc})") from None
    return WeightFile(path, size, storages, meta)


def _from_index(index: Path, fmt: str) -> Model:
    data = _read_json(index)
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ModelError(f"{index}: no weight_map in the index")
    names = sorted({str(v) for v in wmap.values()})
    weights = []
    for name in names:
        shard = index.parent / name
        if not shard.is_file():
            raise ModelError(f"{index} names {name}, which is missing")
        weights.append(safetensors_header(shard) if fmt == SAFETENSORS else torch_zip(shard))
    return Model(index.parent, fmt, weights, meta_files=[index], index=index)


def _from_file(path: Path) -> Model:
    name = path.name
    if name.endswith(".safetensors.index.json"):
        return _from_index(path, SAFETENSORS)
    if name.endswith((".bin.index.json", ".pt.index.json")):
        return _from_index(path, TORCH)
    if name.endswith(".safetensors"):
        return Model(path, SAFETENSORS, [safetensors_header(path)])
    if name.endswith(TORCH_SUFFIXES):
        return Model(path, TORCH, [torch_zip(path)])
    raise ModelError(f"{path}: not a model file (expected .safetensors, an index .json, "
                     f"or one of {', '.join(TORCH_SUFFIXES)})")


def _from_dir(path: Path) -> Model:
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise ModelError(f"{path}: {exc.strerror or exc}") from None
    files = [path / n for n in names if (path / n).is_file()]
    jsons = [f for f in files if f.suffix == ".json"]
    model: Model | None = None
    for suffix, fmt in ((".safetensors.index.json", SAFETENSORS), (".bin.index.json", TORCH)):
        index = next((f for f in jsons if f.name.endswith(suffix)), None)
        if index is not None:
            model = _from_index(index, fmt)
            break
    if model is None:
        st = [f for f in files if f.name.endswith(".safetensors")]
        pt = [f for f in files if f.name.endswith(TORCH_SUFFIXES)]
        if st:
            model = Model(path, SAFETENSORS, [safetensors_header(f) for f in st])
        elif pt:
            model = Model(path, TORCH, [torch_zip(f) for f in pt])
        else:
            raise ModelError(f"{path}: no model weights here (looked for *.safetensors, "
                             f"*.safetensors.index.json, *.bin.index.json, "
                             f"{', '.join('*' + s for s in TORCH_SUFFIXES)})")
    model.root = path
    for f in jsons:  # config, tokenizer, generation config: what a server reads too
        if f != model.index:
            _read_json(f)
    model.meta_files = jsons
    return model


def discover(path: Path) -> Model:
    """The model at `path`: a directory, a weight file, or an index JSON."""
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory")
    return _from_dir(path) if path.is_dir() else _from_file(path)
