"""The drift benchmark's machinery at a tiny size (`amoe bench drift`; its targets live in the benchmark, not here):
the drifting routing, the figures computed from recorded tokens and rebalances, and the command end to end on
the synchronous group and on a served aep cluster."""

import argparse
import json

import numpy as np
import pytest

from amoe.cli import main
from amoe.perf.model.routing import RouterOverride, RoutingSpec
from amoe.perf.studies import drift, drift_report

TINY = {
    "profile": "mixtral-8x7b-mqa:1", "streams": 6, "prompt_len": 16, "max_tokens": 3, "batch_rows": 64,
    "time_scale": 1.0, "warmup_s": 1.2, "before_s": 0.4, "after_s": 1.0, "step_interval": 4, "window_size": 2,
}  # fmt: skip


def test_drifted_requests_draw_from_another_hot_set_and_the_others_are_unchanged():
    spec = RoutingSpec.parse("skew-exp,drift=100")
    assert spec.drift_id == 100 and str(spec) == "skew-exp:0.08,drift=100"
    drifting, plain = (
        RouterOverride(spec, 8, 2, 2, seed=3),
        RouterOverride(RoutingSpec.parse("skew-exp"), 8, 2, 2, seed=3),
    )
    rid = np.repeat([7, 100], 4000)
    pos = np.tile(np.arange(4000), 2)
    ids, weights = drifting.route(1, len(rid), request_ids=rid, positions=pos)
    same, _ = plain.route(1, 4000, request_ids=rid[:4000], positions=pos[:4000])
    assert (ids[:4000] == same).all()  # requests below the drift route as without it
    hot_before = np.bincount(ids[:4000].ravel(), minlength=8).argmax()
    hot_after = np.bincount(ids[4000:].ravel(), minlength=8).argmax()
    assert hot_before == drifting.popularity_at(0)[1].argmax()
    assert hot_after == drifting.popularity_at(1)[1].argmax() != hot_before
    assert np.allclose(weights.sum(axis=1), 1.0)
    for bad in ("skew-exp,drift=-1", "skew-exp,drift=1.5", "skew-exp,drift=x"):
        with pytest.raises(Exception, match="drift|numbers"):
            RoutingSpec.parse(bad)


def test_the_figures_from_recorded_tokens_and_rebalances():
    setup = drift.DriftSetup(warmup_s=2.0, before_s=2.0, after_s=4.0)
    steady = [(t / 100, 10) for t in range(0, 800)]  # 1000 tokens/s throughout
    # A 0.5 s pause at 5.0 s: no tokens in it.
    paused = [(t, n) for t, n in steady if not 5.0 <= t < 5.5]
    runs = [
        {"variant": "static", "mode": "aep", "tokens": [(t, 8 if t >= 4 else n) for t, n in steady], "rebalance_spans": [], "placement": {}, "wall_s": 1},
        {"variant": "live", "mode": "aep", "tokens": [(t, 9 if t >= 4 else n) for t, n in steady], "rebalance_spans": [(4.5, 4.6), (1.0, 1.1)], "placement": {}, "wall_s": 1},
        {"variant": "reference", "mode": "aep", "tokens": steady, "rebalance_spans": [], "placement": {}, "wall_s": 1},
        {"variant": "stop-the-world", "mode": "ep", "tokens": paused, "rebalance_spans": [(5.0, 5.5)], "placement": {}, "wall_s": 1},
        {"variant": "ep-reference", "mode": "ep", "tokens": steady, "rebalance_spans": [], "placement": {}, "wall_s": 1},
    ]  # fmt: skip
    summary = drift_report.summarise(setup, runs)
    fig, live = summary["figures"], summary["variants"]["live"]
    assert live["rebalances_measured"] == 1  # the warm-up's move is not measured
    assert live["dips"][0]["before"] == pytest.approx(975)  # [2.5, 4.5): 1.5 s at 1000, 0.5 s at 900
    assert fig["gain_of_new_placement"] == pytest.approx(0.25)  # 800 -> 1000 tokens/s
    assert fig["live_recovery"] == pytest.approx(0.5) and fig["live_recovery_target"] == "miss"
    assert fig["stop_the_world_worst_dip"] == pytest.approx(
        0.5, abs=0.011
    )  # the window holding the pause: half its tokens
    assert fig["stop_the_world_after_vs_reference"] == pytest.approx(1.0)
    assert drift_report._verdict(0.945, 0.95) == "close call" and drift_report._verdict(0.97, 0.95) == "pass"
    assert "live_recovery" in drift_report.table(summary)


def _args(tmp_path, variants: str) -> argparse.Namespace:
    fields = {f: None for f in ("seed", "gpu")}
    return argparse.Namespace(out=str(tmp_path), variants=variants, **fields, **TINY)


@pytest.mark.parametrize("argv, named", [
    (["--streams", "0"], "streams"), (["--time-scale", "-1"], "time-scale"), (["--variants", "live,nope"], "--variants"),
])  # fmt: skip
def test_bad_settings_are_one_line_errors(capsys, argv, named):
    assert main(["bench", "drift", "--out", "unused", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("amoe: error:") and named in err and "\n" not in err, err


@pytest.mark.timeout(180)
def test_the_command_end_to_end_at_a_tiny_size(tmp_path, capsys):
    assert drift.main(_args(tmp_path, "live,stop-the-world,ep-reference")) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "drift" and set(line["variants"]) == {"live", "stop-the-world", "ep-reference"}
    data = json.loads((tmp_path / "drift.json").read_text())
    assert (tmp_path / "drift.png").stat().st_size > 0
    for run in data["runs"]:
        assert sum(n for _, n in run["tokens"]) > 0, run["variant"]
        assert run["rebalance_spans"], f"{run['variant']} never rebalanced"  # a move every 4 steps
        assert all(a <= b for a, b in run["rebalance_spans"])
    stw = next(r for r in data["runs"] if r["variant"] == "stop-the-world")
    assert stw["placement"]["moved_bytes"] > 0 and stw["placement"]["paused_s"] > 0
    live = next(r for r in data["runs"] if r["variant"] == "live")
    assert live["placement"]["rebalances"]["completed"] >= 1 and not live["placement"]["rebalances"]["failed"]
