"""Model load: safetensors.numpy.load_file of a ~1 GiB file through tierfs vs local disk.

  cold: fresh mount, empty tier 1, page cache dropped (whole-object prefetch on open)
  warm: tier 1 kept, page cache dropped      reference: the same file on local disk

With --peers, each installed peer (bench/peers.py) too: cold (fresh mount, empty
disk cache) and warm (disk cache kept), page cache dropped before each.

Usage: python bench/modelload.py [--size 1G] [--runs 3] [--peers]
"""

from __future__ import annotations

import time

import numpy as np
import peers
from common import Bench, MiB, drop_caches, median, parse_args, report
from safetensors.numpy import load_file, save_file

KEY = "models/llm/model.safetensors"
TENSOR = 16 * MiB


def make_model(path, size: int) -> None:
    rng = np.random.default_rng(0)
    n = max(1, size // TENSOR)
    tensors = {f"layers.{i}.weight": rng.standard_normal(TENSOR // 4, dtype=np.float32).reshape(-1, 1024)
               for i in range(n)}
    save_file(tensors, str(path))


def load(path) -> float:
    t = time.perf_counter()
    tensors = load_file(str(path))
    total = sum(a.nbytes for a in tensors.values())
    assert total > 0
    return time.perf_counter() - t


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], 1 << 30, 3)
    with Bench(args, "modelload") as b:
        local = b.work / "model.safetensors"
        make_model(local, args.size)
        size = local.stat().st_size
        b.seed(KEY, local)
        others = peers.select(b)
        res: dict[str, list[float]] = {k: [] for k in (
            "local_cold_s", "local_hot_s", "tierfs_cold_s", "tierfs_warm_s", "tierfs_hot_s",
            "store_bytes_vs_size", *(f"{p.name}_{s}_s" for p in others for s in ("cold", "warm")))}
        for run in range(args.runs):
            drop_caches()
            res["local_cold_s"].append(load(local))
            res["local_hot_s"].append(load(local))
            m = b.mount()
            drop_caches()
            res["tierfs_cold_s"].append(load(m.mountpoint / KEY))
            time.sleep(0.5)
            res["store_bytes_vs_size"].append(b.store_get_bytes(m) / size)
            drop_caches()
            res["tierfs_warm_s"].append(load(m.mountpoint / KEY))
            res["tierfs_hot_s"].append(load(m.mountpoint / KEY))
            b.unmount(m)
            for p in others:
                with peers.mount(b, p) as pm:
                    drop_caches()
                    res[f"{p.name}_cold_s"].append(load(pm.mountpoint / KEY))
                    drop_caches()
                    res[f"{p.name}_warm_s"].append(load(pm.mountpoint / KEY))
            print(f"run {run}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in res.items()))
        med = {k: median(v) for k, v in res.items()}
        ratios = {
            "cold_vs_local_cold": med["tierfs_cold_s"] / med["local_cold_s"],
            "warm_vs_local_cold": med["tierfs_warm_s"] / med["local_cold_s"],
            "hot_vs_local_hot": med["tierfs_hot_s"] / med["local_hot_s"],
        }
        vs_peers = {f"{s}_vs_{p.name}_{s}": med[f"tierfs_{s}_s"] / med[f"{p.name}_{s}_s"]
                    for p in others for s in ("cold", "warm")}
        b.result.update(file_bytes=size, medians=med, raw=res, ratios={**ratios, **vs_peers},
                        mb_per_s={k: size / v / 1e6 for k, v in med.items() if k.endswith("_s")})
        print(f"modelload {size / MiB:.0f} MiB safetensors, median of {args.runs} runs (seconds):")
        report([(k, f"{v:8.2f}") for k, v in med.items()])
        print("time ratios vs local disk (lower is better; 1.0 = local speed):")
        report([(k, f"{v:6.2f}") for k, v in ratios.items()])
        if vs_peers:
            print("time ratios tierfs / peer (below 1: tierfs faster):")
            report([(k, f"{v:6.2f}") for k, v in vs_peers.items()])
        b.save()


if __name__ == "__main__":
    main()
