"""`amoe bench plan-table`'s rows: a cell's best plan of each mode with its bound, and, with --measure, the measured
numbers beside the predictions in the table it prints (the runs themselves are benchmark runs, docs/findings.md)."""

import golden

from amoe.perf.studies import plan_table


@golden.case("plan")
def h100_4_cell() -> golden.Figures:
    """The plan table's cell of 4 H100s, top-1, skew-exp:0.08, under a 100 ms ITL objective."""
    return plan_table.cell("h100", 4, 1, "skew-exp:0.08", "mixtral-8x7b-mqa", itl_slo_ms=100)


def test_a_cell_has_each_modes_best_plan_and_honours_the_itl_objective():
    row = h100_4_cell.check()
    assert row["pick"] in ("aep", "ep", "pingpong") and {"aep", "ep"} <= set(row)
    for mode in ("aep", "ep", "pingpong"):
        if mode in row:
            assert row[mode]["itl_ms"] <= 100 and 0 < row[mode]["fraction_of_bound"] <= 1.02
    assert row["bounds_aep_over_ep"] == round(row["aep"]["bound"] / row["ep"]["bound"], 3)


def test_the_table_shows_measured_numbers_beside_the_predictions():
    mode = {"plan": "p", "tokens_per_s": 1000, "bound": 2000, "fraction_of_bound": 0.5, "simulated": True}
    row = {"gpu": "h100", "gpus": 8, "top_k": 1, "routing": "skew-exp:0.08", "pick": "ep", "aep": dict(mode),
           "ep": dict(mode), "aep_over_ep": 1.0, "bounds_aep_over_ep": 1.0, "of_bounds_ratio": 1.0}  # fmt: skip
    assert "measured" not in plan_table.markdown([row])
    row["aep"].update(measured=900, measured_fraction_of_bound=0.45)
    row["ep"].update(measured=950, measured_fraction_of_bound=0.475)
    row.update(measured_aep_over_ep=0.947, measured_of_bounds_ratio=0.947)
    table = plan_table.markdown([row])
    assert "measured 0.9 k (0.45)" in table and "(measured 0.947)" in table
    row["measured_two_scrapes_of_bounds_ratio"] = 0.97
    assert "(two scrapes 0.97)" in plan_table.markdown([row])
    assert "bound only" not in plan_table.markdown([row])
    row["aep"]["simulated"] = (
        False  # a mode whose simulated plans all missed the ITL objective: its bound is left
    )
    assert "1.0 k (0.50) bound only" in plan_table.markdown([row])


