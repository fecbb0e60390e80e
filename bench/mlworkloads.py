"""ML workloads through the real libraries: tierfs vs a local ext4 directory, same run.

Stages (PyTorch CPU, safetensors, webdataset; --size state dict / model, default
1 GiB in 16 MiB fp32 tensors; --shards x --shard-size tar shards, default 8 x 64 MiB):
  write  dcp.save            torch.distributed.checkpoint.save (no process group)
         dcp.async_save      dcp.async_save(...).result(): until done
         torch.save          to model.pt.tmp, fsync, os.replace to model.pt
         safetensors.save    safetensors.torch.save_file
         wds.write           webdataset TarWriter shards
         trainer.save        Hugging Face Trainer's checkpoint as transformers 4.36
                             wrote it: model.safetensors, optimizer.pt (half the
                             state's size), scheduler.pt and trainer_state.json into
                             tmp-checkpoint-500/, then the directory renamed to
                             checkpoint-500/ (the commit point)
  read   dcp.load            into a preallocated state dict
         torch.load          torch.load(mmap=True), every page touched
         safetensors.load    safetensors.torch.load_file (mmap), every page touched
         wds.epoch           DataLoader(WebDataset, num_workers=2), one epoch
Targets, alternating stage by stage (the order swapped every run):
  ext4    a directory in the work dir; reads cold (page cache dropped) and hot
  tierfs  one bucket; writes: time to return, and to `tierfs flush` (in the
          bucket); store requests (PUT incl. multipart requests, COPY, GET, ...)
          during each stage and its flush. Reads: cold (tier 1 emptied after
          `tierfs flush`: a fresh mount with a new cache dir, page cache dropped),
          warm (tier 1 kept, page cache dropped), hot (page cache kept).
  --peers installed rclone/s3fs (bench/peers.py): writes (time to return), reads
          cold (fresh mount, empty disk cache) and warm (disk cache kept).
Beside each measurement: the 1-minute load average and the share of the machine
left idle during it. JSON and a PNG chart in bench/results/.

Other benches reuse the stages: --stages picks some, --tierfs-config mounts tierfs
with a config file (e.g. a class setting or passthrough on/off), --tag names
the result files (mlworkloads-TAG.json/.png).

Usage: python bench/mlworkloads.py [--size 1G] [--runs 3] [--shards 8] [--shard-size 64M]
       [--stages dcp.save,wds.epoch] [--tierfs-config FILE] [--tag NAME] [--peers]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peers
from common import (
    RESULTS,
    Bench,
    MiB,
    _machine_ticks,
    drop_caches,
    median,
    parse_args,
)

from tests.support.mount import TierfsMount
from tierfs.config import parse_size
from tierfs.control import find_socket, request

TENSOR = 16 * MiB
SAMPLE = MiB  # webdataset sample payload


# -- the workloads ------------------------------------------------------------------


@dataclass
class Data:
    """What every run writes: one state dict, one set of shard samples."""

    state: dict[str, Any]
    samples: list[bytes]
    shards: int
    shard_size: int

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())


def make_data(size: int, shards: int, shard_size: int) -> Data:
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(1, size // TENSOR)
    state = {f"layers.{i}.weight": torch.randn(TENSOR // 4 // 2048, 2048, generator=g) for i in range(n)}
    samples = [os.urandom(SAMPLE) for _ in range(max(1, shard_size // SAMPLE))]
    return Data(state, samples, shards, shard_size)


def dcp_save(d: Path, data: Data) -> int:
    import torch.distributed.checkpoint as dcp

    dcp.save(data.state, checkpoint_id=str(d / "dcp"))
    return data.state_bytes


def dcp_async_save(d: Path, data: Data) -> int:
    import torch.distributed.checkpoint as dcp

    dcp.async_save(data.state, checkpoint_id=str(d / "dcp_async")).result()
    return data.state_bytes


def torch_save(d: Path, data: Data) -> int:
    import torch

    tmp, final = d / "model.pt.tmp", d / "model.pt"
    with open(tmp, "wb") as f:
        torch.save(data.state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final.stat().st_size


def safetensors_save(d: Path, data: Data) -> int:
    from safetensors.torch import save_file

    save_file(data.state, str(d / "model.safetensors"))
    return (d / "model.safetensors").stat().st_size


def trainer_save(d: Path, data: Data) -> int:
    import json

    import torch
    from safetensors.torch import save_file

    tmp, final = d / "tmp-checkpoint-500", d / "checkpoint-500"
    tmp.mkdir()
    save_file(data.state, str(tmp / "model.safetensors"))
    names = sorted(data.state)
    torch.save({n: data.state[n] for n in names[: max(1, len(names) // 2)]}, tmp / "optimizer.pt")
    torch.save({"last_epoch": 3}, tmp / "scheduler.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    os.rename(tmp, final)
    return sum(f.stat().st_size for f in final.iterdir())


def wds_write(d: Path, data: Data) -> int:
    import webdataset as wds

    (d / "shards").mkdir(exist_ok=True)
    total = 0
    for s in range(data.shards):
        with wds.TarWriter(str(d / "shards" / f"train-{s:06d}.tar")) as sink:
            for i, payload in enumerate(data.samples):
                sink.write({"__key__": f"{s:06d}_{i:05d}", "bin": payload})
                total += len(payload)
    return total


def _touched(tensors: Any) -> int:
    import torch

    from tierfs.coldstart.stages import touch

    return sum(touch(torch, t) for t in tensors.values())


def dcp_load(d: Path, data: Data) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    target = {k: torch.empty_like(v) for k, v in data.state.items()}
    dcp.load(target, checkpoint_id=str(d / "dcp"))
    return sum(t.nbytes for t in target.values())


def torch_load(d: Path, data: Data) -> int:
    import torch

    return _touched(torch.load(d / "model.pt", mmap=True, weights_only=True))


def safetensors_load(d: Path, data: Data) -> int:
    from safetensors.torch import load_file

    return _touched(load_file(str(d / "model.safetensors")))


def _sample_len(sample: dict[str, Any]) -> int:
    return len(sample["bin"])


def wds_epoch(d: Path, data: Data) -> int:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [str(p) for p in sorted((d / "shards").iterdir())]
    ds = wds.WebDataset(urls, shardshuffle=False).map(_sample_len)
    return sum(DataLoader(ds, batch_size=None, num_workers=2, timeout=600))


Workload = Callable[[Path, Data], int]
WRITES: dict[str, Workload] = {
    "dcp.save": dcp_save,
    "dcp.async_save": dcp_async_save,
    "torch.save": torch_save,
    "safetensors.save": safetensors_save,
    "wds.write": wds_write,
    "trainer.save": trainer_save,
}
READS: dict[str, Workload] = {
    "dcp.load": dcp_load,
    "torch.load": torch_load,
    "safetensors.load": safetensors_load,
    "wds.epoch": wds_epoch,
}


# -- measuring ----------------------------------------------------------------------


def measure(fn: Workload, d: Path, data: Data) -> dict[str, float]:
    """Seconds of one call, its bytes, the load average before it and the share of
    the machine left idle during it."""
    load1 = os.getloadavg()[0]
    idle0, ticks0 = _machine_ticks()
    t = time.perf_counter()
    nbytes = fn(d, data)
    secs = time.perf_counter() - t
    idle1, ticks1 = _machine_ticks()
    return {"s": secs, "bytes": nbytes, "load1": load1,
            "idle": (idle1 - idle0) / max(1, ticks1 - ticks0)}


class Tierfs:
    """The tierfs side: a mount, its control socket, its store request counters."""

    def __init__(self, b: Bench, extra: list[str]) -> None:
        self.b = b
        self.extra = extra
        self.m: TierfsMount = b.mount(None, *extra)

    @property
    def root(self) -> Path:
        return self.m.mountpoint

    def requests(self) -> dict[str, int]:
        reqs = request(find_socket(self.root), "status", timeout=30.0)["store"]["requests"]
        return {op: sum(by.values()) for op, by in reqs.items()}

    def flush(self) -> float:
        t = time.perf_counter()
        request(find_socket(self.root), "flush", timeout=None, prefix="")
        return time.perf_counter() - t

    def go_cold(self) -> None:
        """Tier 1 emptied after a flush (only then): a fresh mount, new cache dir."""
        self.flush()
        self.b.unmount(self.m, wipe=True)
        self.m = self.b.mount(None, *self.extra)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


def summary_requests(d: dict[str, int]) -> dict[str, int]:
    """PUT (plain PUTs and every multipart request: create, part, complete), COPY, GET."""
    return {"PUT": d.get("put", 0) + d.get("multipart", 0), "COPY": d.get("copy", 0),
            "GET": d.get("get", 0)}


def one_run(run: int, b: Bench, t: Tierfs, data: Data, writes: list[str], reads: list[str],
            res: dict[str, list[dict[str, float]]], reqs: dict[str, list[dict[str, int]]]) -> None:
    def rec(key: str, m: dict[str, float]) -> None:
        res.setdefault(key, []).append(m)

    order = ["ext4", "tierfs"] if run % 2 == 0 else ["tierfs", "ext4"]
    name = f"run{run}"
    ld = b.work / "ext4" / name
    ld.mkdir(parents=True)
    (t.root / name).mkdir()
    for stage in writes:
        for target in order:
            drop_caches()
            if target == "ext4":
                rec(f"write/{stage}/ext4", measure(WRITES[stage], ld, data))
                continue
            before = t.requests()
            m = measure(WRITES[stage], t.root / name, data)
            m["until_flushed_s"] = m["s"] + t.flush()
            rec(f"write/{stage}/tierfs", m)
            reqs.setdefault(stage, []).append(delta(t.requests(), before))
    if reads:
        t.go_cold()
    for stage in reads:
        for target in order:
            if target == "ext4":
                drop_caches()
                rec(f"read/{stage}/ext4_cold", measure(READS[stage], ld, data))
                rec(f"read/{stage}/ext4_hot", measure(READS[stage], ld, data))
                continue
            gets = t.requests().get("get", 0)
            drop_caches()
            rec(f"read/{stage}/tierfs_cold", measure(READS[stage], t.root / name, data))
            reqs.setdefault(f"{stage} cold", []).append({"get": t.requests().get("get", 0) - gets})
            drop_caches()
            rec(f"read/{stage}/tierfs_warm", measure(READS[stage], t.root / name, data))
            rec(f"read/{stage}/tierfs_hot", measure(READS[stage], t.root / name, data))
    shutil.rmtree(ld, ignore_errors=True)
    shutil.rmtree(t.root / name, ignore_errors=True)


# The write stage whose files each read stage reads.
WRITTEN_BY = {"dcp.load": "dcp.save", "torch.load": "torch.save",
              "safetensors.load": "safetensors.save", "wds.epoch": "wds.write"}


def peer_run(run: int, b: Bench, peer: peers.Peer, data: Data, writes: list[str], reads: list[str],
             res: dict[str, list[dict[str, float]]]) -> None:
    """The same stages on a peer: writes on one mount; reads cold on a fresh mount
    (empty disk cache), then warm (disk cache kept, page cache dropped)."""
    name = f"{peer.name}-run{run}"
    with peers.mount(b, peer) as pm:
        d = pm.mountpoint / name
        d.mkdir()
        for stage in writes:
            drop_caches()
            res.setdefault(f"write/{stage}/{peer.name}", []).append(measure(WRITES[stage], d, data))
    with peers.mount(b, peer) as pm:
        d = pm.mountpoint / name
        for stage in reads:
            drop_caches()
            res.setdefault(f"read/{stage}/{peer.name}_cold", []).append(measure(READS[stage], d, data))
            drop_caches()
            res.setdefault(f"read/{stage}/{peer.name}_warm", []).append(measure(READS[stage], d, data))
        shutil.rmtree(d, ignore_errors=True)


# -- reporting ----------------------------------------------------------------------


def medians(res: dict[str, list[dict[str, float]]], field: str = "s") -> dict[str, float]:
    return {k: median([m[field] for m in v if field in m]) for k, v in res.items()
            if any(field in m for m in v)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str = "6.2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def tables(med: dict[str, float], flushed: dict[str, float], reqs: dict[str, list[dict[str, int]]],
           writes: list[str], reads: list[str], others: list[str]) -> tuple[str, dict[str, Any]]:
    ratios: dict[str, Any] = {}
    lines = []
    if writes:
        lines.append(f"{'write (s)':<18}{'ext4':>8}{'tierfs':>8}{'ratio':>8}{'flushed':>9}"
                     f"{'ratio':>8}   {'PUT':>4}{'COPY':>5}{'GET':>5}" + "".join(f"{p:>9}" for p in others))
        for st in writes:
            e, tf, fl = (med.get(f"write/{st}/ext4"), med.get(f"write/{st}/tierfs"),
                         flushed.get(f"write/{st}/tierfs"))
            r = summary_requests({op: int(median([d.get(op, 0) for d in reqs.get(st, [])]))
                                  for op in ("put", "multipart", "copy", "get")})
            ratios[f"write/{st}"] = {"tierfs_vs_ext4": ratio(tf, e), "flushed_vs_ext4": ratio(fl, e),
                                     "requests": r,
                                     **{f"{p}_vs_ext4": ratio(med.get(f"write/{st}/{p}"), e)
                                        for p in others}}
            lines.append(f"{st:<18}{fmt(e, '8.2f')}{fmt(tf, '8.2f')}{fmt(ratio(tf, e), '7.2f', 'x')}"
                         f"{fmt(fl, '9.2f')}{fmt(ratio(fl, e), '7.2f', 'x')}   {r['PUT']:>4}"
                         f"{r['COPY']:>5}{r['GET']:>5}"
                         + "".join(fmt(med.get(f"write/{st}/{p}"), "9.2f") for p in others))
    if reads:
        peer_cols = "".join(f"{p + ' ' + s:>13}" for p in others for s in ("cold", "warm"))
        lines.append("")
        lines.append(f"{'read (s)':<18}{'ext4 cold':>10}{'hot':>7}{'tierfs cold':>12}{'warm':>7}"
                     f"{'hot':>7}   {'cold/e4c':>8}{'warm/e4c':>9}{'hot/e4h':>8}{'GETs':>6}" + peer_cols)
        for st in reads:
            ec, eh = med.get(f"read/{st}/ext4_cold"), med.get(f"read/{st}/ext4_hot")
            c, w, h = (med.get(f"read/{st}/tierfs_{s}") for s in ("cold", "warm", "hot"))
            gets = int(median([d["get"] for d in reqs.get(f"{st} cold", [])] or [0]))
            ratios[f"read/{st}"] = {"cold_vs_ext4_cold": ratio(c, ec), "warm_vs_ext4_cold": ratio(w, ec),
                                    "hot_vs_ext4_hot": ratio(h, eh), "cold_gets": gets,
                                    **{f"{p}_{s}_vs_ext4_cold": ratio(med.get(f"read/{st}/{p}_{s}"), ec)
                                       for p in others for s in ("cold", "warm")}}
            lines.append(f"{st:<18}{fmt(ec, '10.2f')}{fmt(eh, '7.2f')}{fmt(c, '12.2f')}{fmt(w, '7.2f')}"
                         f"{fmt(h, '7.2f')}   {fmt(ratio(c, ec), '7.2f', 'x')}{fmt(ratio(w, ec), '8.2f', 'x')}"
                         f"{fmt(ratio(h, eh), '7.2f', 'x')}{gets:>6}"
                         + "".join(fmt(med.get(f"read/{st}/{p}_{s}"), "13.2f")
                                   for p in others for s in ("cold", "warm")))
    return "\n".join(lines), ratios


def chart(med: dict[str, float], flushed: dict[str, float], writes: list[str], reads: list[str],
          others: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, s) for k, s in (("write", writes), ("read", reads)) if s]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, (kind, stages) in zip(axes[0], panels, strict=True):
        if kind == "write":
            series = [("ext4", lambda st: med.get(f"write/{st}/ext4")),
                      ("tierfs (return)", lambda st: med.get(f"write/{st}/tierfs")),
                      ("tierfs (flushed)", lambda st: flushed.get(f"write/{st}/tierfs")),
                      *((p, lambda st, p=p: med.get(f"write/{st}/{p}")) for p in others)]
        else:
            series = [("ext4 cold", lambda st: med.get(f"read/{st}/ext4_cold")),
                      ("ext4 hot", lambda st: med.get(f"read/{st}/ext4_hot")),
                      *((f"tierfs {s}", lambda st, s=s: med.get(f"read/{st}/tierfs_{s}"))
                        for s in ("cold", "warm", "hot")),
                      *((f"{p} {s}", lambda st, p=p, s=s: med.get(f"read/{st}/{p}_{s}"))
                        for p in others for s in ("cold", "warm"))]
        width = 0.8 / len(series)
        for i, (label, get) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(stages))]
            ys = [get(st) or 0.0 for st in stages]
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
        ax.set_xticks(range(len(stages)), stages, fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{kind}s", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", type=int, default=8, help="webdataset shards (default 8)")
    p.add_argument("--shard-size", type=parse_size, default=64 * MiB, help="bytes per shard (default 64M)")
    p.add_argument("--stages", default=",".join([*WRITES, *READS]),
                   help="comma-separated stages to run (default: all)")
    p.add_argument("--tierfs-config", metavar="FILE", help="mount tierfs with this config file")
    p.add_argument("--tag", help="suffix of the result files: mlworkloads-TAG.json/.png")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3, extra_args)
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in WRITES and s not in READS]
    if unknown:
        raise SystemExit(f"mlworkloads: unknown stage(s) {', '.join(unknown)}; known: "
                         f"{', '.join([*WRITES, *READS])}")
    reads = [s for s in READS if s in chosen]
    # A read stage reads what its write stage wrote in the same run: that one runs too.
    writes = [s for s in WRITES if s in chosen or s in {WRITTEN_BY[r] for r in reads}]
    name = f"mlworkloads-{args.tag}" if args.tag else "mlworkloads"
    with Bench(args, name) as b:
        data = make_data(args.size, args.shards, args.shard_size)
        others = peers.select(b)
        extra = ["--config", os.path.abspath(args.tierfs_config)] if args.tierfs_config else []
        t = Tierfs(b, extra)
        res: dict[str, list[dict[str, float]]] = {}
        reqs: dict[str, list[dict[str, int]]] = {}
        loads = []
        for run in range(args.runs):
            loads.append(os.getloadavg())
            one_run(run, b, t, data, writes, reads, res, reqs)
            for p in others:
                peer_run(run, b, p, data, writes, reads, res)
            print(f"run {run}: load {loads[-1][0]:.2f}; " + ", ".join(
                f"{k.split('/', 1)[1]}={v[-1]['s']:.2f}" for k, v in res.items()), flush=True)
        med = medians(res)
        flushed = medians(res, "until_flushed_s")
        head = (f"mlworkloads: {data.state_bytes / MiB:.0f} MiB state dict, {args.shards} x "
                f"{args.shard_size / MiB:.0f} MiB shards; median of {args.runs} runs; 1-min load "
                f"at each run's start: {', '.join(f'{x[0]:.2f}' for x in loads)}")
        text, ratios = tables(med, flushed, reqs, writes, reads, [p.name for p in others])
        print(head)
        print("ratios are tierfs / ext4 time (lower is better; 1.00 = local disk). flushed: until "
              "`tierfs flush` returned (in the bucket). PUT counts multipart requests.")
        print(text)
        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / f"{name}.png"
        chart(med, flushed, writes, reads, [p.name for p in others], head, png)
        print(f"chart: {png}")
        b.result.update(state_bytes=data.state_bytes, shards=args.shards, shard_size=args.shard_size,
                        stages=chosen, tierfs_config=args.tierfs_config, loadavg_per_run=loads,
                        medians=med, until_flushed=flushed, ratios=ratios, requests=reqs, raw=res)
        b.save()


if __name__ == "__main__":
    main()
