"""The shape of the house, checked from the source: no import circles in amoe/ and coordinator/, the coordinator
reaches no model code and no torch (however indirectly), production code never imports the test harnesses, and
the light entry points (the API server, `amoe --help`, `import amoe`) really leave torch unloaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("amoe", "coordinator")
# What the coordinator must never reach: model code and the runtime (docs/serve.md, "The coordinator").
MODEL_CODE = ("amoe.runtime", "amoe.model", "amoe.engine", "amoe.backends", "amoe.core", "amoe.device")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(path: Path, module: str, known: set[str], lazy_exports: bool) -> set[str]:
    """Every module `module` imports, at any depth of its code (a function's import runs when it is called).

    A package's `__getattr__` is a lazy export table (`from amoe import LLM`): its imports run only for those
    names, so they count for circles but, unless `lazy_exports`, not for what merely importing the package reaches.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    skip: set[int] = set()
    if not lazy_exports and path.name == "__init__.py":
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                skip |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return found


def graph(lazy_exports: bool) -> dict[str, set[str]]:
    files = module_files()
    extensions = {"amoe._core"}  # the C++ core: a leaf (setup.py builds it)
    known = set(files) | extensions
    return {m: imports_of(p, m, known, lazy_exports) for m, p in files.items()} | {
        m: set() for m in extensions
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among our own modules (Tarjan's strongly connected components of size > 1)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def reachable(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from `start`, with the module that first imported it (for the error message)."""
    seen, todo = {start: ""}, [start]
    while todo:
        v = todo.pop()
        for w in sorted(edges.get(v, ())):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def is_under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def test_no_import_circles():
    found = cycles(graph(lazy_exports=True))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_coordinator_reaches_no_model_code_and_no_torch():
    edges = graph(lazy_exports=False)
    bad = []
    for module in sorted(m for m in edges if m.startswith("coordinator")):
        for found, via in reachable(edges, module).items():
            if is_under(found, MODEL_CODE + ("torch",)):
                bad.append(f"{module} reaches {found} (imported by {via})")
    assert not bad, "\n".join(bad[:20])


def test_the_serving_config_does_not_reach_the_modelling():
    """amoe.emulation (cost model, simulation, planner) uses the config; the config never imports it back."""
    found = reachable(graph(lazy_exports=True), "amoe.config")
    bad = [f"{m} (imported by {via})" for m, via in found.items() if is_under(m, ("amoe.emulation",))]
    assert not bad, "\n".join(bad)


def test_production_code_does_not_import_the_test_harnesses():
    edges = graph(lazy_exports=True)
    bad = [
        f"{m} imports {w}"
        for m, targets in edges.items()
        if not is_under(m, ("amoe.testing",))
        for w in targets
        if is_under(w, ("amoe.testing",))
    ]
    assert not bad, "\n".join(bad)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    return set(out.stdout.split())


def test_the_api_server_and_import_amoe_leave_torch_out():
    loaded = _modules_after("import amoe, coordinator.api_server, coordinator.cluster_backend, amoe.serve")
    assert "coordinator.api_server" in loaded and "amoe" in loaded
    assert "torch" not in loaded


def test_amoe_help_leaves_torch_out():
    code = (
        "import sys\n"
        "from amoe.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "try:\n"
        "    main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
    )
    loaded = _modules_after(code)
    assert "amoe.cli" in loaded and "torch" not in loaded


def test_finding_the_default_model_leaves_torch_out():
    """`amoe serve` without --model looks the shipped default model up in the coordinator: no torch."""
    code = (
        "from amoe.serve import _model_dir\n"
        "from amoe.config import AmoeConfig\n"
        "from amoe.model.make import DEFAULT_MODEL_DIR\n"
        "assert _model_dir(AmoeConfig()) == DEFAULT_MODEL_DIR\n"
    )
    loaded = _modules_after(code)
    assert "amoe.model.make" in loaded and "torch" not in loaded
