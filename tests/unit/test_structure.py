"""Design rules of the code layout (DESIGN §8) that a change could quietly break."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_graph():  # scripts/ is not a package: load the tool by its path
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_in_tierfs() -> None:
    tool = _import_graph()
    edges = tool.graph(ROOT / "tierfs")
    assert len(edges) > 30  # the walk saw the package
    assert tool.cycles(edges) == []


def test_fs_only_translates() -> None:
    """fs.py turns FUSE calls into calls of the read path, the write path and the
    tree changes: no policy of its own, so it stays small."""
    lines = (ROOT / "tierfs/fs.py").read_text().count("\n")
    assert lines <= 300, lines
    edges = _import_graph().graph(ROOT / "tierfs")
    below = {m for m in edges if m.startswith(("tierfs.cache", "tierfs.store", "tierfs.writeback",
                                               "tierfs.read"))}
    assert not {m for m in below if "tierfs.fs" in edges[m]}  # data flows one way
