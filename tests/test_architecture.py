"""The shape of the house, checked from the source: no import circles in amoe/ and coordinator/, between modules or
between packages, the coordinator reaches no model code and no torch (however indirectly) and its rooms import one
way, the modelling wing's floors import downwards only and the serving product sees only its cost model, production
code never imports the test harnesses, every class name is defined once, and the light entry points (the API
server, `amoe --help`, `import amoe`) really leave torch unloaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("amoe", "coordinator")
# What the coordinator must never reach: model code and the runtime (docs/serve.md, "The coordinator").
MODEL_CODE = ("amoe.runtime", "amoe.model", "amoe.engine", "amoe.backends", "amoe.core", "amoe.device")
# Who may import the test harnesses (amoe.testing): themselves, and the studies, which drive servers as tests do.
HARNESS_USERS = ("amoe.testing", "amoe.perf.studies")
# The modelling wing's three floors (amoe/perf/__init__.py), each a package of its own in the package graph.
FLOORS = ("amoe.perf.model", "amoe.perf.plan", "amoe.perf.studies")
# The serving product: what serves requests, which may use the cost model and nothing above it.
PRODUCT = (
    "amoe.runtime",
    "amoe.engine",
    "amoe.model",
    "amoe.backends",
    "amoe.serve",
    "amoe.config",
    "coordinator",
)
# (who, what they must never reach): the floors look down only, the product sees only amoe.perf.model, the load
# generator none of the wing. Imports inside functions count; a package's lazy `__getattr__` re-exports do not.
FLOOR_RULES = (
    (PRODUCT, ("amoe.perf.plan", "amoe.perf.studies")),
    (("amoe.perf.model",), ("amoe.perf.plan", "amoe.perf.studies")),
    (("amoe.perf.plan",), ("amoe.perf.studies",)),
    (("amoe.bench",), ("amoe.perf",)),
)


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


def package_of(module: str) -> str:
    """The package a module counts for: its floor of the wing, else its subpackage of amoe (amoe.X), else
    coordinator; a module directly under amoe is a node of its own."""
    for floor in FLOORS:
        if is_under(module, (floor,)):
            return floor
    parts = module.split(".")
    if parts[0] == "coordinator":
        return "coordinator"
    return ".".join(parts[:2]) if parts[0] == "amoe" and len(parts) > 2 else module


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages (package_of): a circle here can close with no single pair of modules."""
    out: dict[str, set[str]] = {}
    for module, targets in edges.items():
        mine = out.setdefault(package_of(module), set())
        mine |= {package_of(w) for w in targets if w in edges and package_of(w) != package_of(module)}
    return out


def floor_violations(edges: dict[str, set[str]], rules=FLOOR_RULES) -> list[str]:
    """Each module of a rule's importers that reaches (however indirectly) what the rule forbids it."""
    bad = []
    for importers, forbidden in rules:
        for module in sorted(m for m in edges if is_under(m, importers)):
            bad += [
                f"{module} reaches {found} (imported by {via})"
                for found, via in reachable(edges, module).items()
                if is_under(found, forbidden)
            ]
    return bad


def test_no_import_circles():
    found = cycles(graph(lazy_exports=True))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_level_circle():
    found = cycles(package_graph(graph(lazy_exports=False)))
    assert not found, "package circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_package_graph_finds_a_circle_no_module_pair_closes():
    """amoe.bench's __init__ imported the planner's commands while a study imported amoe.bench's harness: no module
    circle, a package circle."""
    planted = {
        "amoe.bench": {"amoe.emulation.commands"},
        "amoe.emulation.commands": set(),
        "amoe.emulation.plan_check": {"amoe.bench.calibrate"},
        "amoe.bench.calibrate": set(),
    }
    assert cycles(planted) == []
    assert cycles(package_graph(planted)) == [["amoe.bench", "amoe.emulation"]]
    assert (
        package_of("amoe.perf.plan.simulate.events") == "amoe.perf.plan"
        and package_of("amoe.cli") == "amoe.cli"
    )


