"""Design rules of the code layout (DESIGN §8) that a change could quietly break."""

from __future__ import annotations

import ast
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
    can be driven, and tested, without a FUSE connection (the composition root
    too: fuse/session.py holds the session it opens)."""
    importers = set()
    for path in (ROOT / "tierfs").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tierfs/fuse/"):
            continue
        if re.search(r"^\s*(import|from)\s+pyfuse3\b", path.read_text(), re.M):
            importers.add(rel)
    assert importers == set()


def _assignments(path: Path) -> list[tuple[int, ast.expr, ast.Attribute]]:
    """(line, value, target) of every assignment to an attribute of something other
    than `self`/`cls` in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and not (
                        isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    out.append((node.lineno, value, t))
    return out


def _is_callback(value: ast.expr, target: ast.Attribute) -> bool:
    call = isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
    partial = call and getattr(value.func, "id", getattr(value.func, "attr", "")) == "partial"  # type: ignore[union-attr]
    return isinstance(value, ast.Lambda) or partial or target.attr.startswith("on_")


# Callbacks still patched in outside the composition root: none (a new one fails
# the test).
STILL_PATCHED: set[str] = set()


def test_no_callback_is_patched_onto_another_object() -> None:
    """Data flows one way (DESIGN §8): what comes back up is a return value or an
    event wired in mount.py (events.py), never a callable assigned to another
    object's attribute after it was made (a lambda, a partial, an `on_*`)."""
    found = set()
    for path in sorted((ROOT / "tierfs").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for _, value, target in _assignments(path):
            if _is_callback(value, target):
                found.add(f"{rel}: {ast.unparse(target)}")
    assert found == STILL_PATCHED


# The fields of a pending file's state machine (writeback/pending.py), by names
# nothing else in tierfs uses for an attribute.
STATE_FIELDS = {"state", "outcome", "sealed_at", "version", "landed_version", "fresh",
                "sessions", "mtime_ns", "upload_cancellable", "upload_ended", "uploaded",
                "nudged", "barrier", "condition", "record", "moving", "through_failed",
                "unlinked", "local", "renaming"}


def test_a_pending_file_changes_only_through_its_transitions() -> None:
    """One owner for a pending file: its state and fields are assigned in
    pending.py only (its transition methods); everyone else calls those."""
    outside = []
    for path in sorted((ROOT / "tierfs").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tierfs/writeback/pending.py":
            continue
        outside += [f"{rel}:{line}: {ast.unparse(t)}" for line, _, t in _assignments(path)
                    if t.attr in STATE_FIELDS]
    assert outside == []


MAX_CLASS_LINES = 450
MAX_CLASS_METHODS = 40


def test_no_class_is_too_big() -> None:
    """No class over 450 lines or 40 methods: a class that big holds more than one
    thing (issue 33)."""
    over = {}
    for path in sorted((ROOT / "tierfs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                              for b in node.body)
                if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                    over[node.name] = (lines, methods)
    assert over == {}


def test_entry_is_its_faces_not_a_god_class() -> None:
    """The Entry (cache/objects.py) and the core its faces share stay small: what
    read/ and writeback/ do to tier 1 lives in the faces (issue 33: <= 400 lines)."""
    for path, name in (("tierfs/cache/objects.py", "Entry"), ("tierfs/cache/core.py", "EntryCore")):
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ClassDef) and node.name == name:
                assert node.end_lineno is not None
                assert node.end_lineno - node.lineno + 1 <= 400, name
