"""The chain of a model load, each stage timed on its own.

1. discovery: listing, index/config JSON, safetensors headers (model.discover).
2. read: every weight file read sequentially into the page cache, as fast as
   the storage below gives it (16 MiB reads, one file after another).
3. materialize: tensors built in host memory the way servers load them
   (safetensors `safe_open`; `torch.load(mmap=True)`), every page of every
   tensor touched, as the first forward pass would.
4. to-device: each tensor copied to the accelerator (skipped on cpu: the
   tensors are used where they are).

A loader that only maps the files interleaves 2 and 3 through page faults;
reading first separates what the storage costs from what deserializing costs.
PyTorch is imported here only, so the rest of tierfs works without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tierfs.coldstart.model import SAFETENSORS, Model, ModelError, discover
from tierfs.coldstart.tiers import PAGE, Sources

READ_SIZE = 16 << 20
STAGES = ("discovery", "read", "materialize", "to-device")


class Progress(Protocol):
    def begin(self, stage: str, total: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def end(self) -> None: ...


class NoProgress:
    def begin(self, stage: str, total: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class Stage:
    name: str
    seconds: float | None  # None: skipped (see note)
    nbytes: int
    origins: dict[str, int] = field(default_factory=dict)  # origin -> bytes (tiers.py)
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds and self.nbytes else None


@dataclass
class Run:
    path: Path
    model: Model
    device: str
    mount: Path | None  # the tierfs mount the path lies on
    stages: list[Stage]

    @property
    def total(self) -> float:
        return sum(s.seconds or 0.0 for s in self.stages)

    @property
    def dominant(self) -> Stage:
        return max(self.stages, key=lambda s: s.seconds or 0.0)


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModelError(f"coldstart needs PyTorch to materialize tensors ({exc}); install it with "
                         "pip install 'tierfs[ml]' (pins torch==2.13.0)") from None
    return torch


def import_safetensors() -> Any:
    """safetensors' PyTorch loader, or None when it is not installed."""
    try:
        import safetensors.torch  # noqa: F401 (loads the torch bindings now, not in a stage)
        from safetensors import safe_open
    except ImportError:
        return None
    return safe_open


def resolve_device(torch: Any, requested: str | None) -> str:
    cuda = bool(torch.cuda.is_available())
    if requested == "cuda" and not cuda:
        raise ModelError(f"--device cuda: CUDA is not available to this PyTorch ({torch.__version__})")
    return requested or ("cuda" if cuda else "cpu")


def touch(torch: Any, t: Any) -> int:
    """Fault in every page of a tensor's bytes (one byte read per page); returns its bytes."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        u8 = t.reshape(-1).view(torch.uint8)
    else:  # a strided view: its whole storage backs it
        u8 = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    int(u8[::PAGE].sum()) + int(u8[-1])
    return int(u8.numel())


def _tensors(torch: Any, obj: Any) -> list[Any]:
    """Every tensor in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(torch, v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(torch, v)]
    return []


def _read(files: list[Path], progress: Progress) -> int:
    buf = memoryview(bytearray(READ_SIZE))
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := os.readv(fd, [buf]):
                total += n
                progress.advance(n)
        finally:
            os.close(fd)
    return total


def _materialize(torch: Any, safe_open: Any, model: Model, progress: Progress) -> tuple[list[Any], int]:
    tensors: list[Any] = []
    seen: set[tuple[int, int]] = set()
    total = 0
    for w in model.weights:
        if model.format == SAFETENSORS:
            with safe_open(str(w.path), framework="pt", device="cpu") as f:
                loaded = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (not a dict)
        else:
            try:
                loaded = _tensors(torch, torch.load(w.path, mmap=True, map_location="cpu",
                                                    weights_only=True))
            except Exception as exc:  # torch raises RuntimeError/UnpicklingError/...
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ModelError(f"{w.path}: torch.load(mmap=True) failed: {first}") from None
        for t in loaded:
            ident = (t.data_ptr(), t.nbytes)
            if ident in seen:
                continue  # tied weights: one storage, counted once
            seen.add(ident)
            n = touch(torch, t)
            total += n
            progress.advance(n)
            tensors.append(t)
    return tensors, total


def _to_device(torch: Any, tensors: list[Any], device: str, progress: Progress) -> tuple[list[Any], int]:
    placed = []
    for t in tensors:
        placed.append(t.to(device))
        progress.advance(t.nbytes)
    torch.cuda.synchronize()  # the copies are asynchronous: done only now
    return placed, sum(t.nbytes for t in tensors)


def _stage(name: str, sources: Sources, files: list[Path] | None, total: int, progress: Progress,
           work: Callable[[], tuple[Any, int]]) -> tuple[Stage, Any]:
    """Time `work` (which returns its result and the bytes it moved) as one stage."""
    progress.begin(name, total)
    with sources.stage(files) as split:
        t = time.perf_counter()
        result, split.nbytes = work()
        secs = time.perf_counter() - t
    progress.end()
    return Stage(name, secs, split.nbytes, split.origins), result


def coldstart(path: Path, device: str | None = None, progress: Progress | None = None) -> Run:
    """Load the model at `path` through the four stages; raises ModelError on bad input."""
    bar = progress or NoProgress()
    # Imported before the clock starts: on a tierfs mount, discovery's opens start
    # the whole-object prefetch, which would otherwise get the import's seconds free.
    torch = import_torch()
    safe_open = import_safetensors()
    dev = resolve_device(torch, device)
    sources = Sources(path)

    def discovery() -> tuple[Model, int]:
        found = discover(path)
        return found, found.discovery_bytes

    found, model = _stage("discovery", sources, None, 0, bar, discovery)
    if model.format == SAFETENSORS and safe_open is None:
        raise ModelError("coldstart needs safetensors to load this model: pip install 'tierfs[ml]'")
    files = [w.path for w in model.weights]
    read, _ = _stage("read", sources, files, model.weight_bytes, bar,
                     lambda: (None, _read(files, bar)))
    made, tensors = _stage("materialize", sources, files, model.weight_bytes, bar,
                           lambda: _materialize(torch, safe_open, model, bar))
    if dev == "cpu":
        moved = Stage("to-device", None, 0, note="device cpu: tensors stay in host memory")
    else:
        torch.cuda.synchronize()
        moved, _ = _stage("to-device", sources, None, made.nbytes, bar,
                          lambda: _to_device(torch, tensors, dev, bar))
        moved.origins = {"host memory": moved.nbytes}
    return Run(path, model, dev, sources.mount, [found, read, made, moved])
