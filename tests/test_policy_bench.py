"""`amoe bench policies`' summary: throughput by Little's law beside the token counter's, medians and spreads over
runs, and a recorded run summarised again (amoe.perf.studies.policy_bench)."""

from __future__ import annotations

import json
import statistics

import pytest

from amoe.config import AmoeConfig
from amoe.errors import ConfigError
from amoe.perf.studies import policy_bench


def _point(kind: str, throughput: float, running: float, itl_ms: float | None) -> dict:
    return {
        "kind": kind,
        "throughput": throughput,
        "running_mean": running,
        "itl_ms_mean": itl_ms,
        "completed": 0,
    }


def test_a_recorded_run_is_summarised_again_with_littles_law(tmp_path):
    # Run 0's overload point read a counter burst (twice what its requests in flight over their ITL allow).
    runs = {
        "defrag": [
            {
                "seed": 0,
                "points": [_point("load 0.5", 40e3, 400, 10.0), _point("load 1.3", 160e3, 2048, 25.6)],
            },
            {
                "seed": 1,
                "points": [_point("load 0.5", 41e3, 410, 10.0), _point("load 1.3", 78e3, 2048, 25.0)],
            },
        ],
        "wave": [
            {
                "seed": 0,
                "points": [_point("load 0.5", 30e3, 560, None), _point("load 1.3", 44e3, 2048, 46.5)],
            },
        ],
    }
    summary = {"loads": [0.5, 1.3], "blocks": 4}
    path = tmp_path / "policies.json"
    path.write_text(json.dumps({"summary": summary, "runs": runs}))
    got = policy_bench.report(path)
    assert got["blocks"] == 4
    defrag = got["policies"]["defrag"]
    assert defrag["throughput_little_runs"] == [80000, 81920]
    assert defrag["throughput_little_spread"] == pytest.approx(1920 / 80960, abs=1e-3)
    assert defrag["throughput_spread"] > 0.5  # the counter's reading is what the burst left
    assert defrag["itl_ms_at_half_load"] == 10.0 and defrag["itl_spread"] == 0.0
    wave = got["policies"]["wave"]
    assert wave["throughput_little_max"] == round(2048 / 0.0465)
    assert (
        wave["itl_ms_at_half_load"] is None
    )  # no ITL measured at half load: none reported, not a made-up one


def test_an_overload_point_whose_every_arrival_was_served_is_not_taken_as_the_maximum(tmp_path):
    # The 2026-11-26 16:39 run's defrag seed 0: at 1.3x the bound's rate all 4,456 arrivals were served within the
    # grace (154 in flight instead of 2,048, an ITL under 1 ms): not an overload, yet it read 166 k tokens/s.
    def point(kind, rate, throughput, running, itl_ms, completed):
        return {**_point(kind, throughput, running, itl_ms), "rate": rate, "completed": completed}

    runs = {
        "defrag": [
            {
                "seed": 0,
                "points": [
                    point("load 0.5", 428.49, 37e3, 507, 13.5, 0),
                    point("load 1.3", 1114.07, 166e3, 154, 0.93, 4456),
                ],
            },
            {
                "seed": 1,
                "points": [
                    point("load 0.5", 428.49, 43e3, 430, 10.1, 0),
                    point("load 1.3", 1114.07, 73e3, 2047, 28.0, 0),
                ],
            },
        ]
    }
    path = tmp_path / "policies.json"
    path.write_text(json.dumps({"summary": {"loads": [0.5, 1.3], "duration_s": 4.0}, "runs": runs}))
    defrag = policy_bench.report(path)["policies"]["defrag"]
    # Run 0 has no maximum to report (its half-load point is not one); the median is run 1's alone.
    assert defrag["throughput_runs"] == [73000] and defrag["throughput_max"] == 73000
    assert defrag["throughput_little_runs"] == [round(2047 / 0.028)]
    assert defrag["itl_ms_at_half_load"] == pytest.approx(
        (13.5 + 10.1) / 2
    )  # the half-load points still count
    # A point that served every arrival below the bound's rate is an ordinary point.
    assert not policy_bench.not_overloaded({"rate_of_bound": 0.5, "sent": 10, "completed": 10})
    assert policy_bench.not_overloaded({"rate_of_bound": 1.3, "sent": 10, "completed": 10})
    assert not policy_bench.not_overloaded({"rate_of_bound": 1.3, "sent": 10, "completed": 0})


