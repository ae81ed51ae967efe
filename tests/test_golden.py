"""The golden data mechanism (tests/golden): a figure that moved fails its test with one readable line per figure,
the files are written the same way every time, and every entry has the case that makes it."""

from __future__ import annotations

import json
import random
import shutil

import golden
import pytest
from golden.__main__ import main as golden_main
from golden.modules import case_modules, import_cases


@pytest.fixture(scope="module")
def cases() -> dict[tuple[str, str], golden.Case]:
    import_cases(case_modules())
    return golden.CASES


def test_a_changed_golden_value_fails_its_test_with_a_readable_diff(cases, tmp_path):
    """On a copy of a real area file: as it stands the case passes; with one figure 1 % off it fails, naming the
    figure, both values, the change and the command that regenerates the files."""
    case = cases["bounds", "merged_path_bound"]
    shutil.copy(golden.path_of("bounds"), tmp_path / "bounds.json")
    case.check(directory=tmp_path)
    entries = json.loads((tmp_path / "bounds.json").read_text())
    kept = entries["merged_path_bound"]["tokens_per_s"]
    entries["merged_path_bound"]["tokens_per_s"] = kept * 1.01
    entries["merged_path_bound"]["waves"] += 1
    (tmp_path / "bounds.json").write_text(golden.dumps(entries))
    with pytest.raises(AssertionError) as failed:
        case.check(directory=tmp_path)
    lines = str(failed.value).splitlines()
    assert lines[0] == "golden bounds.json 'merged_path_bound' differs (relative tolerance 1e-09):"
    assert lines[1] == f"  tokens_per_s: golden {kept * 1.01!r}, now {kept!r} (-0.9901 %)"
    assert lines[2].startswith("  waves: golden ") and lines[2].endswith("%)")
    assert lines[-1] == golden.REGENERATE and len(lines) == 4


def test_new_and_missing_figures_and_entries_are_named():
    old = {"a": 1.0, "b": {"c": [1, 2]}}
    assert golden.differences(old, {"a": 1.0 + 1e-12, "b": {"c": [1, 2]}}, 1e-9) == []
    assert golden.differences(old, {"a": 1.0, "b": {"c": [1]}, "d": "x"}, 1e-9) == [
        "  b.c[1]: golden 2, now missing",
        "  d: not in the golden file, now 'x'",
    ]
    assert golden.differences({"s": "link"}, {"s": "attention"}, 1.0) == [
        "  s: golden 'link', now 'attention'"
    ]
    assert golden.differences({"f": True}, {"f": 1}, 1.0) == ["  f: golden True, now 1"]


def test_a_case_without_an_entry_says_how_to_make_one(tmp_path):
    with pytest.raises(AssertionError, match=r"golden nowhere.json has no entry 'x'\. If the model changed"):
        golden.compare("nowhere", "x", {"a": 1}, directory=tmp_path)


def test_the_files_are_written_the_same_way_every_time(tmp_path):
    """Keys sorted, floats to DIGITS significant digits: rounding what was rounded changes nothing, and writing the
    same figures twice leaves the bytes as they were (so `make golden` on an unchanged tree gives no diff)."""
    rng = random.Random(3)
    floats = [rng.uniform(-1, 1) * 10 ** rng.randint(-12, 12) for _ in range(2000)]
    assert all(golden.rounded(golden.rounded(x)) == golden.rounded(x) for x in floats)
    assert all(abs(golden.rounded(x) / x - 1) < 10 ** (1 - golden.DIGITS) for x in floats)
    import numpy as np

    figures = {
        "z": np.float64(1 / 3),
        "a": (np.int64(2), 0.1 + 0.2),
        "m": {"b": np.array([1.5, 2.5]), "a": None},
    }
    areas = {"area": {"case": golden.rounded(figures)}}
    assert golden.write(areas, tmp_path) == [tmp_path / "area.json"]
    first = (tmp_path / "area.json").read_text()
    assert golden.write(areas, tmp_path) == []
    assert (tmp_path / "area.json").read_text() == first
    assert first.index('"a"') < first.index('"m"') < first.index('"z"')
    assert json.loads(first)["case"]["a"] == [2, 0.3]
    with pytest.raises(TypeError, match="not object"):
        golden.rounded(object())


def test_every_entry_has_its_case_and_every_case_its_entry(cases):
    """A case renamed or removed leaves no entry behind, and a new case is not unchecked for want of one."""
    declared: dict[str, set[str]] = {}
    for c in cases.values():
        declared.setdefault(c.area, set()).update(c.keys())
    on_disk = {p.stem: set(json.loads(p.read_text())) for p in golden.DIR.glob("*.json")}
    assert on_disk == declared


def test_an_unknown_area_is_a_one_line_error(cases, capsys):
    with pytest.raises(SystemExit) as done:
        golden_main(["bounds", "nowhere"])
    assert done.value.code == 2
    assert "no golden area nowhere (areas: aep_phases, bounds," in capsys.readouterr().err