def test_the_wings_floors_look_down_and_the_product_sees_only_the_cost_model():
    bad = floor_violations(graph(lazy_exports=False))
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize(
    ("planted", "caught"),
    [
        # the runtime reaching the planner through a module outside the product
        (
            {"amoe.runtime.build": {"amoe.placement"}, "amoe.placement": {"amoe.perf.plan.bounds"}},
            "amoe.runtime.build",
        ),
        ({"coordinator.serving": {"amoe.perf.studies.compare"}}, "coordinator.serving"),
        ({"amoe.config": {"amoe.perf.plan.search"}}, "amoe.config"),
        ({"amoe.perf.model.routing": {"amoe.perf.plan.bounds"}}, "amoe.perf.model.routing"),
        ({"amoe.perf.model.routing": {"amoe.perf.studies.frontier"}}, "amoe.perf.model.routing"),
        ({"amoe.perf.plan.search": {"amoe.perf.studies.commands"}}, "amoe.perf.plan.search"),
        ({"amoe.bench.serve": {"amoe.perf.model.workloads"}}, "amoe.bench.serve"),
    ],
)
def test_each_floor_rule_catches_its_planted_violation(planted, caught):
    edges = {**planted, **{w: set() for ws in planted.values() for w in ws if w not in planted}}
    assert [line.split()[0] for line in floor_violations(edges)] == [caught]
    # ... and the arrows the floors allow are not violations.
    allowed = {
        "amoe.runtime.build": {"amoe.perf.model.links"},
        "amoe.perf.studies.compare": {"amoe.perf.plan.bounds", "amoe.bench.client", "amoe.testing.servers"},
        "amoe.perf.plan.bounds": {"amoe.perf.model.links"},
        "amoe.perf.model.links": set(),
        "amoe.bench.client": set(),
        "amoe.testing.servers": set(),
    }
    assert floor_violations(allowed) == []


def test_imports_inside_functions_count_and_only_a_packages_getattr_is_exempt(tmp_path):
    """A package's lazy `__getattr__` re-export is the one arrow allowed back up a floor; any other import inside a
    function is an import like the rest."""
    package = tmp_path / "__init__.py"
    package.write_text(
        "def __getattr__(name):\n    from amoe.perf.plan import bounds\n\n    return bounds\n\n\n"
        "def f():\n    from amoe.perf.studies import frontier\n"
    )
    known = {"amoe.perf.plan.bounds", "amoe.perf.studies.frontier"}
    assert imports_of(package, "amoe.perf.model", known, lazy_exports=False) == {"amoe.perf.studies.frontier"}
    assert imports_of(package, "amoe.perf.model", known, lazy_exports=True) == known


def test_the_coordinator_reaches_no_model_code_and_no_torch():
    edges = graph(lazy_exports=False)
    bad = []
    for module in sorted(m for m in edges if m.startswith("coordinator")):
        for found, via in reachable(edges, module).items():
            if is_under(found, MODEL_CODE + ("torch",)):
                bad.append(f"{module} reaches {found} (imported by {via})")
    assert not bad, "\n".join(bad[:20])


def test_the_serving_config_does_not_reach_the_modelling():
    """amoe.perf (cost model, simulation, planner) uses the config; the config never imports it back."""
    found = reachable(graph(lazy_exports=True), "amoe.config")
    bad = [f"{m} (imported by {via})" for m, via in found.items() if is_under(m, ("amoe.perf",))]
    assert not bad, "\n".join(bad)


