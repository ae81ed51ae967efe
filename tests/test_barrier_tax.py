"""The barrier tax (docs/simulation.md "The barrier tax"): request traces, every attention rank's attention from
its own requests in the simulation at scale, the waits a barrier counts there and in the runtime, and AEP, which
has no barrier."""

from __future__ import annotations

from dataclasses import replace

import golden
import numpy as np
import pytest
import torch

from amoe import core
from amoe.errors import ConfigError
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.traces import RequestTrace, load_trace, steady_state
from amoe.perf.model.variance import OFF, SOURCED
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import simulate
from amoe.perf.plan.simulate.rank_steps import RankSteps
from amoe.perf.plan.simulate.trace_loads import BLOCK_SIZE, TraceLoads
from amoe.perf.studies.frontier import table_text
from amoe.perf.studies.trace_derive import derive
from amoe.runtime.sync.moe import Routed, receive_combine, send_dispatch, serve_experts
from amoe.runtime.sync.stats import SyncStats

MODEL = "qwen3-235b-a22b:4"
ROUTING = "skew-exp:0.005"
HOST = host_overhead("amoe-paper")


def _trace(inputs, outputs) -> RequestTrace:
    n = len(inputs)
    return RequestTrace("t", np.arange(n, dtype=float), np.array(inputs), np.array(outputs))


def test_the_azure_traces_load_with_their_published_counts():
    """Every request of the published hour is there, in arrival order, with its token counts (the source's
    figures, amoe/perf/model/data/README.md)."""
    conv, code = load_trace("azure-conv"), load_trace("azure-code")
    assert (len(conv), len(code)) == (19366, 8819)
    assert conv.input_tokens.mean() == pytest.approx(1154.6974, abs=1e-3)
    assert code.output_tokens.mean() == pytest.approx(27.8825, abs=1e-3)
    assert (np.diff(conv.arrival_s) >= 0).all() and conv.arrival_s[0] == 0.0


def test_a_trace_is_derived_deterministically_and_read_back(tmp_path):
    src = tmp_path / "azure.csv"
    src.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    first, again = derive(src), derive(src)
    assert first == again and first[:2] == b"\x1f\x8b"
    (tmp_path / "t.csv.gz").write_bytes(first)
    t = load_trace(str(tmp_path / "t.csv.gz"))
    assert t.arrival_s.tolist() == pytest.approx([0.0, 4.314579]) and t.output_tokens.tolist() == [44, 109]


@pytest.mark.parametrize(
    "text",
    [
        "a,b,c\n1,2,3\n",
        "arrival_s,input_tokens,output_tokens\n1,2\n",
        "arrival_s,input_tokens,output_tokens\n0,0,3\n",
    ],
)
def test_a_bad_trace_file_is_refused_with_its_reason(tmp_path, text):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match="bad.csv"):
        load_trace(str(path))
    with pytest.raises(ConfigError, match="unknown trace"):
        load_trace(str(tmp_path / "none.csv"))


def test_the_mean_decode_context_weights_each_request_by_its_rows():
    """Decode only: a request of input I and output O decodes O rows reading I, I + 1, ..., I + O - 1 tokens."""
    t = _trace([10, 100], [1, 3])
    assert t.mean_decode_context() == pytest.approx((10 + 100 + 101 + 102) / 4)
    draw = steady_state(t, 4000, np.random.default_rng(1))
    assert (draw.index == 1).mean() == pytest.approx(0.75, abs=0.03)  # held in proportion to its rows
    assert ((draw.left >= 1) & (draw.context >= t.input_tokens[draw.index])).all()


def test_ranks_bind_by_free_blocks_and_ended_requests_are_replaced_in_arrival_order():
    t = _trace([100, 20, 300, 40, 50, 60], [2, 1, 1, 5, 5, 5])
    loads = TraceLoads(t, ranks=2, per_rank=2, seed=0)
    assert (loads.left > 0).all() and loads.reserved.sum() == loads.reserve.sum()
    before = loads.next
    while loads.ended < 3:
        loads.decode()
    assert loads.next >= before + 3  # every ended request was replaced, from the trace's queue in order
    # a rank with no room for the next request's blocks leaves its slot empty until it has
    tight = TraceLoads(
        _trace([160, 160], [1, 1]), ranks=1, per_rank=2, seed=0, kv_blocks=160 // BLOCK_SIZE + 1
    )
    assert (tight.left > 0).sum() == 1


