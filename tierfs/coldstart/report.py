"""Printing a cold start: the stage table, its JSON form, and a chart."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tierfs.coldstart.model import ModelError
from tierfs.coldstart.stages import Run, Stage


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _origins(s: Stage) -> str:
    if s.note:
        return s.note
    if not s.origins or not s.nbytes:
        return "-"
    parts = [(k, v) for k, v in s.origins.items() if v >= s.nbytes / 200]  # >= 0.5%
    parts.sort(key=lambda kv: -kv[1])
    return ", ".join(f"{k} {100 * v / s.nbytes:.0f}%" for k, v in parts) or "-"


def where(run: Run) -> str:
    return f"tierfs mount {run.mount}" if run.mount else "not a tierfs mount"


def table(run: Run) -> str:
    m = run.model
    lines = [f"coldstart {run.path}: {m.describe()}, {human(m.weight_bytes)}; {where(run)}; "
             f"device {run.device}",
             f"  {'stage':<12}{'time':>10}{'bytes':>12}{'GB/s':>8}  from"]
    for s in run.stages:
        secs = "-" if s.seconds is None else f"{s.seconds:.3f} s"
        nbytes = "-" if s.seconds is None else human(s.nbytes)
        rate = "-" if s.gbps is None else "<0.01" if s.gbps < 0.01 else f"{s.gbps:.2f}"
        lines.append(f"  {s.name:<12}{secs:>10}{nbytes:>12}{rate:>8}  {_origins(s)}")
    dom = run.dominant
    share = 100 * (dom.seconds or 0.0) / run.total if run.total else 0.0
    lines.append(f"  {'total':<12}{run.total:>8.3f} s{'':>22}dominant: {dom.name} ({share:.0f}%)")
    return "\n".join(lines)


def ratios(run: Run, ref: Run) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for a, b in zip(run.stages, ref.stages, strict=True):
        out[a.name] = a.seconds / b.seconds if a.seconds and b.seconds else None
    out["total"] = run.total / ref.total if ref.total else None
    return out


def compare_table(run: Run, ref: Run) -> str:
    lines = [f"  {'stage':<12}{'this':>10}{'compare':>10}{'ratio':>8}   ({run.path} / {ref.path})"]
    r = ratios(run, ref)
    for a, b in zip(run.stages, ref.stages, strict=True):
        ta = "-" if a.seconds is None else f"{a.seconds:.3f} s"
        tb = "-" if b.seconds is None else f"{b.seconds:.3f} s"
        x = r[a.name]
        lines.append(f"  {a.name:<12}{ta:>10}{tb:>10}{'-' if x is None else f'{x:.2f}x':>8}")
    x = r["total"]
    lines.append(f"  {'total':<12}{run.total:>8.3f} s{ref.total:>8.3f} s"
                 f"{'-' if x is None else f'{x:.2f}x':>8}")
    return "\n".join(lines)


def as_dict(run: Run) -> dict[str, Any]:
    m = run.model
    return {
        "path": str(run.path),
        "format": m.format,
        "files": len(m.weights),
        "tensors": m.tensors,
        "weight_bytes": m.weight_bytes,
        "device": run.device,
        "tierfs_mount": str(run.mount) if run.mount else None,
        "stages": [{"name": s.name, "seconds": s.seconds, "bytes": s.nbytes, "gb_per_s": s.gbps,
                    "from": dict(s.origins), "note": s.note} for s in run.stages],
        "total_s": run.total,
        "dominant": run.dominant.name,
        "loadavg": list(os.getloadavg()),
    }


def report_dict(run: Run, ref: Run | None) -> dict[str, Any]:
    out = as_dict(run)
    if ref is not None:
        out["compare"] = as_dict(ref)
        out["ratios"] = ratios(run, ref)
    return out


def _bar_label(run: Run) -> str:
    name = "/".join(run.path.parts[-2:])
    read = next((s for s in run.stages if s.name == "read"), None)
    origin = f"read: {_origins(read)}" if read is not None else ""
    return f"{name}\n{'tierfs' if run.mount else 'not tierfs'}; {origin}"


def png(runs: list[Run], path: Path) -> None:
    """One horizontal bar per run, split into its stages' times."""
    try:
        import matplotlib
    except ImportError:
        raise ModelError("--png needs matplotlib (pip install 'tierfs[ml]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"discovery": "#7f7f7f", "read": "#1f77b4", "materialize": "#ff7f0e",
              "to-device": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.9 * len(runs)))
    longest = max(r.total for r in runs) or 1.0
    drawn: set[str] = set()
    for i, run in enumerate(runs):
        left = 0.0
        for s in run.stages:
            if not s.seconds:
                continue
            ax.barh(i, s.seconds, left=left, color=colors.get(s.name, "#777777"), height=0.6,
                    label=None if s.name in drawn else s.name)
            drawn.add(s.name)
            if s.seconds > longest * 0.07:
                ax.text(left + s.seconds / 2, i, f"{s.seconds:.2f}s", ha="center", va="center",
                        color="white", fontsize=9)
            left += s.seconds
        ax.text(left, i, f"  {run.total:.2f} s", va="center", fontsize=9)
    ax.set_yticks(range(len(runs)), [_bar_label(r) for r in runs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_xlim(0, longest * 1.15)
    m = runs[0].model
    ax.set_title(f"cold start by stage: {m.describe()}, {human(m.weight_bytes)}, "
                 f"device {runs[0].device}", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.1 / len(runs)), ncols=4,
              fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ModelError(f"--png {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
