"""How the tests wait and what they assert about time (docs/design/layout.md, "Tests"):
no test asserts an upper bound on the wall time something took. On a loaded machine such
a bound fails a correct program; a timeout is shown honoured by what ended the wait (the
exception, the reason a sandbox reports, a count of cycles), a speed by a benchmark's
record. Waiting on a condition with a deadline (helpers.wait_for) is the way to wait.

The check reads every test file with `ast`. A wall-clock duration is an expression that
subtracts from a call of time.monotonic / time.time / time.perf_counter (or a name
assigned from one in the same function); an assert that puts one on the small side of
`<` or `<=` (or the large side of `>`, `>=`) is reported with its file:line. Lower bounds
("not given up before its timeout") stay allowed. The checker is tried on synthetic
sources first, so an empty result cannot come from a checker that sees nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"}
SMALL_SIDE = {ast.Lt: "left", ast.LtE: "left", ast.Gt: "right", ast.GtE: "right"}


def _reads_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLOCKS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "time" for n in ast.walk(node))


def _is_duration(node: ast.AST, durations: set[str]) -> bool:
    """clock() - t0, or a name assigned from one."""
    if isinstance(node, ast.Name):
        return node.id in durations
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _reads_clock(node.left)


def wall_time_bounds(source: str, filename: str = "<test>") -> list[str]:
    """file:line of every assert bounding a wall-clock duration from above."""
    found: list[tuple[str, int]] = []
    tree = ast.parse(source, filename)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        durations = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and _is_duration(n.value, set())
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert):
                continue
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [cmp.left, *cmp.comparators]
                for i, op in enumerate(cmp.ops):
                    side = SMALL_SIDE.get(type(op))
                    if side and _is_duration(operands[i] if side == "left" else operands[i + 1], durations):
                        found.append((filename, node.lineno))
    return [f"{name}:{line}" for name, line in sorted(set(found))]


def test_the_checker_finds_upper_bounds_and_leaves_lower_bounds_and_deadlines():
    bad = """
import time
def test_a():
    t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0
def test_b():
    t0 = time.monotonic()
    took = time.monotonic() - t0
    assert ok and took <= 5, took
def test_c():
    assert 0.25 < time.time() - started < 1.0
def test_d():
    took = time.perf_counter() - t0
    assert 3 > took
"""
    assert wall_time_bounds(bad) == ["<test>:5", "<test>:9", "<test>:11", "<test>:14"]
    good = """
import time
def test_e():
    t0 = time.monotonic()
    assert time.monotonic() - t0 > 0.25
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pass
    assert time.monotonic() < deadline, "condition not met in time"
    assert len(x) < 3 and size_s < 2
"""
    assert wall_time_bounds(good) == []


def test_no_test_asserts_an_upper_bound_on_wall_time():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100  # the tree is read, not an empty glob
    bounds = [b for path in files for b in wall_time_bounds(path.read_text(), str(path.relative_to(TESTS)))]
    assert bounds == [], "\n".join(["upper bounds on wall time (show the timeout by what ended the wait, "
                                    "or measure it in a benchmark):", *bounds])
