"""The studies that were scripts are `amoe bench` commands (amoe.perf.studies.commands): each one's module is found
when it runs, a cheap one runs to its JSON lines, and a bad argument is a one-line error, not a traceback."""

from __future__ import annotations

import importlib
import json

import pytest

from amoe.cli import build_parser, main

# Each command with the least arguments it takes.
STUDIES = (
    ["policies-sim"],
    ["waves-emulated"],
    ["waves-sim", "0"],
    ["aep-unmerged"],
    ["repredict"],
    ["variance-same-plans", "TABLE"],
    ["offload-replay"],
    ["offload-locality"],
)


@pytest.mark.parametrize("argv", STUDIES, ids=lambda a: a[0])
def test_each_study_command_parses_and_finds_its_modules_main(argv):
    args = build_parser().parse_args(["bench", *argv])
    study = args.run.__closure__[0].cell_contents  # the module the study's `_runner` imports when it runs
    assert callable(importlib.import_module(f"amoe.perf.studies.{study}").main)


def test_aep_unmerged_finds_the_merged_bound_the_larger_at_the_tables_points(capsys):
    """The check the study exists for: under the 100 ms table's ITL target, merging the ranks' groups never loses to
    keeping them apart (docs/simulation.md "Merged ranks move at the slowest rank's pace"), on its four AEP plans."""
    assert main(["bench", "aep-unmerged", "--itl-slo-ms", "100"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4
    assert all(r["unmerged"] is None or r["merged"] >= r["unmerged"] for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["waves-sim", "9"], "waves-sim: no plan 9; the plans are 0..6"),
        (["waves-sim", "0", "x"], "waves-sim takes PLANS"),
        (["repredict", "everything"], "repredict: unknown part 'everything'"),
        (["policies-sim", "fifo"], "policies-sim: unknown policies ['fifo']"),
        (["offload-locality", "--models", "gpt"], "--models: unknown gpt"),
    ],
)
def test_a_bad_argument_is_one_line(capsys, argv, message):
    assert main(["bench", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("amoe: error: ") and message in err and "Traceback" not in err
