"""`amoe bench compare --preset ci`: starts an emulated AEP and an EP deployment, sweeps two rates against each,
and writes sane numbers (not the AEP / EP ratio: that is what docs/findings.md records) and both plots."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from amoe.perf.studies.compare_report import busy_summary, throughput_at_itl
from amoe.perf.studies.compare_setup import PRESETS, Setup, serve_config, time_scale, upper_bound
from amoe.perf.studies.point import busy_fractions, ended, rows_per_step
from amoe.perf.studies.probe import Scrape, histogram_quantile, parse_metrics, process_tree_cpu_s


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
            "amoe_request_ttft_seconds_sum 0.5",
            "amoe_request_ttft_seconds_count 4.0",
            'amoe_runtime_busy_seconds_total{runtime="0",role="attention"} 2.5',
            'amoe_runtime_busy_seconds_total{runtime="3",role="expert"} 1.5',
            'amoe_runtime_uptime_seconds_total{runtime="0",role="attention"} 4.0',
            'amoe_runtime_batch_size_rows_sum{kind="attn",runtime="0"} 90.0',
            'amoe_runtime_batch_size_rows_count{kind="attn",runtime="0"} 2.0',
            'amoe_runtime_batch_size_rows_sum{kind="attn",runtime="1"} 30.0',
            'amoe_runtime_batch_size_rows_count{kind="attn",runtime="1"} 1.0',
            'amoe_runtime_batch_size_rows_sum{kind="expert",runtime="3"} 512.0',
            'amoe_runtime_batch_size_rows_count{kind="expert",runtime="3"} 1.0',
            'amoe_requests_finished_total{reason="stop"} 7.0',
            'amoe_requests_finished_total{reason="error"} 0.0',
        ]
    )
    s = parse_metrics(text, t=1.0)
    assert s.finished == {"stop": 7.0, "error": 0.0}
    # The batches the runtime ran, by step kind over every runtime: rows per step over a window (set beside a prediction's).
    assert s.batch_rows == {"attn": [120.0, 3.0], "expert": [512.0, 1.0]}
    later = parse_metrics(text.replace("} 90.0", "} 190.0").replace('"0"} 2.0', '"0"} 4.0'), t=2.0)
    assert rows_per_step(s, later) == {"attn": 50.0}  # 100 more rows in 2 more steps; no new expert step
    assert (s.tokens, s.queue_tokens, s.itl_count) == (120.0, 12.0, 10.0)
    assert (s.ttft_sum, s.ttft_count) == (0.5, 4.0)
    assert s.busy == {"attention 0": 2.5, "expert 3": 1.5}
    assert s.uptime == {"attention 0": 4.0}
    assert histogram_quantile(0.5, Scrape(0.0), s) == pytest.approx(0.1 + 0.1 * (1 / 6))


def test_busy_fraction_is_read_on_the_runtimes_clock():
    # Scrapes 3 s apart carry reports 2 s apart (a heartbeat late at one end): busy 1.8 s of those 2 s is 0.9,
    # where the scrapes' clock would say 0.6. A runtime with no new report in the window has no fraction.
    first, last = Scrape(10.0), Scrape(13.0)
    first.busy, first.uptime = {"attention 0": 5.0, "expert 1": 2.0}, {"attention 0": 7.5, "expert 1": 7.5}
    last.busy, last.uptime = {"attention 0": 6.8, "expert 1": 2.0}, {"attention 0": 9.5, "expert 1": 7.5}
    assert busy_fractions(first, last) == {"attention 0": 0.9}


def test_busy_summary_and_host_cpu():
    assert busy_summary({"attention 0": 0.5, "attention 1": 0.7, "expert 2": 0.25}) == "a0.60/e0.25"
    assert busy_summary({}) == "n/a"
    # The child burns 0.3 s of CPU, says so, then sleeps: the check waits for its word, not for a deadline a
    # busy host may not meet.
    burn = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        # Own CPU is read before the scan: read after it, CPU this process's other threads spend in between (pytest
        # leaves some running) would be subtracted from the child's share.
        own = sum(os.times()[:2])
        assert (process_tree_cpu_s(os.getpid()) or 0) - own >= 0.25  # the child's CPU counts toward this tree
        assert process_tree_cpu_s(child.pid) >= 0.25
    finally:
        child.kill()
        child.wait()


def test_a_point_records_the_requests_the_coordinator_ended():
    # A point whose load was thinned by timeouts says so: requests ended over the whole point, by reason.
    first, mid, last = Scrape(0.0), Scrape(1.0), Scrape(2.0)
    first.finished = {"stop": 5.0, "error": 0.0}
    mid.finished = {"stop": 9.0, "error": 2.0}
    last.finished = {"stop": 12.0, "error": 3.0, "length": 1.0}
    assert ended([first, mid, last]) == {"error": 3, "length": 1, "stop": 7}
    assert ended([last]) == {}


def test_serve_config_and_bound():
    from amoe.config import ServerSection
    from amoe.perf.plan.deployment import Deployment
    from amoe.perf.plan.serving import from_config

    p = PRESETS["quick"]
    ep = serve_config(Setup.of("ep", 8), p, seed=0)
    assert ep.parallel.mode == "ep" and ep.executor.kind == "emulated" and ep.emulation.decode_only
    # what is served is the setup's deployment at the preset's caps, on one node
    want = Deployment("ep", "a100-80g", 8, attn_cap=p.attn_cap, expert_cap=p.expert_cap, gpus_per_node=8)
    assert from_config(ep) == want
    # The coordinator's timeouts count emulated seconds: its defaults stretched by the run's time scale, so a
    # slow plan's first token at a large scale is not cut off (amoe.perf.studies.compare_setup.emulated_timeouts).
    scale = time_scale(Setup.of("ep", 8), p)
    assert scale > 1 and ep.emulation.time_scale == scale
    assert ep.server.stall_timeout_s == pytest.approx(ServerSection().stall_timeout_s * scale)
    assert ep.server.request_timeout_s == pytest.approx(ServerSection().request_timeout_s * scale)
    aep = Setup.of("aep", 4, 4)
    assert upper_bound(aep, p) < upper_bound(aep, p, max_attn_batch=4096)
    assert upper_bound(Setup.of("ep", 8), p) == upper_bound(aep, p)  # the same 8 GPUs


def test_a_setup_records_and_reads_back_as_before():
    """A point's "setup" is the flat record results.json has always held (gpus_per_node 0: one node), and a
    recorded setup reads back to the same deployment."""
    two_nodes = Setup.of(
        "aep", 8, 8, profile="mixtral-8x7b-16e", gpus_per_node=8, slowdown=2.0, policy="defrag"
    )
    assert two_nodes.record() == {
        "mode": "aep", "attn": 8, "experts": 8, "policy": "defrag", "top_k": 1, "workload": "short",
        "profile": "mixtral-8x7b-16e", "gpu": "a100-80g", "group": "main", "gpus_per_node": 8, "slowdown": 2.0,
    }  # fmt: skip
    for setup in (two_nodes, *PRESETS["full"].sweeps, *(s for g in PRESETS["full"].extra for s in g)):
        assert Setup.from_record(setup.record()) == setup
    assert [s.record()["gpus_per_node"] for s in PRESETS["quick"].sweeps] == [0, 0]
    assert [s.name for s in PRESETS["quick"].sweeps] == ["aep4+4-defrag-top1-short", "ep8-top1-short"]


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
        assert 0 < pt["ttft_ms_mean"] < 10_000, pt
        roles = {k.split()[0] for k in pt["busy"]}
        assert roles == ({"attention", "expert"} if pt["setup"]["mode"] == "aep" else {"attention"}), pt
        assert all(0 < v <= 1.05 for v in pt["busy"].values()), pt  # a fraction of the window's wall time
        assert 0 < pt["host_cores"] < 64, pt
    assert "busy" in done.stdout and "host" in done.stdout  # the table shows them
    for png in ("throughput_vs_itl.png", "queue_depth.png"):
        assert (out / png).stat().st_size > 1000


def test_only_groups_keeps_the_named_groups():
    from amoe.errors import ConfigError
    from amoe.perf.studies.compare_setup import only_groups

    full = PRESETS["full"]
    p = only_groups(full, ["top2", "16gpu"])
    assert [s.group for s in p.sweeps] == ["top2", "top2"] and [g[0].group for g in p.extra] == ["16gpu"]
    assert p.policy_base is None  # the policy comparison belongs to the main group
    assert only_groups(full, ["main"]).policy_base == full.policy_base
    with pytest.raises(ConfigError, match="no group nope"):
        only_groups(full, ["nope"])


def test_scaling_compares_each_modes_best_on_16_and_8_gpus():
    from amoe.perf.studies.compare_report import scaling

    def pt(group, mode, tput):
        return {"group": group, "setup": {"mode": mode}, "throughput": tput}

    points = [
        pt("16e8gpu", "aep", 100),
        pt("16e8gpu", "aep", 120),
        pt("16gpu", "aep", 228),
        pt("16e8gpu", "ep", 90),
    ]
    points += [pt("16gpu", "ep", 99), pt("main", "aep", 1000)]
    assert scaling(points) == {"aep_16gpu_over_8gpu": 1.9, "ep_16gpu_over_8gpu": 1.1}
    assert scaling([pt("main", "aep", 5)]) == {}
    assert "16e8gpu" in {s.group for g in PRESETS["full"].extra for s in g}


def test_throughput_at_itl_reads_the_curve_between_load_points():
    sweep = [
        {"rate": 1.0, "throughput": 100.0, "itl_ms_mean": 8.0},
        {"rate": 2.0, "throughput": 200.0, "itl_ms_mean": 14.0},
        {"rate": 3.0, "throughput": 210.0, "itl_ms_mean": 30.0},
        {"rate": 4.0, "throughput": 0.0, "itl_ms_mean": None},  # a point that measured nothing
    ]
    assert throughput_at_itl(sweep, 11.0) == pytest.approx(150.0)  # halfway from 8 to 14 ms
    assert throughput_at_itl(sweep, 14.0) == pytest.approx(200.0)
    assert throughput_at_itl(sweep, 22.0) == pytest.approx(205.0)
    assert throughput_at_itl(sweep, 99.0) == pytest.approx(210.0)
    assert throughput_at_itl(sweep, 5.0) == 0.0  # faster than any measured point: nothing to claim


def test_repeated_runs_report_medians_spreads_and_agreement():
    from amoe.perf.studies.compare_report import median_headline

    runs = [
        {"aep_over_ep": 1.00, "aep_max_tokens_per_s": 100, "defrag_vs_mtfs": {"throughput": 1.02}, "saturated_points": []},
        {"aep_over_ep": 1.04, "aep_max_tokens_per_s": 110, "defrag_vs_mtfs": {"throughput": 1.00}, "saturated_points": ["x@1"]},
        {"aep_over_ep": 1.02, "aep_max_tokens_per_s": 90, "defrag_vs_mtfs": {"throughput": 1.01}, "saturated_points": []},
    ]  # fmt: skip
    out = median_headline(runs)
    assert out["aep_over_ep"] == 1.02 and out["aep_max_tokens_per_s"] == 100
    assert out["defrag_vs_mtfs"] == {"throughput": 1.01}
    assert out["spread"] == {
        "aep_over_ep": round(0.04 / 1.02, 3),
        "defrag_vs_mtfs.throughput": round(0.02 / 1.01, 3),
    }
    assert out["runs"] == 3 and out["agree_within_5pct"] and out["saturated_points"] == ["x@1"]
    runs[1]["aep_over_ep"] = 1.10  # one ratio 8 % off: the runs no longer agree
    assert not median_headline(runs)["agree_within_5pct"]
    assert median_headline(runs[:1])["runs"] == 1


def test_a_saturated_point_is_rerun_at_twice_the_time_scale(monkeypatch):
    import asyncio
    import contextlib

    from amoe.perf.studies import compare
    from amoe.perf.studies.compare_setup import time_scale

    p = PRESETS["ci"]
    started = []

    def server(config):
        started.append(config.emulation.time_scale)
        return contextlib.nullcontext()

    async def point(server, setup, p, seed, rate, kind):
        scale = time_scale(setup, p)
        hot = scale < 1.5 * p.time_scale  # the preset's scale saturates, twice it does not
        return {"config": setup.name, "rate": rate, "kind": kind, "throughput": scale, "itl_ms_mean": 1.0,
                "host_cores": 1.9 if hot else 1.0, "saturated": hot, "time_scale": scale}  # fmt: skip

    monkeypatch.setattr(compare, "ServerProcess", server)
    monkeypatch.setattr(compare, "load_point", point)
    points = asyncio.run(compare._points(Setup.of("ep", 4), p, 0, [10.0, 20.0], "sweep"))
    assert started == [
        p.time_scale,
        2 * p.time_scale,
        2 * p.time_scale,
    ]  # one sweep server, one rerun per point
    assert [pt["time_scale"] for pt in points] == [2 * p.time_scale] * 2 and not any(
        pt["saturated"] for pt in points
    )
    assert points[0]["rerun_of"]["host_cores"] == 1.9


def test_loads_override_parses_and_rejects_bad_values():
    from amoe.errors import ConfigError
    from amoe.perf.studies.compare import _loads

    assert _loads("0.5,1.5") == (0.5, 1.5)
    for bad in ("0.5,x", "0,1", ""):
        with pytest.raises(ConfigError, match="--loads"):
            _loads(bad)


def test_policies_compare_throughput_at_their_maxima_and_itl_at_a_load_all_sustain():
    """defrag's maximum is its sweep's best point; another policy's is its point at that rate (kind policy_max).
    ITL compares at the policy load, where a policy past its capacity would measure a backlog, not a rate."""
    from amoe.perf.studies.compare_report import _policy_ratios

    def pt(policy, kind, rate, tps, itl):
        config = f"aep4+4-{policy}-top1-short"
        return {"kind": kind, "config": config, "setup": {"policy": policy}, "rate": rate, "throughput": tps,
                "itl_ms_mean": itl}  # fmt: skip

    points = [pt("defrag", "sweep", 100, 9000, 10), pt("defrag", "sweep", 200, 12000, 14),
              pt("defrag", "policy", 60, 6000, 9), pt("flfs", "policy", 60, 6000, 18),
              pt("flfs", "policy_max", 200, 8000, 40), pt("mtfs", "policy", 60, 5900, 10)]  # fmt: skip
    out = _policy_ratios(points)
    assert out["defrag_vs_flfs"] == {"itl_mean": 0.5, "throughput_at_load": 1.0, "throughput": 1.5}
    # mtfs has no maximum point: only the at-load ratios.
    assert out["defrag_vs_mtfs"] == {"itl_mean": 0.9, "throughput_at_load": round(6000 / 5900, 3)}
    assert _policy_ratios([p for p in points if p["setup"]["policy"] != "defrag"]) == {}


def test_steady_points_give_the_maxima_and_aep_at_eps_itl():
    """With steady points (quick and full presets) the maxima are the steady points at the requests the best load
    points held, AEP / EP at EP's ITL reads AEP's steady points aimed at that ITL, and defrag's maximum against
    the other policies' is its steady point; the Poisson load points stay for the curves."""
    from amoe.perf.studies.compare_report import _group_ratios, _policy_ratios

    p = PRESETS["quick"]
    assert p.steady and not PRESETS["ci"].steady

    def pt(mode, kind, rate, tps, itl, policy="defrag"):
        setup = Setup.of(mode, 4 if mode == "aep" else 8, 4 if mode == "aep" else 0, policy=policy)
        return {"kind": kind, "config": setup.name, "group": "main", "setup": setup.record(),
                "rate": rate, "throughput": tps, "itl_ms_mean": itl}  # fmt: skip

    points = [
        pt("aep", "sweep", 1500, 150_000, 7.0), pt("aep", "sweep", 3000, 260_000, 11.0),
        pt("ep", "sweep", 1500, 148_000, 3.7), pt("ep", "sweep", 3000, 280_000, 7.4),  # a backlog's crest
        pt("aep", "policy", 1300, 128_000, 6.5),
        pt("aep", "max", 2.6e5, 250_000, 11.2), pt("ep", "max", 3.6e5, 270_000, 7.5),
        pt("aep", "at_itl", 2e5, 170_000, 7.3), pt("aep", "at_itl", 2e5, 178_000, 7.6),
        pt("aep", "policy", 1300, 125_000, 7.4, "mtfs"), pt("aep", "policy_max", 1e5, 200_000, 14.0, "mtfs"),
    ]  # fmt: skip
    out = _group_ratios(points, "main", p, 0)
    assert out["aep_max_tokens_per_s"] == 250_000 and out["ep_max_tokens_per_s"] == 270_000
    assert out["ep_itl_ms_at_max"] == 7.5
    assert out["aep_over_ep"] == round((170_000 + 8_000 * 2 / 3) / 270_000, 3)  # between 7.3 and 7.6 ms
    assert _policy_ratios(points)["defrag_vs_mtfs"]["throughput"] == 1.25  # 250 k / 200 k


