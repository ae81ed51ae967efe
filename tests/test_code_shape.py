"""The code's shape, checked from the source: no function outside the tests is longer than MAX_LINES (counted from
its `def` to its last line, decorators excluded), and every function of the planner (amoe/perf/plan) says what its
parameters and its result are."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("amoe", "coordinator", "bench", "tools", "examples", "deploy")
MAX_LINES = 60
PLANNER = REPO / "amoe" / "perf" / "plan"


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of a Python file, nested ones included, in the order they start."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted(found, key=lambda n: n.lineno)


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """ "path:line name (N lines)" of each function under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in functions(path):
            lines = fn.end_lineno - fn.lineno + 1  # lineno is the `def` line: decorators are not counted
            if lines > limit:
                found.append(f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name} ({lines} lines)")
    return found


def untyped(root: Path) -> list[str]:
    """ "path:line name: what is not annotated" of each function under `root` with a parameter (self and cls aside)
    or a result (__init__'s aside) that has no annotation."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in functions(path):
            a = fn.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            missing = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
            if fn.returns is None and fn.name != "__init__":
                missing.append("the result")
            if missing:
                found.append(
                    f"{path.relative_to(root.parents[2])}:{fn.lineno} {fn.name}: {', '.join(missing)}"
                )
    return found


def test_no_function_outside_the_tests_is_over_60_lines():
    long = [f for root in ROOTS if (REPO / root).is_dir() for f in long_functions(REPO / root)]
    assert not long, "split along a real seam (named helpers that say what each part does):\n" + "\n".join(
        long
    )


def test_every_planner_function_annotates_its_parameters_and_result():
    missing = untyped(PLANNER)
    assert not missing, "\n".join(missing)


def test_the_checks_count_from_def_to_the_last_line_and_read_annotations(tmp_path):
    """A planted package: a decorated 61-line function is found (its decorator not counted), a 60-line one and a
    nested one within it are not; an unannotated parameter and result are named, self and __init__'s result are
    not asked for."""
    root = tmp_path / "pkg" / "perf" / "plan"
    root.mkdir(parents=True)
    long_body, fit_body = ("\n".join(f"    x{i} = {i}" for i in range(n)) for n in (59, 55))
    (root / "shape.py").write_text(
        f"import functools\n\n\n@functools.cache\ndef long_one():\n{long_body}\n    return x0\n\n\n"
        f"def just_fits():\n{fit_body}\n    def nested():\n        return 1\n\n    return nested\n"
    )
    assert long_functions(tmp_path / "pkg") == ["pkg/perf/plan/shape.py:5 long_one (61 lines)"]
    assert long_functions(tmp_path / "pkg", limit=59) == [
        "pkg/perf/plan/shape.py:5 long_one (61 lines)",
        "pkg/perf/plan/shape.py:68 just_fits (60 lines)",
    ]
    (root / "shape.py").write_text(
        "class Pool:\n    def __init__(self, n: int):\n        self.n = n\n\n"
        "    def take(self, rows, *, cap: int = 0) -> int:\n        return rows\n\n\n"
        "def free(x: float):\n    return x\n"
    )
    assert untyped(root) == [
        "pkg/perf/plan/shape.py:5 take: rows",
        "pkg/perf/plan/shape.py:9 free: the result",
    ]
