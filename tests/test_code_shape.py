"""The code's shape, checked from the source: no function outside the tests is longer than MAX_LINES (counted from
its `def` to its last line, decorators excluded), every function of the planner (amoe/perf/plan) says what its
parameters and its result are, and no line or file name cites this project's issue, stop, item, round or PR numbers
(code speaks of the system and cites a design section by its name; another project's issue or PR, named with its
project, is an outside source and may be cited)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("amoe", "coordinator", "bench", "tools", "examples", "deploy")
MAX_LINES = 60
PLANNER = REPO / "amoe" / "perf" / "plan"
# Where numbered citations are looked for: the code's folders, their Python, C++, shell and make files.
CITING_ROOTS = ("amoe", "coordinator", "cpp", "bench", "tests", "tools", "examples", "deploy")
CITING_SUFFIXES = (".py", ".pyi", ".cpp", ".cc", ".h", ".hpp", ".sh", ".mk")
CITING_NAMES = ("Makefile",)
# A citation: issue, stop, item, round or PR (any case, plural or not) not inside a longer word (`_` separates, so
# a name's parts count), then an optional space, `_` or `-`, an optional `#`, and a number.
NUMBERED = re.compile(r"(?<![A-Za-z])(issue|stop|item|round|PR)s?[ _-]?#?(\d+)", re.IGNORECASE)
# Outside projects whose issues and PRs the code cites, spelled as their repositories spell them.
OUTSIDE_PROJECTS = (
    "DeepEP", "DeepGEMM", "EPLB", "FlashMLA", "vLLM", "vllm", "SGLang", "sglang", "PyTorch", "pytorch",
    "transformers", "llguidance", "xgrammar", "NCCL", "TensorRT-LLM",
)  # fmt: skip
# A citation is another project's when that project's name stands right before it ("DeepEP issue #208",
# "vLLM's PR #43219"), or when the same line links that very number on GitHub (github.com/OWNER/REPO/issues/N or
# /pull/N). `--rounds 8` is a command-line flag and its value, not a citation.
_OUTSIDE_BEFORE = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, OUTSIDE_PROJECTS)) + r")(?:'s)? $")
_LINKED = re.compile(r"github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/(\d+)")


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


def numbered_citations(line: str) -> list[str]:
    """The matches on `line` that cite this project's issue, stop, item, round or PR numbers: every NUMBERED match
    but another project's (its name right before the match, or a github.com link to that number on the line) and
    a `--flag N`."""
    linked = set(_LINKED.findall(line))
    found = []
    for m in NUMBERED.finditer(line):
        before = line[: m.start()]
        if _OUTSIDE_BEFORE.search(before) or m.group(2) in linked or before.endswith("--"):
            continue
        found.append(m.group(0))
    return found


def citing_files(repo: Path) -> list[Path]:
    """The files under CITING_ROOTS with a CITING_SUFFIXES suffix or a CITING_NAMES name, and the top Makefile."""
    found = [
        p
        for root in CITING_ROOTS
        if (repo / root).is_dir()
        for p in sorted((repo / root).rglob("*"))
        if p.is_file() and (p.suffix in CITING_SUFFIXES or p.name in CITING_NAMES)
    ]
    return found + [p for p in (repo / name for name in CITING_NAMES) if p.is_file()]


def numbered_in(repo: Path) -> list[str]:
    """ "path:line: text" of each line, and "path: file name" of each file, that cites a number of this project's."""
    found = []
    for path in citing_files(repo):
        rel = path.relative_to(repo)
        if any(numbered_citations(part) for part in rel.parts):
            found.append(f"{rel}: file name")
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if numbered_citations(line):
                found.append(f"{rel}:{i}: {line.strip()}")
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


def test_no_code_comment_or_name_cites_an_issue_stop_item_or_round_number():
    found = numbered_in(REPO)
    assert not found, (
        'cite the design section by its name (docs/PAGE.md "Section"), or say what the thing is:\n'
        + "\n".join(found)
    )


# Planted citations are spelled from parts, so that this file holds none itself.
ISSUE, ITEM, ROUND, STOP, PR = "iss" + "ue", "it" + "em", "rou" + "nd", "st" + "op", "P" + "R"


@pytest.mark.parametrize(
    "line",
    [
        f"x = 1  # served per rank ({ISSUE} 35)",
        f"// {ITEM.title()} 13: the columns are (group, hosted expert)",
        f"# the expert side's {ITEM}s 9-10",
        f"# the expert side's {ITEM}s 9–10",
        f'"""{ROUND.title()} 5\'s structure"""',
        f"def test_{ROUND}3_constants():",
        f"# before {STOP} 51 it ran without one",
        f"# see github.com/owner/repo/{ISSUE}s/12 and ({ISSUE} 35)",
        f"# SGLang's scheduler, as in our {ISSUE} 7",
        f"# an {ISSUE} #3 of ours",
        f"# {PR} 4 added it",
    ],
)
def test_a_planted_citation_of_this_projects_numbers_is_found(line):
    assert numbered_citations(line), line


@pytest.mark.parametrize(
    "line",
    [
        f"* DeepEP {ISSUE} #208 (github.com/deepseek-ai/DeepEP/{ISSUE}s/208: test_low_latency on 8 ranks)",
        f"# DeepEP {ISSUE} #208: the median over 8 ranks",
        f"# as vLLM {PR} #43219 does",
        f"# github.com/vllm-project/vllm/pull/43219 ({ISSUE}d by vLLM: {PR} #43219)",
        f"# fixed upstream (github.com/pytorch/pytorch/{ISSUE}s/1234, {ISSUE} 1234)",
        f"Run: bench/transport.py [--{ROUND}s 8] [--quick]",
        f"# a {ROUND} trip of 3 blocks; a{ROUND} 3 ms; {ROUND}(x, 3); {ROUND}s of 8",
        f"# the {STOP}ping rule stops at batch 10; {ITEM}ised in 4 rows",
    ],
)
def test_another_projects_citation_and_ordinary_words_pass(line):
    assert not numbered_citations(line), numbered_citations(line)


def test_the_scan_names_file_and_line_and_reads_cpp_shell_and_make_files(tmp_path):
    (tmp_path / "cpp").mkdir()
    (tmp_path / "cpp" / "queues.h").write_text(f"int x;\n// {ITEM.title()} 13: groups\n")
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "run.sh").write_text(f"# {STOP} 47\necho ok\n")
    (tmp_path / "Makefile").write_text(f"all:\n\t@echo '{ROUND} 2'\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / f"test_{ROUND}4.py").write_text("x = 1\n")
    (tmp_path / "tests" / "data.json").write_text(f'{{"note": "{ISSUE} 35"}}\n')  # data, not code: not read
    (tmp_path / "amoe").mkdir()
    (tmp_path / "amoe" / "variance.py").write_text(
        f"# DeepEP {ISSUE} #208 (github.com/deepseek-ai/DeepEP/{ISSUE}s/208)\nX = 1  # ({ISSUE} 35)\n"
    )
    assert numbered_in(tmp_path) == [
        "amoe/variance.py:2: " + f"X = 1  # ({ISSUE} 35)",
        "cpp/queues.h:2: " + f"// {ITEM.title()} 13: groups",
        f"tests/test_{ROUND}4.py: file name",
        "deploy/run.sh:1: " + f"# {STOP} 47",
        "Makefile:2: " + f"@echo '{ROUND} 2'",
    ]
