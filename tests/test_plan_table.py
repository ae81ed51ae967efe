"""bench/plan_table.py's rows: a cell's best plan of each mode with its bound, and, with --measure, the measured
numbers beside the predictions in the table it prints (the runs themselves are benchmark runs, docs/results.md)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    # By path, not via sys.path: bench/ holds gpu.py, which would shadow the tests' own `gpu` package.
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # plan_table imports plan_check by name; dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_load("plan_check")
plan_table = _load("plan_table")


def test_a_cell_has_each_modes_best_plan_and_honours_the_itl_objective():
    row = plan_table.cell("h100", 4, 1, "skew-exp:0.08", "mixtral-8x7b-mqa", itl_slo_ms=100)
    assert row["pick"] in ("aep", "ep", "pingpong") and {"aep", "ep"} <= set(row)
    for mode in ("aep", "ep", "pingpong"):
        if mode in row:
            assert row[mode]["itl_ms"] <= 100 and 0 < row[mode]["fraction_of_bound"] <= 1.02
    assert row["bounds_aep_over_ep"] == round(row["aep"]["bound"] / row["ep"]["bound"], 3)


def test_the_table_shows_measured_numbers_beside_the_predictions():
    mode = {"plan": "p", "tokens_per_s": 1000, "bound": 2000, "fraction_of_bound": 0.5}
    row = {"gpu": "h100", "gpus": 8, "top_k": 1, "routing": "skew-exp:0.08", "pick": "ep", "aep": dict(mode),
           "ep": dict(mode), "aep_over_ep": 1.0, "bounds_aep_over_ep": 1.0, "of_bounds_ratio": 1.0}  # fmt: skip
    assert "measured" not in plan_table.markdown([row])
    row["aep"].update(measured=900, measured_fraction_of_bound=0.45)
    row["ep"].update(measured=950, measured_fraction_of_bound=0.475)
    row.update(measured_aep_over_ep=0.947, measured_of_bounds_ratio=0.947)
    table = plan_table.markdown([row])
    assert "measured 0.9 k (0.45)" in table and "(measured 0.947)" in table