def test_steady_points_aim_aep_at_eps_itl_and_stay_within_what_its_maximum_held(monkeypatch):
    """Each main setup gets a steady point at the requests its best load point held; AEP then runs at the requests
    Little's law gives for EP's ITL on its curve, and once more aimed by the ITL that measured, never above what
    its maximum held."""
    from amoe.perf.studies import compare

    ran = []

    async def fake_steady(setup, p, seed, requests, itl_ms, kind):
        # AEP's ITL grows with its requests: 4 ms + 1 ms per 1,000; EP's is 7.5 ms.
        itl = 4.0 + requests / 1000 if setup.mode == "aep" else 7.5
        ran.append((setup.mode, kind, requests))
        return {"config": setup.name, "group": setup.group, "setup": dataclasses.asdict(setup), "kind": kind,
                "rate": requests / itl, "throughput": requests / itl * 1000, "itl_ms_mean": itl,
                "running_mean": float(requests)}  # fmt: skip

    monkeypatch.setattr(compare, "_steady", fake_steady)
    p = PRESETS["quick"]
    aep, ep = p.sweeps

    def sweep(setup, tps, itl, held):
        return {"config": setup.name, "group": "main", "kind": "sweep", "rate": 1.0, "throughput": tps,
                "itl_ms_mean": itl, "running_mean": held}  # fmt: skip

    points = [sweep(aep, 150_000, 7.0, 1050), sweep(aep, 260_000, 11.0, 7000), sweep(ep, 270_000, 7.4, 2000)]
    out = asyncio.run(compare._steady_points(p, 0, points))
    assert ran[:2] == [("aep", "max", 7000), ("ep", "max", 2000)]
    # On the curve (7.0 ms, 150 k) .. (11.0 ms, 260 k) EP's 7.5 ms is 163.75 k, so 1,228 requests; those measure
    # 5.23 ms (this fake is faster than the curve), so the second try takes 1,228 × 7.5 / 5.23.
    assert ran[2] == ("aep", "at_itl", 1228) and ran[3] == ("aep", "at_itl", round(1228 * 7.5 / 5.228))
    assert len(out) == 4 and all(r[2] <= 7000 for r in ran)
