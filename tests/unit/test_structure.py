"""Design rules of the code layout (DESIGN §8) that a change could quietly break."""

from __future__ import annotations

import importlib.util
import re
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
    lines = (ROOT / "tierfs/fuse/fs.py").read_text().count("\n")
    assert lines <= 300, lines
    edges = _import_graph().graph(ROOT / "tierfs")
    below = {m for m in edges if m.startswith(("tierfs.cache", "tierfs.store", "tierfs.writeback",
                                               "tierfs.read"))}
    assert not {m for m in below if "tierfs.fuse.fs" in edges[m]}  # data flows one way


def test_only_fuse_imports_pyfuse3() -> None:
    """The kernel's API stays in tierfs/fuse/ (DESIGN §8): the rest of the daemon
    can be driven, and tested, without a FUSE connection. mount.py, the
    composition root, mounts and serves."""
    importers = set()
    for path in (ROOT / "tierfs").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tierfs/fuse/") or rel == "tierfs/mount.py":
            continue
        if re.search(r"^\s*(import|from)\s+pyfuse3\b", path.read_text(), re.M):
            importers.add(rel)
    assert importers == set()
