"""Golden data: the model's own figures (bounds, predictions, simulations, EPS tables, link times), kept in one JSON
file per area under tests/golden/ and compared by the tests that compute them.

A case is a function of no arguments (or of one string parameter) that returns the figures a test checks, as a
dict of numbers, strings, bools and lists. The test calls `case.check()` (or `case.check(param)`): it computes the
figures once, compares them with the area's file within the case's relative tolerance, and returns them for the
test's own property checks. `make golden` (python -m tests.golden) runs every case and writes the files again,
keys sorted and floats rounded to DIGITS significant digits, so a model change is reviewed as `git diff tests/golden`
instead of by editing literals in the tests. Published figures and other outside references are not golden data:
they stay literals in the tests, beside their source.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DIR = Path(__file__).resolve().parent
# Twelve significant digits: far below any tolerance a case states, far above what two runs of the same code on one
# machine can differ by (nothing: the model is deterministic).
DIGITS = 12
# The default tolerance. The model is deterministic, so on one machine its figures repeat to the last bit; 1e-9
# leaves room for the last bits another BLAS or numpy's SIMD paths (exp, log on another CPU) can move.
EXACT = 1e-9
REGENERATE = "If the model changed on purpose: `make golden`, then review `git diff tests/golden`."

Figures = dict[str, Any]


def rounded(value: Any) -> Any:
    """JSON-ready figures: floats to DIGITS significant digits, numpy scalars and tuples as plain values."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if not math.isfinite(value) else float(f"{value:.{DIGITS}g}")
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    raise TypeError(
        f"a golden figure must be a number, string, bool, list or dict, not {type(value).__name__}"
    )


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """{"a.b[0]": leaf}: the leaves of nested dicts and lists, each at its path."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{path}.{k}" if path else str(k)))
        return out or {path: {}}
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{path}[{i}]"))
        return out or {path: []}
    return {path: value}


def _close(want: Any, got: Any, rel: float) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return type(want) is type(got) and want == got
    if not (isinstance(want, (int, float)) and isinstance(got, (int, float))):
        return want == got
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return abs(want - got) <= rel * max(abs(want), abs(got)) or want == got


def _change(want: Any, got: Any) -> str:
    if (
        isinstance(want, (int, float))
        and isinstance(got, (int, float))
        and not isinstance(want, bool)
        and want
    ):
        return f" ({(got / want - 1) * 100:+.4g} %)"
    return ""


def differences(want: Any, got: Any, rel: float) -> list[str]:
    """One line per figure that differs, is new, or is gone; empty when they agree within `rel`."""
    old, new = flatten(want), flatten(got)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            lines.append(f"  {key}: golden {old[key]!r}, now missing")
        elif key not in old:
            lines.append(f"  {key}: not in the golden file, now {new[key]!r}")
        elif not _close(old[key], new[key], rel):
            lines.append(f"  {key}: golden {old[key]!r}, now {new[key]!r}{_change(old[key], new[key])}")
    return lines


def path_of(area: str, directory: Path | None = None) -> Path:
    return (directory or DIR) / f"{area}.json"


def load(area: str, directory: Path | None = None) -> dict[str, Any]:
    path = path_of(area, directory)
    return json.loads(path.read_text()) if path.exists() else {}


def dumps(entries: dict[str, Any]) -> str:
    """The file's text: the same entries always give the same bytes."""
    return json.dumps(entries, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def compare(area: str, key: str, figures: Any, rel: float = EXACT, directory: Path | None = None) -> None:
    """Fail, with one line per differing figure, unless `figures` agree with the golden entry within `rel`."""
    path = path_of(area, directory)
    entries = load(area, directory)
    if key not in entries:
        raise AssertionError(f"golden {path.name} has no entry {key!r}. {REGENERATE}")
    lines = differences(entries[key], rounded(figures), rel)
    if lines:
        head = f"golden {path.name} {key!r} differs (relative tolerance {rel:g}):"
        raise AssertionError("\n".join([head, *lines, REGENERATE]))


@dataclass
class Case:
    """A function that computes figures a test checks, and where they are kept."""

    area: str
    name: str
    fn: Callable[..., Figures]
    rel: float = EXACT
    params: tuple[str, ...] | None = None
    _cache: dict[str | None, Any] = field(default_factory=dict, repr=False)

    def key(self, param: str | None = None) -> str:
        return self.name if param is None else f"{self.name}[{param}]"

    def keys(self) -> list[str]:
        return [self.key()] if self.params is None else [self.key(p) for p in self.params]

    def __call__(self, param: str | None = None) -> Figures:
        """The figures, computed once per process (the test and `make golden` call the same function)."""
        if (param is None) != (self.params is None) or (param is not None and param not in self.params):
            raise ValueError(f"golden case {self.name} takes {self.params or 'no parameter'}, not {param!r}")
        if param not in self._cache:
            self._cache[param] = self.fn() if param is None else self.fn(param)
        return self._cache[param]

    def check(self, param: str | None = None, directory: Path | None = None) -> Figures:
        """Compare the figures with the golden file and return them."""
        figures = self(param)
        compare(self.area, self.key(param), figures, self.rel, directory)
        return figures


CASES: dict[tuple[str, str], Case] = {}


def case(area: str, rel: float = EXACT, params: Iterable[str] | None = None) -> Callable[[Callable], Case]:
    """Register a function as a golden case of `area` (its file tests/golden/AREA.json), keyed by its name."""

    def register(fn: Callable[..., Figures]) -> Case:
        made = Case(area, fn.__name__, fn, rel, None if params is None else tuple(params))
        functools.update_wrapper(made, fn)  # type: ignore[arg-type]
        if (area, fn.__name__) in CASES:
            raise ValueError(f"two golden cases named {fn.__name__} in {area}")
        CASES[area, fn.__name__] = made
        return made

    return register


def generate(cases: Iterable[Case]) -> dict[str, dict[str, Any]]:
    """Every case's figures by area and key, rounded as the files keep them."""
    out: dict[str, dict[str, Any]] = {}
    for c in cases:
        for param in c.params or (None,):
            out.setdefault(c.area, {})[c.key(param)] = rounded(c(param))
    return out


def write(areas: dict[str, dict[str, Any]], directory: Path | None = None) -> list[Path]:
    """Write each area's file whole (entries no case makes any more are gone); the paths whose bytes changed."""
    changed = []
    for area, entries in sorted(areas.items()):
        path, text = path_of(area, directory), dumps(entries)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed
