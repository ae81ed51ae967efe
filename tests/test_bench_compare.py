"""`amoe bench compare --preset ci`: starts an emulated AEP and an EP deployment, sweeps two rates against each,
and writes sane numbers (not the AEP / EP ratio: that is what docs/results.md records) and both plots."""

import json
import subprocess
import sys

import pytest

from amoe.bench.compare_setup import PRESETS, Setup, serve_flags, upper_bound
from amoe.bench.probe import Scrape, histogram_quantile, parse_metrics


def test_parse_metrics_sums_series_and_quantiles():
    text = "\n".join(
        [
            "# HELP amoe_coordinator_generation_tokens_total x",
            "amoe_coordinator_generation_tokens_total 120.0",
            'amoe_runtime_queue_depth_tokens{runtime="1",block="0",expert="3",rank=""} 5.0',
            'amoe_runtime_queue_depth_tokens{runtime="0",block="2",expert="",rank="0"} 7.0',
            'amoe_request_itl_seconds_bucket{le="0.1"} 4.0',
            'amoe_request_itl_seconds_bucket{le="0.2"} 10.0',
            'amoe_request_itl_seconds_bucket{le="+Inf"} 10.0',
            "amoe_request_itl_seconds_count 10.0",
            "amoe_request_itl_seconds_sum 1.2",
        ]
    )
    s = parse_metrics(text, t=1.0)
    assert (s.tokens, s.queue_tokens, s.itl_count) == (120.0, 12.0, 10.0)
    assert histogram_quantile(0.5, Scrape(0.0), s) == pytest.approx(0.1 + 0.1 * (1 / 6))


def test_serve_flags_and_bound():
    p = PRESETS["quick"]
    ep = serve_flags(Setup("ep", 8), p, seed=0)
    assert "--expert-ranks" not in ep and ep[ep.index("--parallel") + 1] == "ep"
    aep = Setup("aep", 4, 4)
    assert upper_bound(aep, p) < upper_bound(aep, p, max_attn_batch=4096)
    assert upper_bound(Setup("ep", 8), p) == upper_bound(aep, p)  # the same 8 GPUs


@pytest.mark.timeout(240)
def test_ci_preset_completes(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "amoe", "bench", "compare", "--preset", "ci", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["aep_max_tokens_per_s"] > 0 and summary["ep_max_tokens_per_s"] > 0
    assert 0 < summary["aep_fraction_of_upper_bound"] < 1.5
    record = json.loads((out / "results.json").read_text())
    modes = {pt["setup"]["mode"] for pt in record["points"]}
    assert modes == {"aep", "ep"}
    for pt in record["points"]:
        assert pt["throughput"] > 0, pt
        assert 1.0 < pt["itl_ms_mean"] < 1000.0, pt  # emulated ms: 4 blocks of ~0.5 ms each and more
    for png in ("throughput_vs_itl.png", "queue_depth.png"):
        assert (out / png).stat().st_size > 1000
