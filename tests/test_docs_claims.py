"""The README's "Where it has run" table stays in step with the GPU suite, and the manual's links and sizes hold.

The table says, per capability, where it has run (CPU, emulated, simulated, never, or GPU) and which tests under
tests/gpu would show it on a GPU, with their status: `not run`, `passed` or `failed`. Its rules:
- a test the table names exists under tests/gpu and is marked `gpu`; every test function there appears in a row;
- a row that says GPU where it has run names its GPU tests, and they all passed;
- until a GPU check's results are committed (experiments/<date>-gpu-check/gpu_check.json, per-step outcomes
  passed | failed | skipped), every GPU test is `not run` and no row says GPU; once they are, each named test's
  status is its outcome there (skipped reads as `not run`).

The checkers are plain functions over text, so each rule is also run on a synthetic table it must reject.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_TESTS = REPO / "tests" / "gpu"
TABLE_HEADING = "## Where it has run"
STATUSES = ("not run", "passed", "failed")
OUTCOME_STATUS = {"passed": "passed", "failed": "failed", "skipped": "not run"}
MAX_PAGE_LINES = 400
MAX_FINDINGS_LINES = 150


def table_rows(readme: str) -> list[dict[str, str]]:
    """The rows of the first table under the heading, keyed by lower-cased column name."""
    lines = readme.splitlines()
    try:
        start = lines.index(TABLE_HEADING)
    except ValueError:
        return []
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            break
    if not rows:
        return []
    header = [h.lower() for h in rows[0]]
    return [dict(zip(header, r)) for r in rows[1:]]


def gpu_suite(root: Path) -> dict[str, bool]:
    """Test function name → whether it is marked `gpu` (by its module's pytestmark or its own decorator)."""

    def marks_gpu(node: ast.AST | None) -> bool:
        return node is not None and any(
            isinstance(n, ast.Attribute) and n.attr == "gpu" and "mark" in ast.unparse(n.value)
            for n in ast.walk(node)
        )

    found: dict[str, bool] = {}
    for path in sorted(root.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_mark = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and marks_gpu(n.value)
            for n in tree.body
        )
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_"):
                found[n.name] = module_mark or any(marks_gpu(d) for d in n.decorator_list)
    return found


def gpu_cell(cell: str) -> tuple[str | None, list[str]]:
    """(status, tests) of a GPU-suite cell: `—` is (None, []); else `STATUS: \\`test_a\\`, \\`test_b\\``."""
    names = re.findall(r"`(test_\w+)`", cell)
    status = next((s for s in STATUSES if cell.lower().startswith(s + ":")), None)
    return status, names


def outcomes(results: dict | list) -> dict[str, str]:
    """Step name → outcome of a GPU check's results: {"steps": [{"name"|"test"|"nodeid": .., "outcome"|"status": ..}]},
    {"steps": {name: outcome}}, or the list / mapping itself."""
    steps = results.get("steps", results) if isinstance(results, dict) else results
    if isinstance(steps, dict):
        return {
            str(k): str(v.get("outcome", v.get("status")) if isinstance(v, dict) else v)
            for k, v in steps.items()
        }
    out = {}
    for step in steps:
        name = step.get("name") or step.get("test") or step.get("nodeid") or step.get("step")
        out[str(name)] = str(step.get("outcome") or step.get("status") or step.get("result"))
    return out


def outcome_of(test: str, steps: dict[str, str]) -> str:
    """A test's outcome over every step that names it (parametrised cases included): failed if any failed, passed
    if all passed, else skipped."""
    mine = [o for name, o in steps.items() if re.search(rf"(^|::|/|\s){re.escape(test)}(\[|$|\s)", name)]
    if any(o == "failed" for o in mine):
        return "failed"
    if mine and all(o == "passed" for o in mine):
        return "passed"
    return "skipped"


def check_table(
    rows: list[dict[str, str]], suite: dict[str, bool], steps: dict[str, str] | None
) -> list[str]:
    """Every way the table and the GPU suite (and its results, when committed) disagree, one line each."""
    problems = []
    if not rows:
        return [f'the README has no table under "{TABLE_HEADING}"']
    named: set[str] = set()
    for row in rows:
        what = row.get("capability", "?")
        status, tests = gpu_cell(row.get("gpu suite", ""))
        claims_gpu = re.search(r"\bGPU\b", row.get("where it has run", "")) is not None
        named.update(tests)
        if tests and status is None:
            problems.append(f"{what}: its GPU cell names tests without a status ({', '.join(STATUSES)})")
        if claims_gpu and not tests:
            problems.append(f"{what}: says it ran on a GPU but names no test under tests/gpu")
        for test in tests:
            if test not in suite:
                problems.append(f"{what}: {test} is not a test function under tests/gpu")
            elif not suite[test]:
                problems.append(f"{what}: {test} is not marked gpu")
        if steps is None:
            if status not in (None, "not run"):
                problems.append(f"{what}: says {status} on a GPU, but no GPU check's results are committed")
            if claims_gpu:
                problems.append(
                    f"{what}: says GPU where it has run, but no GPU check's results are committed"
                )
            continue
        for test in tests:
            expected = OUTCOME_STATUS.get(outcome_of(test, steps), "not run")
            if status != expected:
                problems.append(f"{what}: {test} is '{status}' in the table, '{expected}' in the GPU check")
        if claims_gpu and status != "passed":
            problems.append(f"{what}: says GPU where it has run, but its GPU tests did not all pass")
    for test in sorted(set(suite) - named):
        problems.append(f"tests/gpu's {test} is in no row of the table")
    return problems


def gpu_check_steps(root: Path) -> dict[str, str] | None:
    """The latest committed GPU check's per-step outcomes, or None when there is none."""
    files = sorted(root.glob("experiments/*-gpu-check/gpu_check.json"))
    return outcomes(json.loads(files[-1].read_text())) if files else None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, text: str, root: Path) -> list[str]:
    """Each relative `](target)` link of a Markdown file whose file, or whose #anchor in it, does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: ({target})"
        if not dest.exists():
            problems.append(f"{where} links to a file that does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{where} links to a heading that does not exist")
    return problems


def missing_paths(path: Path, text: str, root: Path) -> list[str]:
    """Each page or experiments folder a Markdown file names in plain text (docs/X.md, experiments/DATE-TOPIC) that
    does not exist, taken from the repository root."""
    named = re.findall(r"(?<![\w/.])((?:docs/[\w-]+\.md)|(?:experiments/20\d\d-\d\d-\d\d-[\w-]+))", text)
    return [
        f"{path.relative_to(root)}: names {n}, which does not exist"
        for n in sorted(set(named))
        if not (root / n).exists()
    ]


def manual_pages(root: Path) -> list[Path]:
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted(root.glob("experiments/**/README.md")),
    ]


# The real files.


def test_the_where_it_has_run_table_is_in_step_with_the_gpu_suite():
    rows = table_rows((REPO / "README.md").read_text())
    suite = gpu_suite(GPU_TESTS)
    assert suite, "no test functions found under tests/gpu"
    problems = check_table(rows, suite, gpu_check_steps(REPO))
    assert not problems, "\n".join(problems)


def test_every_relative_link_of_the_manual_resolves():
    problems = [p for page in manual_pages(REPO) for p in broken_links(page, page.read_text(), REPO)]
    assert not problems, "\n".join(problems)


def test_every_page_and_experiments_folder_the_manual_names_exists():
    problems = [p for page in manual_pages(REPO) for p in missing_paths(page, page.read_text(), REPO)]
    assert not problems, "\n".join(problems)


def test_manual_pages_stay_short():
    long = [
        f"{page.relative_to(REPO)}: {n} lines (at most {limit})"
        for page in sorted((REPO / "docs").glob("*.md"))
        for n, limit in [
            (
                len(page.read_text().splitlines()),
                MAX_FINDINGS_LINES if page.name == "findings.md" else MAX_PAGE_LINES,
            )
        ]
        if n > limit
    ]
    assert not long, "\n".join(long)


def test_every_experiments_folder_the_findings_cite_exists_with_its_readme_and_no_code():
    cited = set(re.findall(r"\b(20\d\d-\d\d-\d\d-[a-z0-9-]+)\b", (REPO / "docs" / "findings.md").read_text()))
    folders = {p.name for p in (REPO / "experiments").iterdir() if p.is_dir()}
    assert cited, "the findings cite no experiments folder"
    assert not cited - folders, f"cited but missing: {sorted(cited - folders)}"
    assert not [f for f in folders if not (REPO / "experiments" / f / "README.md").exists()], (
        "a folder lacks its README"
    )
    assert not list((REPO / "experiments").rglob("*.py")), "experiments/ holds data, not code"


def test_no_code_under_docs():
    code = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*") if p.suffix in (".py", ".patch")
    )
    assert not code, "\n".join(code)


def _defaults(parser: argparse.ArgumentParser, prefix: str = "amoe") -> dict[str, object]:
    """Every option default of `parser` and its subcommands, keyed "amoe bench plan-table --out"."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _defaults(sub, f"{prefix} {name}")
        elif action.option_strings:
            found[f"{prefix} {action.option_strings[-1]}"] = action.default
    return found