def test_measure_runs_one_copy_of_each_plan_once_and_resumes_from_its_file(tmp_path, monkeypatch):
    """--measure runs one copy of a row's plan (its requests, its rate), reports it times the copies, runs a copy
    two rows share once, and a second run finds the points in measured.jsonl instead of running them again."""
    import asyncio

    def mode(plan, replicas, tps, conc):
        dep = {"mode": plan, "attn_gpu": "h100", "num_attn": 2, "expert_gpu": "h100", "num_expert": 2,
               "attn_cap": 256, "expert_cap": 512, "micro_batches": 2, "replicas": replicas,
               "expert_map": [0, 1, 0, 1, 0, 1, 0, 1] if plan == "aep" else None, "gpus_per_node": 8}  # fmt: skip
        return {"plan": f"{plan} x{replicas}", "tokens_per_s": tps, "bound": 2 * tps, "itl_ms": 100.0,
                "concurrency": conc, "deployment": dep}  # fmt: skip

    rows = [
        {"gpu": "h100", "gpus": n, "top_k": 1, "routing": "skew-exp:0.08", "bounds_aep_over_ep": 1.0,
         "aep": mode("aep", n // 4, 1000 * n, 100 * n), "ep": mode("ep", n // 4, 2000 * n, 50 * n)}
        for n in (8, 16)
    ]  # fmt: skip
    copy = plan_table.one_copy(rows[1]["aep"])
    assert copy.deployment.replicas == 1 and copy.deployment.expert_map == (0, 1) * 4
    assert (copy.prediction.tokens_per_s, copy.prediction.concurrency) == (4000, 400)
    ran = []

    async def fake_run_check(check, p, base_scale, probe_s, repeats, plan=None):
        ran.append((check.deployment.mode, check.concurrency, p.blocks))
        # The copy's requests over an ITL at 95 % of the predicted rate (Little's law), while the two scrapes read
        # 90 % of it: a step of the counter missed
        pred = plan.prediction
        run = {
            "itl_ms": pred.concurrency / (0.95 * pred.tokens_per_s) * 1e3,
            "running_mean": pred.concurrency,
        }
        return {"measured": 0.9 * pred.tokens_per_s, "ratio": 0.9, "runs": [run]}

    monkeypatch.setattr(plan_table.plan_check, "run_check", fake_run_check)
    measured = plan_table.Measured(tmp_path / "measured.jsonl")
    for row in rows:
        asyncio.run(plan_table.measure_row(row, "mixtral-8x7b-mqa", 40.0, 55e-6, measured))
    assert ran == [("aep", 400, 32), ("ep", 200, 32)]  # 8 and 16 GPUs: 2 and 4 copies of the same one
    # Led by Little's law (4 copies at 95 % of 4,000 and 8,000 tok/s), the two scrapes' 90 % beside it
    aep, ep = rows[1]["aep"], rows[1]["ep"]
    assert (aep["measured"], ep["measured"], aep["measured_by"]) == (15200, 30400, "little")
    assert (aep["measured_two_scrapes"], ep["measured_two_scrapes"]) == (14400, 28800)
    assert aep["measured_over_predicted"] == 0.95 and aep["measured_fraction_of_bound"] == 0.475
    assert rows[1]["measured_aep_over_ep"] == 0.5 and rows[1]["measured_of_bounds_ratio"] == 0.5
    assert rows[1]["measured_pick"] == "ep"
    again = plan_table.Measured(tmp_path / "measured.jsonl")
    asyncio.run(plan_table.measure_row(dict(rows[0]), "mixtral-8x7b-mqa", 40.0, 55e-6, again))
    assert len(ran) == 2


def test_the_summary_says_how_far_the_two_scrape_reading_is_from_the_fit():
    points = {
        "a": {"plan": "ep 2xh100 cap 1024", "runs": [{"throughput": 100.0, "throughput_fit": 97.0}]},
        "b": {"plan": "aep 2xh100 attn + 2xh100 experts", "runs": [{"throughput": 100.0, "throughput_fit": 101.0}]},
        "c": {"plan": "ep 4xh100 cap 1024", "runs": [{"throughput": 50.0}]},  # measured before the fit existed
    }  # fmt: skip
    assert plan_table.fit_over_two_scrapes(points) == {"aep": [1.01], "ep": [0.97]}


def test_a_point_without_the_itl_or_requests_in_flight_is_read_by_its_two_scrapes():
    got = {"measured": 100.0, "runs": [{"throughput": 100.0}]}
    assert plan_table.readings(got, 2, 400.0) == {
        "measured": 200, "measured_by": "two scrapes", "measured_two_scrapes": 200, "measured_over_predicted": 0.5,
    }  # fmt: skip


def test_measured_points_are_kept_apart_by_the_aep_policy_they_ran():
    """An AEP point run with waves is not the defrag point of the same plan (earlier files hold defrag points with
    no suffix); EP and ping-pong have no scheduler, so their keys do not change."""
    from amoe.perf.plan.deployment import Deployment
    from amoe.perf.plan.prediction import Prediction
    from amoe.perf.plan.request import Plan

    pred = Prediction(1000.0, 0.1, 100, "attention")
    aep = Plan(Deployment("aep", "h100", 2, "h100", 2), pred, None)
    ep = Plan(Deployment("ep", "h100", 4), pred, None)
    key = plan_table.Measured.key
    args = ("mixtral-8x7b-mqa", 1, "skew-exp:0.08")
    assert key(*args, aep, "sourced") == key(*args, aep, "sourced", "defrag")
    assert key(*args, aep, "sourced", "waves") == key(*args, aep, "sourced") + " policy waves"
    assert key(*args, ep, "sourced", "waves") == key(*args, ep, "sourced", "defrag")


def test_plan_table_rejects_an_unknown_aep_policy(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "amoe", "bench", "plan-table", "--gpus", "h100", "--sizes", "4", "--top-k", "1",
         "--routings", "skew-exp:0.08", "--aep-policy", "fifo", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "--aep-policy must be one of" in result.stderr
    assert "Traceback" not in result.stderr


def test_measure_runs_the_chosen_modes_and_reports_the_measured_itl_against_the_objective(
    tmp_path, monkeypatch
):
    """--measure-modes aep,ep runs those first (ping-pong read from the file, here not yet there), a later run
    adds ping-pong; each mode's measured ITL is reported and checked against the ITL objective, and the measured
    pick within it is the best plan whose measured ITL meets it. The AEP run gets the table's AEP policy."""
    import asyncio

    import pytest

    def mode(plan, tps, itl_ms):
        dep = {"mode": plan, "attn_gpu": "h100", "num_attn": 2, "expert_gpu": "h100", "num_expert": 2,
               "attn_cap": 256, "expert_cap": 512, "micro_batches": 2, "replicas": 1, "expert_map": None,
               "gpus_per_node": 8}  # fmt: skip
        return {"plan": plan, "tokens_per_s": tps, "bound": tps, "fraction_of_bound": 1.0, "itl_ms": itl_ms,
                "concurrency": 100, "simulated": True, "deployment": dep}  # fmt: skip

    row = {"gpu": "h100", "gpus": 4, "top_k": 1, "routing": "skew-exp:0.08", "pick": "aep",
           "bounds_aep_over_ep": 1.0, "aep": mode("aep", 3000, 90.0), "ep": mode("ep", 2000, 50.0),
           "pingpong": mode("pingpong", 2500, 40.0)}  # fmt: skip
    measured_itl = {"aep": 120.0, "ep": 60.0, "pingpong": 45.0}  # AEP's measured ITL misses 100 ms
    ran = []

    async def fake_run_check(check, p, base_scale, probe_s, repeats, plan=None):
        mode = check.deployment.mode
        ran.append((mode, p.aep_policy))
        run = {"itl_ms": measured_itl[mode], "running_mean": 400 if mode == "aep" else 100}
        return {"measured": 1.0, "runs": [run]}

    monkeypatch.setattr(plan_table.plan_check, "run_check", fake_run_check)
    measured = plan_table.Measured(tmp_path / "measured.jsonl")
    assert measured.aep_policy == "waves"
    asyncio.run(
        plan_table.measure_row(row, "mixtral-8x7b-mqa", 40.0, 55e-6, measured, ("aep", "ep"), itl_slo_ms=100)
    )
    assert ran == [("aep", "waves"), ("ep", "waves")] and "measured" not in row["pingpong"]
    assert "measured_pick" not in row and "measured_aep_over_ep" in row
    assert (row["aep"]["measured_itl_ms"], row["aep"]["measured_meets_itl_slo"]) == (120.0, False)
    assert row["ep"]["measured_meets_itl_slo"] is True
    asyncio.run(
        plan_table.measure_row(row, "mixtral-8x7b-mqa", 40.0, 55e-6, measured, ("pingpong",), itl_slo_ms=100)
    )
    assert ran[2:] == [("pingpong", "waves")]
    # By Little's law (requests over the ITL) AEP measures most (3.3 k) but misses the objective.
    assert row["measured_pick"] == "aep" and row["measured_pick_within_slo"] == "pingpong"
    table = plan_table.markdown([row])
    assert "at 120 ms ✗" in table and "at 45 ms" in table
    assert plan_table._row_indices(None, 4) == {0, 1, 2, 3} and plan_table._row_indices("0,2", 4) == {0, 2}
    for bad in ("4", "x"):
        with pytest.raises(plan_table.ConfigError, match="--measure-rows"):
            plan_table._row_indices(bad, 4)


def test_a_time_scale_that_is_not_positive_is_a_clear_error_before_anything_runs(tmp_path, capsys):
    """`amoe bench plan-table --measure --time-scale 0`: one clear line and a user-error exit, nothing measured."""
    from amoe.cli import EXIT_USER_ERROR
    from amoe.cli import main as cli_main

    out = tmp_path / "t"
    assert (
        cli_main(["bench", "plan-table", "--measure", "--time-scale", "0", "--out", str(out)])
        == EXIT_USER_ERROR
    )
    assert "--time-scale must be positive" in capsys.readouterr().err
    assert not (out / "measured.jsonl").exists()


def test_a_close_call_is_measured_again_at_a_larger_time_scale_and_decided_by_the_means(
    tmp_path, monkeypatch
):
    """Two modes within the simulation's resolution (3 %) at the table's time scale: every mode of the row runs
    three more times at 2.5x the scale, the modes in turn within each run, and the row reads the means (here the
    order flips); a second invocation finds those points in the file; a row 5 % apart runs nothing more, and a row
    not chosen to run keeps its pick and says the close call was not measured."""
    import asyncio

    def mode(plan, tps):
        dep = {"mode": plan, "attn_gpu": "h100", "num_attn": 6, "expert_gpu": "h100", "num_expert": 2,
               "attn_cap": 512, "expert_cap": 1024, "micro_batches": 2, "replicas": 1, "expert_map": None,
               "gpus_per_node": 8}  # fmt: skip
        return {"plan": plan, "tokens_per_s": tps, "bound": tps, "fraction_of_bound": 1.0, "itl_ms": 90.0,
                "concurrency": 6000, "simulated": True, "deployment": dep}  # fmt: skip

    def row_of(pingpong_tps):
        return {"gpu": "h100", "gpus": 8, "top_k": 1, "routing": "skew-exp:0.08", "pick": "aep",
                "bounds_aep_over_ep": 1.0, "aep": mode("aep", 6000), "ep": mode("ep", 5000),
                "pingpong": mode("pingpong", pingpong_tps)}  # fmt: skip

    # Requests over the ITL (Little's law): at the table's scale ping-pong leads by 1 %; at 2.5x AEP by 1 %, 2 %, 0 %
    itl = {("aep", 40.0): 1.01, ("pingpong", 40.0): 1.0, ("ep", 40.0): 1.2, ("ep", 100.0): 1.2}
    aep_runs = iter([0.99, 0.98, 1.0])
    ran = []

    async def fake_run_check(check, p, base_scale, probe_s, repeats, plan=None):
        m = check.deployment.mode
        ran.append((m, base_scale))
        s = itl.get((m, base_scale)) or (next(aep_runs) if m == "aep" else 1.0)
        return {"measured": 1.0, "runs": [{"itl_ms": s * 1e3, "running_mean": 6000}]}

    monkeypatch.setattr(plan_table.plan_check, "run_check", fake_run_check)
    measured = plan_table.Measured(tmp_path / "measured.jsonl")
    row = row_of(5900)
    asyncio.run(plan_table.measure_row(row, "mixtral-8x7b-mqa", 40.0, 55e-6, measured, itl_slo_ms=100))
    assert ran[:3] == [("aep", 40.0), ("ep", 40.0), ("pingpong", 40.0)]
    assert ran[3:] == [("aep", 100.0), ("ep", 100.0), ("pingpong", 100.0)] * 3
    call = row["close_call"]
    assert call["pick_at_table_scale"] == "pingpong" and call["at_table_scale"]["aep"] == 5941
    assert call["each_run"]["aep"] == [6061, 6122, 6000] and call["each_run"]["pingpong"] == [6000] * 3
    assert (
        row["measured_pick"] == "aep"
        and row["aep"]["measured"] == 6061
        and len(row["aep"]["measured_runs"]) == 3
    )
    assert row["aep"]["measured_itl_ms"] == 990.0 and row["measured_pick_within_slo"] is None
    again = row_of(5900)
    asyncio.run(
        plan_table.measure_row(again, "mixtral-8x7b-mqa", 40.0, 55e-6, plan_table.Measured(measured.path))
    )
    assert len(ran) == 12 and again["measured_pick"] == "aep"  # all twelve points read from the file

    far = row_of(5900)
    itl[("pingpong", 40.0)] = 1.07  # 5 % behind AEP: not a close call
    fresh = plan_table.Measured(tmp_path / "far.jsonl")
    asyncio.run(plan_table.measure_row(far, "mixtral-8x7b-mqa", 40.0, 55e-6, fresh))
    assert len(ran) == 15 and "close_call" not in far and far["measured_pick"] == "aep"

    # A row not chosen to run (--measure-rows) whose file holds only the table-scale points: nothing runs
    first_three = measured.path.read_text().splitlines()[:3]
    (tmp_path / "table_scale.jsonl").write_text("\n".join(first_three) + "\n")
    not_run = row_of(5900)
    asyncio.run(
        plan_table.measure_row(
            not_run, "mixtral-8x7b-mqa", 40.0, 55e-6, plan_table.Measured(tmp_path / "table_scale.jsonl"), ()
        )
    )
    assert len(ran) == 15 and not_run["measured_pick"] == "pingpong"
    assert not_run["close_call"] == {"runs": 0, "pick_at_table_scale": "pingpong"}
