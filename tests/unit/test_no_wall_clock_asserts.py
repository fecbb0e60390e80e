"""No test asserts a wall-clock bound: on a loaded CI machine any bound flakes.

Tests count requests, bytes, round trips and waits, or check an ordering. The
one exception is a guard that a hang ends: a bound >= 10x the normal time with
a comment containing the word `hang` on the assert's line or the line above.

This walks every module under tests/ and finds comparisons (<, <=, >, >=) in
an `assert`, or in an `if` that raises, where a side comes from a clock:
`time.monotonic()` and its kin, or a name, list or function result computed
from one in the same module. `len()` of such a list is a count, not a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns"}
# Calendar time is data (an mtime moved forward); a difference of it is a duration.
CALENDAR = {"time", "time_ns"}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_clock_call(node: ast.AST, clocks: set[str] = CLOCKS) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in clocks and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in clocks


class _Taint:
    """Names and functions of one module whose values derive from a clock."""

    def __init__(self, tree: ast.Module) -> None:
        self.names: set[tuple[int, str]] = set()  # (scope: a function's id or 0, name)
        self.funcs: dict[str, list[bool] | bool] = {}
        self.scope: dict[int, int] = {}
        self._scopes(tree, 0)
        self._fixpoint(tree)

    def _scopes(self, node: ast.AST, scope: int) -> None:
        for child in ast.iter_child_nodes(node):
            inner = id(child) if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            self.scope[id(child)] = inner
            self._scopes(child, inner)

    def _key(self, node: ast.Name) -> tuple[int, str]:
        return (self.scope.get(id(node), 0), node.id)

    def expr(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        if _is_clock_call(node):
            return True
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                and any(_is_clock_call(side, CALENDAR) for side in (node.left, node.right))):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "len":
                return False  # a count of timed things is a count
            if self.funcs.get(node.func.id) is True:
                return True
        if isinstance(node, ast.Name):
            return self._key(node) in self.names or (0, node.id) in self.names
        return any(self.expr(child) for child in ast.iter_child_nodes(node))

    def _bind(self, target: ast.AST, value: ast.AST | None, tainted: bool | None = None) -> bool:
        """Taint the names `target` binds; element-wise for tuples where the value says."""
        changed = False
        if isinstance(target, ast.Tuple):
            parts = self._parts(value, len(target.elts))
            for i, elt in enumerate(target.elts):
                t = parts[i] if parts is not None else (self.expr(value) if tainted is None else tainted)
                changed |= self._bind(elt, None, t)
            return changed
        if isinstance(target, ast.Name):
            t = self.expr(value) if tainted is None else tainted
            if t and self._key(target) not in self.names:
                self.names.add(self._key(target))
                return True
        return changed

    def _parts(self, value: ast.AST | None, n: int) -> list[bool] | None:
        if isinstance(value, ast.Tuple) and len(value.elts) == n:
            return [self.expr(e) for e in value.elts]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            got = self.funcs.get(value.func.id)
            if isinstance(got, list) and len(got) == n:
                return got
        return None

    def _fixpoint(self, tree: ast.Module) -> None:
        changed = True
        while changed:
            changed = False
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        changed |= self._bind(target, node.value)
                elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
                    changed |= self._bind(node.target, node.value)
                elif isinstance(node, ast.For | ast.comprehension):
                    changed |= self._bind(node.target, None, self.expr(node.iter))
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in {"append", "extend", "add"}
                      and isinstance(node.func.value, ast.Name)
                      and any(self.expr(a) for a in node.args)):
                    changed |= self._bind(node.func.value, None, True)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    changed |= self._func(node)

    def _func(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether `fn`'s result (or each part of a returned tuple) derives from a
        clock; only ever grows, so the fixpoint ends (same-named functions merge)."""
        old = self.funcs.get(fn.name, False)
        new = old
        for r in (n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value):
            if new is True:
                break
            if isinstance(r, ast.Tuple):
                parts = [self.expr(e) for e in r.elts]
                if isinstance(new, list) and len(new) == len(parts):
                    new = [a or b for a, b in zip(new, parts, strict=True)]
                elif isinstance(new, list):
                    new = any(new) or any(parts)
                else:
                    new = parts
            elif self.expr(r):
                new = True
        if new != old:
            self.funcs[fn.name] = new
            return True
        return False


def _raises(body: list[ast.stmt]) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.Raise):
            return True
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "fail"):
            return True
    return False


def clock_comparisons(source: str) -> list[int]:
    """Lines of time comparisons in assertions that no `hang` comment marks."""
    tree = ast.parse(source)
    taint = _Taint(tree)
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assert) or (isinstance(node, ast.If) and _raises(node.body))):
            continue
        test = node.test
        timed = [c for c in ast.walk(test) if isinstance(c, ast.Compare)
                 and any(isinstance(op, ORDERING) for op in c.ops)
                 and any(taint.expr(side) for side in (c.left, *c.comparators))]
        if not timed:
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        around = lines[max(0, first - 2):last]
        if not any("#" in text and "hang" in text.split("#", 1)[1].lower() for text in around):
            found.append(first)
    return found


def test_no_wall_clock_asserts_in_tests() -> None:
    bad = [f"{path.relative_to(TESTS.parent)}:{line}"
           for path in sorted(TESTS.rglob("*.py"))
           for line in clock_comparisons(path.read_text())]
    assert not bad, ("wall-clock comparisons in tests (count or order instead; a hang guard "
                     "says `hang` in a comment on the assert's line or the line above): "
                     + ", ".join(bad))


def test_the_check_sees_what_it_must() -> None:
    """The checker itself: each way a time reaches an assert is caught; counts and
    marked hang guards are not."""
    caught = clock_comparisons(
        "import time\n"
        "t0 = time.monotonic()\n"
        "assert time.monotonic() - t0 < 3\n"                      # 3: direct
        "took = time.monotonic() - t0\n"
        "assert took < 1\n"                                        # 5: through a name
        "def timed():\n"
        "    t = time.perf_counter()\n"
        "    return 0, time.perf_counter() - t\n"
        "code, el = timed()\n"
        "assert code == 0 and el < 1\n"                            # 10: a tuple's part
        "lat = []\n"
        "lat.append(time.perf_counter() - t0)\n"
        "assert max(lat) < 0.5\n"                                  # 13: a list of times
        "assert len(lat) > 100\n"                                  # a count: fine
        "assert code == 0\n"                                       # not the timed part
        "deadline = time.monotonic() + 30\n"
        "# hang guard: never more than 10x the normal time\n"
        "assert time.monotonic() < deadline\n"                     # marked: fine
        "if time.monotonic() > deadline:\n"                        # 19: an if that raises
        "    raise AssertionError('late')\n"
        "while time.monotonic() < deadline:\n"                     # a poll loop: fine
        "    pass\n"
        "now = time.time_ns()\n"
        "assert mtime >= now\n"                                    # a timestamp: fine
        "t1 = time.time()\n"
        "assert time.time() - t1 < 2\n"                            # 26: a duration
    )
    assert caught == [3, 5, 10, 13, 19, 26]