def test_no_command_writes_into_docs_by_default_and_the_studies_write_dated_runs():
    """docs/ holds the manual: no command's default path points into it. The studies that record runs write a
    new experiments/<date>-<topic> folder (the date of the run, UTC)."""
    from amoe.cli import build_parser

    defaults = _defaults(build_parser())
    into_docs = [k for k, v in defaults.items() if isinstance(v, str) and v.strip("./").startswith("docs")]
    assert not into_docs, into_docs
    today = datetime.datetime.now(datetime.timezone.utc).date()
    for command, topic in (("plan-table", "plan-table"), ("plan-scale", "plan-scale"), ("frontier", "frontier"),
                           ("policies", "policies")):  # fmt: skip
        out = defaults[f"amoe bench {command} --out"]
        m = re.fullmatch(rf"experiments/(\d{{4}}-\d{{2}}-\d{{2}})-{topic}", out)
        assert m, (command, out)
        assert abs((datetime.date.fromisoformat(m.group(1)) - today).days) <= 1, out  # a run across midnight


# The checkers on planted inconsistencies.

SUITE = {"test_nccl_transfer": True, "test_exact": True, "test_unmarked": False}
HEADER = "| capability | where it has run | shown by | GPU suite |\n| --- | --- | --- | --- |\n"


