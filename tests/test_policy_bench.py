"""`amoe bench policies`' summary: throughput by Little's law beside the token counter's, medians and spreads over
runs, and a recorded run summarised again (amoe.emulation.policy_bench)."""

from __future__ import annotations

import json

import pytest

from amoe.emulation import policy_bench


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