def test_a_rank_with_longer_contexts_is_slower():
    model, gpu = model_profile(MODEL), gpu_profile("h800")
    steps = RankSteps(model, gpu, HOST, 2, 1, 8, 1000.0, load_trace("azure-conv"), seed=0)
    steps.loads.context[0] = 8000.0  # rank 0's requests read 8,000 tokens each, rank 1's keep the trace's
    steps.loads.context[1] = 500.0
    rows, attn = steps.step()
    assert rows[0, 0] == rows[0, 1] and attn[0, 0] > attn[0, 1]
    assert attn[0, 1] == pytest.approx(
        cm.attention_layer_time(model, gpu, np.ones(8), np.full(8, 500.0), HOST)
    )
    balanced = RankSteps(model, gpu, HOST, 2, 1, 8, 1000.0, load_trace("azure-conv"), seed=0, balanced=True)
    balanced.loads.context[:] = steps.loads.context
    assert np.ptp(balanced.step()[1]) == 0.0


def _ep(n: int = 8, **kw):
    return simulate(
        model_profile(MODEL), Deployment("ep", "h800", n, attn_cap=32, gpus_per_node=16), ROUTING, 1226.5, HOST,
        n * 32, duration_s=0.03, **kw,
    )  # fmt: skip


@golden.case("simulate")
def ep_on_a_trace() -> golden.Figures:
    """EP over 8 H800s (Qwen3-235B-A22B at 4 blocks) on the Azure conversation trace: the simulation's throughput,
    its idle fractions and the perfectly balanced twin's, without and with step-time variance."""
    trace = load_trace("azure-conv")
    out = {}
    for name, variance in (("off", OFF), ("sourced", SOURCED)):
        sim, bal = (_ep(variance=variance, trace=trace, balanced=b) for b in (False, True))
        out[name] = {
            "tokens_per_s": sim.tokens_per_s, "barrier_idle": sim.barrier_idle, "attention_idle": sim.attention_idle,
            "balanced_tokens_per_s": bal.tokens_per_s, "balanced_attention_idle": bal.attention_idle,
        }  # fmt: skip
    return out


def test_a_barrier_waits_for_the_slowest_rank_and_balance_removes_the_attention_sides_wait():
    f = ep_on_a_trace.check()
    off, varied = f["off"], f["sourced"]
    assert off["attention_idle"] > 0 and off["balanced_attention_idle"] == 0.0  # perfect balance: no wait
    assert off["balanced_tokens_per_s"] > off["tokens_per_s"]  # the tax, paid in throughput
    assert (
        varied["barrier_idle"] > off["barrier_idle"] > off["attention_idle"]
    )  # experts and slow GPUs wait too


def test_aep_has_no_barrier_and_reads_each_waves_requests():
    model = model_profile(MODEL)
    dep = Deployment("aep", "h800", 4, "h800", 4, attn_cap=64, expert_cap=1024)
    trace = load_trace("azure-code")
    run = {"duration_s": 0.02, "warmup_s": 0.01, "variance": OFF}
    traced = simulate(model, dep, ROUTING, trace.mean_decode_context(), HOST, 512, trace=trace, **run)
    mean = simulate(model, dep, ROUTING, trace.mean_decode_context(), HOST, 512, **run)
    assert traced.barrier_idle == 0.0 and traced.attention_idle == 0.0
    assert traced.attention_busy != mean.attention_busy and traced.tokens_per_s > 0
    with pytest.raises(ValueError, match="at scale only"):
        simulate(model, dep, ROUTING, 1000.0, HOST, 512, trace=trace, level="events")


def test_the_runtime_counts_each_devices_wait_for_a_slower_peers_step():
    """Over in-process exchanges: each dispatch says how long its attention step took, so every device's wait at
    the experts' barrier is the slowest step less its own; at the combine, the slowest expert step less its own."""
    hub = core.LoopbackHub(3)
    exs = [core.BarrierExchange(hub.communicator(d), d, 2.0, [0, 1, 2], [0, 1, 2]) for d in range(3)]
    steps = [0.004, 0.010, 0.001]
    plans = []
    for d, ex in enumerate(exs):
        routed = Routed(
            torch.zeros(2, 4), torch.tensor([[0], [1]]), torch.ones(2, 1), torch.arange(2), torch.arange(2)
        )
        plans.append(send_dispatch(ex, 1, 0, 0, routed, steps[d]))
    stats = [SyncStats(1, 3) for _ in exs]

    class Echo:
        def run_grouped(self, batches):
            return [b.x for b in batches]

    expert_s = [
        serve_experts(ex, 1, 0, 0, [0, 1, 2], Echo(), st, own_s=steps[d])
        for d, (ex, st) in enumerate(zip(exs, stats))
    ]
    for d, ex in enumerate(exs):
        receive_combine(ex, plans[d], stats[d], own_s=expert_s[d])
        assert ex.slowest_step_s == pytest.approx(max(expert_s), rel=1e-6)
    for d, st in enumerate(stats):
        snap = st.snapshot()
        assert snap["attention_idle_s"] == pytest.approx(0.010 - steps[d], abs=1e-7)
        assert snap["barrier_idle_s"] == pytest.approx(
            0.010 - steps[d] + max(expert_s) - expert_s[d], abs=1e-6
        )


def test_the_table_says_where_aep_wins_and_what_share_of_its_gain_the_tax_is():
    cells = [
        {"profile": "p", "itl_slo_ms": 50.0, "gpus": 16, "mode": "aep", "per_gpu": 1100},
        {"profile": "p", "itl_slo_ms": 50.0, "gpus": 16, "mode": "pingpong", "per_gpu": 500},
        {"profile": "p", "itl_slo_ms": 50.0, "gpus": 16, "mode": "ep", "per_gpu": 1000, "tax": 0.05,
         "balanced_per_gpu": 1050},
    ]  # fmt: skip
    line = table_text(cells, ["p"], [16]).splitlines()[1].split()
    assert line[-4:] == ["aep", "1.100", "5.00%", "0.500"]  # best, AEP / best, EP's tax, tax / AEP's gain
    cells[0]["per_gpu"] = 900  # AEP behind EP: no gain for the tax to be a share of
    assert table_text(cells, ["p"], [16]).splitlines()[1].split()[-4:] == ["ep", "0.900", "5.00%", "-"]


def test_waves_at_scale_gathers_each_group_into_one_step_within_its_bound():
    """Group cells at scale (docs/scheduler.md): at the bound's concurrency, without variance, waves reaches its
    bound and no more, with expert steps of every attention GPU's group (defrag's are smaller)."""
    from amoe.config import SchedulerSection
    from amoe.perf.model.routing import routing_inclusion
    from amoe.perf.plan import bounds
    from amoe.perf.plan.bound_pools import wave_group

    model, none = model_profile("deepseek-v3:4", 8), host_overhead("none")
    dep = Deployment("aep", "h800", 16, "h800", 16, attn_cap=64, expert_cap=1024)
    pred = bounds.predict(model, dep, routing_inclusion(model, "skew-exp:0.0025"), 2000.0, none, variance=OFF)
    itl, group = pred.concurrency / pred.tokens_per_s, wave_group(pred.extra, dep.attn_cap)

    def run(policy: str):
        return simulate(
            model, dep, "skew-exp:0.0025", 2000.0, none, pred.concurrency, warmup_s=4 * itl, duration_s=8 * itl,
            variance=OFF, scheduler=SchedulerSection(policy=policy, wave_group=group), level="scale",
        )  # fmt: skip

    waves, defrag = run("waves"), run("defrag")
    assert 0.95 * pred.tokens_per_s <= waves.tokens_per_s <= (1 + 1e-9) * pred.tokens_per_s
    assert waves.expert_rows_per_step > defrag.expert_rows_per_step


def test_waves_with_more_cells_a_block_than_the_cap_run_defrags_pick_and_the_plan_is_served_with_it():
    """A copy whose waves make more than MAX_GROUP_CELLS cells a block is simulated at scale with defrag's pick
    (its figure equals defrag's run) and refine says the plan is served with defrag; within the cap, waves'."""
    from amoe.config import SchedulerSection
    from amoe.perf.plan.refine import _policy_simulated
    from amoe.perf.plan.simulate.aep_scale import MAX_GROUP_CELLS

    model, none = model_profile("deepseek-v3:4", 8), host_overhead("none")
    dep = Deployment("aep", "h800", 16, "h800", 16, attn_cap=64, expert_cap=1024)

    def run(policy: str, waves_a_rank: int):
        c = 16 * 64 * waves_a_rank
        return simulate(
            model, dep, "skew-exp:0.0025", 2000.0, none, c, warmup_s=0.05, duration_s=0.1, variance=OFF,
            scheduler=SchedulerSection(policy=policy, wave_group=1), level="scale",
        )  # fmt: skip

    many, within = run("waves", MAX_GROUP_CELLS + 1), run("waves", MAX_GROUP_CELLS)
    assert (many.expert_pick, within.expert_pick) == ("defrag", "waves")
    assert many == replace(run("defrag", MAX_GROUP_CELLS + 1), expert_pick="defrag")
    assert _policy_simulated(model, dep, many, "waves") == "defrag"
    assert _policy_simulated(model, dep, within, "waves") == "waves"


def test_a_plan_on_a_trace_reads_the_traces_mean_context_and_a_bad_name_is_refused():
    from amoe.perf.plan.request import PlanRequest
    from amoe.perf.plan.search import workload_of

    ctx, trace = workload_of(PlanRequest("deepseek-v3", {"h800": 16}, workload="azure-code"))
    assert len(trace) == 8819
    assert ctx == pytest.approx(trace.mean_decode_context())
    assert workload_of(PlanRequest("deepseek-v3", {"h800": 16}))[1] is None  # a paper workload: no trace
    with pytest.raises(ConfigError, match="unknown trace"):
        workload_of(PlanRequest("deepseek-v3", {"h800": 16}, workload="nonesuch"))


def test_an_emulated_devices_step_is_what_its_gpu_clocks_held_not_the_wall_time_around_them():
    """The barrier tax's steps on emulated GPUs: the clocks' held seconds (cost model × speed × jitter × time scale)
    summed over the device's attention and expert clocks, however long the host took around them; a device
    without a clock counts the wall time of its busy sections."""
    from types import SimpleNamespace

    from amoe.runtime.emulated_clock import EmulatedClock
    from amoe.runtime.sync.stats import gpu_clock

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    def clock(speed: float) -> EmulatedClock:
        return EmulatedClock(100.0, speed=speed, jitter=lambda: 1.02, wall=lambda: now[0], sleep=sleep)

    attn, experts = clock(1.1), clock(0.9)
    device = gpu_clock(SimpleNamespace(compute=SimpleNamespace(clock=attn)), SimpleNamespace(clock=experts))
    stats = SyncStats(1, 2, device)
    with stats.busy():
        attn.hold(0.001, "attention")
        torch.zeros(64, 64).sum()  # host work around the hold: not the GPU's step
    assert stats.take_step() == pytest.approx(0.001 * 1.1 * 1.02 * 100)
    with stats.busy():
        experts.hold(0.002, "expert")
    assert stats.take_step() == pytest.approx(0.002 * 0.9 * 1.02 * 100)
    assert stats.take_step() == 0.0  # nothing held since
    assert gpu_clock(SimpleNamespace(compute=SimpleNamespace(clock=attn)), None) is not None
    assert gpu_clock(SimpleNamespace(compute=object()), None) is None  # a torch executor: no clock
    plain = SyncStats(1, 2)
    with plain.busy():
        pass
    assert 0.0 <= plain.take_step() == pytest.approx(plain.busy_s)