def synthetic(*rows: str) -> list[dict[str, str]]:
    return table_rows(f"# x\n\n{TABLE_HEADING}\n\nintro\n\n{HEADER}" + "\n".join(rows) + "\n\n## Next\n")


GOOD = (
    "| NCCL | never | — | not run: `test_nccl_transfer` |",
    "| exactness | CPU | tests/test_x.py | not run: `test_exact` |",
    "| unmarked | never | — | not run: `test_unmarked` |",
)


def test_a_consistent_synthetic_table_passes_but_the_unmarked_test():
    assert check_table(synthetic(*GOOD), SUITE, None) == ["unmarked: test_unmarked is not marked gpu"]


@pytest.mark.parametrize(
    "row, expected",
    [
        ("| NCCL | never | — | passed: `test_nccl_transfer` |", "says passed on a GPU, but no GPU check"),
        ("| NCCL | GPU | — | not run: `test_nccl_transfer` |", "says GPU where it has run, but no GPU check"),
        ("| NCCL | CPU, GPU | — | — |", "says it ran on a GPU but names no test"),
        ("| NCCL | never | — | not run: `test_gone` |", "test_gone is not a test function under tests/gpu"),
        ("| NCCL | never | — | `test_nccl_transfer` |", "names tests without a status"),
    ],
)
def test_a_planted_inconsistency_is_reported(row, expected):
    problems = check_table(synthetic(row, *GOOD[1:]), SUITE, None)
    assert any(expected in p for p in problems), problems


def test_a_gpu_test_in_no_row_is_reported():
    problems = check_table(synthetic(*GOOD[1:]), SUITE, None)
    assert "tests/gpu's test_nccl_transfer is in no row of the table" in problems


def test_no_table_is_reported():
    assert check_table(table_rows("# README\n\nno table\n"), SUITE, None) != []


@pytest.mark.parametrize(
    "results",
    [
        {"steps": [{"name": "tests/gpu/test_n.py::test_nccl_transfer", "outcome": "passed"}]},
        {"steps": {"tests/gpu/test_n.py::test_nccl_transfer": "passed"}},
        [{"nodeid": "tests/gpu/test_n.py::test_nccl_transfer", "status": "passed"}],
    ],
)
def test_once_a_gpu_check_passed_a_row_may_say_gpu_for_what_passed_there(results):
    steps = outcomes(results)
    ok = synthetic("| NCCL | GPU | — | passed: `test_nccl_transfer` |", *GOOD[1:])
    assert [p for p in check_table(ok, SUITE, steps) if "unmarked" not in p] == []
    stale = synthetic("| NCCL | never | — | not run: `test_nccl_transfer` |", *GOOD[1:])
    assert any("'not run' in the table, 'passed'" in p for p in check_table(stale, SUITE, steps))
    overclaim = synthetic(*GOOD[:1], "| exactness | CPU, GPU | — | passed: `test_exact` |", GOOD[2])
    assert any(
        "test_exact is 'passed' in the table, 'not run'" in p for p in check_table(overclaim, SUITE, steps)
    )


def test_a_failed_or_partly_failed_gpu_test_cannot_be_claimed():
    steps = {
        "tests/gpu/test_e.py::test_exact[tiny]": "passed",
        "tests/gpu/test_e.py::test_exact[tiny-qwen3-moe]": "failed",
        "tests/gpu/test_n.py::test_nccl_transfer": "failed",
    }
    assert outcome_of("test_exact", steps) == "failed"
    claimed = synthetic("| NCCL | GPU | — | failed: `test_nccl_transfer` |", *GOOD[1:])
    assert any("its GPU tests did not all pass" in p for p in check_table(claimed, SUITE, steps))


def test_the_path_checker_reports_a_page_or_folder_that_is_not_there(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n")
    (tmp_path / "experiments" / "2026-01-01-run").mkdir(parents=True)
    text = "see docs/a.md, docs/gone.md and experiments/2026-01-01-run, experiments/2026-01-02-lost"
    assert missing_paths(tmp_path / "docs" / "a.md", text, tmp_path) == [
        "docs/a.md: names docs/gone.md, which does not exist",
        "docs/a.md: names experiments/2026-01-02-lost, which does not exist",
    ]


def test_the_link_checker_reports_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The API: what is served\n")
    page = tmp_path / "README.md"
    text = "[ok](docs/a.md#the-api-what-is-served) [web](https://x.org/y) [gone](docs/b.md) [bad](docs/a.md#nope)"
    problems = broken_links(page, text, tmp_path)
    assert problems == [
        "README.md: (docs/b.md) links to a file that does not exist",
        "README.md: (docs/a.md#nope) links to a heading that does not exist",
    ]