def _series(itls_ms: list[float], running: list[float], tokens_per_batch: int = 1000) -> list[tuple]:
    """Scrapes 0.25 s apart, four to a 1 s batch: batch i's tokens all have ITL itls_ms[i]."""
    out, t, total, count = [], 0.0, 0.0, 0
    out.append((t, total, count, running[0], 0))
    for itl, n in zip(itls_ms, running):
        for _ in range(4):
            t += 0.25
            total += tokens_per_batch / 4 * itl / 1e3
            count += tokens_per_batch // 4
            out.append((round(t, 2), total, count, n, count))
    return out


def test_batch_means_give_the_windows_itl_and_an_interval_from_the_batches_spread():
    from amoe.perf.plan.simulate.batch_means import batch_means, t95

    series = _series([10.0, 12.0, 10.0, 12.0], [400, 400, 400, 400])
    got = batch_means(series, 0.0, 4.0, 4)
    assert got["value"] == pytest.approx(11e-3)
    assert got["batch_means"] == pytest.approx([10e-3, 12e-3, 10e-3, 12e-3])
    sd = statistics.stdev([10.0, 12.0, 10.0, 12.0])
    assert got["ci_rel"] == pytest.approx(t95(3) * sd / 2 / 11.0)
    assert got["lag1"] < -0.5  # alternating batches: anticorrelated
    # Throughput by Little's law: requests running over each batch's ITL, tokens per second.
    little = batch_means(series, 0.0, 4.0, 2, little=True)
    assert little["value"] == pytest.approx(400 / 11e-3)
    assert little["ci_rel"] == 0.0  # both 2 s batches hold the same mix
    with pytest.raises(ConfigError, match="cannot make"):
        batch_means(series[:3], 0.0, 4.0, 4)


def test_each_run_reports_its_interval_and_the_spread_its_own(tmp_path):
    def run(seed, itls_ms):
        half = {
            **_point("load 0.5", 42e3, 400, statistics.fmean(itls_ms)),
            "series": _series(itls_ms, [400] * 4),
        }
        top = {**_point("load 1.3", 77e3, 2040, 26.5), "series": _series([26.5] * 4, [2040] * 4)}
        return {"seed": seed, "points": [half, top]}

    runs = {"waves": [run(0, [9.0, 9.4, 9.2, 9.6]), run(1, [10.0, 10.4, 10.2, 10.6])]}
    path = tmp_path / "policies.json"
    path.write_text(json.dumps({"summary": {"loads": [0.5, 1.3], "duration_s": 4.0}, "runs": runs}))
    waves = policy_bench.report(path)["policies"]["waves"]
    a, b = waves["itl_ci_runs"]
    assert a > 0 and b > 0 and waves["itl_spread"] == pytest.approx(1.0 / 9.8, abs=1e-3)
    # The spread's interval: the two runs' half-widths in quadrature, over their median.
    expected = ((9.3 * a) ** 2 + (10.3 * b) ** 2) ** 0.5 / 9.8
    assert waves["itl_spread_ci"] == pytest.approx(expected, abs=1e-3)
    assert waves["throughput_little_ci_runs"] == [0.0, 0.0]
    # A run recorded without its series has no interval, and the spread then none either.
    del runs["waves"][1]["points"][0]["series"]
    path.write_text(json.dumps({"summary": {"loads": [0.5, 1.3], "duration_s": 4.0}, "runs": runs}))
    waves = policy_bench.report(path)["policies"]["waves"]
    assert waves["itl_ci_runs"][1] is None and waves["itl_spread_ci"] is None


def test_waves_is_served_with_the_bounds_wave_group_and_the_others_without(monkeypatch):
    """`amoe bench policies` runs waves as `amoe plan` would serve it: with the bound's wave group
    (docs/scheduler.md "Group cells"; 4 waves of 64 on the 4-block 2 + 2 A100 setup); before, it served the
    straggler wait and the meeting block, which cannot tell a rank's waves apart. The other policies have no
    group to set."""
    import asyncio

    served: dict[str, AmoeConfig] = {}

    class Server:
        def __init__(self, config):
            self.config = config

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    async def point(server, setup, p, seed, rate, kind, **kw):
        served[setup.policy] = server.config
        return {"kind": kind}

    monkeypatch.setattr(policy_bench, "ServerProcess", Server)
    monkeypatch.setattr(policy_bench, "load_point", point)
    p = policy_bench._preset(4, (0.5,), 4.0, 40.0)
    group = policy_bench.wave_group(p)
    assert group == 4
    for policy in ("waves", "defrag"):
        asyncio.run(policy_bench._policy_points(policy, p, 0, group=group))
    assert (served["waves"].scheduler.policy, served["waves"].scheduler.wave_group) == ("waves", 4)
    assert (served["defrag"].scheduler.policy, served["defrag"].scheduler.wave_group) == ("defrag", 0)
