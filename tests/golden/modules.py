"""Which test modules declare golden cases, and importing them (for `make golden` and the suite's own check)."""

from __future__ import annotations

import importlib
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
MARK = "@golden.case("


def case_modules() -> list[str]:
    """Names of the test modules (tests/test_*.py) that declare a golden case."""
    return sorted(p.stem for p in TESTS.glob("test_*.py") if MARK in p.read_text())


def import_cases(names: list[str]) -> None:
    """Import the modules, registering their cases in golden.CASES (tests/ must be on sys.path)."""
    for name in names:
        importlib.import_module(name)