def test_production_code_does_not_import_the_test_harnesses():
    """The studies (amoe.perf.studies) start servers and in-process clusters as the tests do; the product never."""
    edges = graph(lazy_exports=True)
    bad = [
        f"{m} imports {w}"
        for m, targets in edges.items()
        if not is_under(m, HARNESS_USERS)
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
    loaded = _modules_after(
        "import amoe, coordinator.api.app, coordinator.requests.cluster_backend, amoe.serve"
    )
    assert "coordinator.api.app" in loaded and "amoe" in loaded
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


# The coordinator's rooms (docs/serve.md, "The coordinator"), from the top: each may import the rooms below it.
ROOMS = ("coordinator.api", "coordinator.requests", "coordinator.cluster")
COORDINATOR_LEAVES = ("coordinator", "coordinator.metrics")  # beside the rooms: every room may use them


def test_every_coordinator_module_is_in_a_room():
    loose = [
        m
        for m in graph(lazy_exports=True)
        if is_under(m, ("coordinator",)) and m not in COORDINATOR_LEAVES and not is_under(m, ROOMS)
    ]
    assert not loose, "outside the rooms: " + ", ".join(loose)


def room_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a coordinator room (or leaf) into a room above it."""
    bad = []
    for module, targets in sorted(edges.items()):
        if module in COORDINATOR_LEAVES:
            above: tuple[str, ...] = ROOMS
        elif is_under(module, ROOMS):
            room = next(r for r in ROOMS if is_under(module, (r,)))
            above = ROOMS[: ROOMS.index(room)]
        else:
            continue
        bad += [f"{module} imports {w}" for w in sorted(targets) if is_under(w, above)]
    return bad


def test_the_coordinator_rooms_import_one_way():
    """api → requests → cluster, counting imports inside functions; the leaves import no room."""
    bad = room_violations(graph(lazy_exports=True))
    assert not bad, "\n".join(bad)


def test_the_room_rules_catch_an_arrow_back_up():
    edges = {
        "coordinator.cluster.x": {"coordinator.requests.y", "amoe.wire"},
        "coordinator.requests.y": {"coordinator.api.z", "coordinator.cluster.x"},
        "coordinator.metrics": {"coordinator.cluster.x"},
        "coordinator.api.z": {"coordinator.requests.y", "coordinator.cluster.x", "coordinator.metrics"},
    }
    assert room_violations(edges) == [
        "coordinator.cluster.x imports coordinator.requests.y",
        "coordinator.metrics imports coordinator.cluster.x",
        "coordinator.requests.y imports coordinator.api.z",
    ]


def test_the_request_and_cluster_rooms_speak_no_http():
    """Their failures are their own errors; only the API room turns them into statuses and response bodies."""
    edges = graph(lazy_exports=True)
    http = ("fastapi", "starlette", "pydantic", "uvicorn")
    bad = [
        f"{m} imports {w}"
        for m, targets in sorted(edges.items())
        if is_under(m, ROOMS[1:])
        for w in sorted(targets)
        if is_under(w, http)
    ]
    assert not bad, "\n".join(bad)


# Where class names must be unique: every folder of Python the repository holds.
CLASS_FOLDERS = ("amoe", "coordinator", "tests", "bench", "examples", "deploy", "tools")


def class_definitions(root: Path = REPO) -> dict[str, list[str]]:
    """Every class defined anywhere in CLASS_FOLDERS (nested ones too), by name: where each is defined."""
    found: dict[str, list[str]] = {}
    for folder in CLASS_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def repeated_names(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Names defined more than once."""
    return {name: where for name, where in found.items() if len(where) > 1}


def test_every_class_name_is_defined_once():
    repeated = repeated_names(class_definitions())
    assert not repeated, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(repeated.items()))


def test_a_repeated_class_name_is_found(tmp_path):
    (tmp_path / "amoe" / "sub").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "amoe" / "a.py").write_text("class Server:\n    class Chunk:\n        pass\n")
    (tmp_path / "tests" / "b.py").write_text("def f():\n    class Server:\n        pass\n")
    found = class_definitions(tmp_path)
    assert repeated_names(found) == {"Server": ["amoe/a.py:1", "tests/b.py:2"]}
    (tmp_path / "amoe" / "sub" / "c.py").write_text("class Chunk:\n    pass\n")  # a nested class counts too
    assert set(repeated_names(class_definitions(tmp_path))) == {"Server", "Chunk"}
