"""Emulated GPUs: cost model shape and calibration, KV capacity, routing override, time-scaled holds, executors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from amoe.config import EmulationSection, ExecutorSection
from amoe.errors import ConfigError
from amoe.perf.model import cost_model as cm
from amoe.perf.model.calibration import CALIBRATION_POINTS, FIG3_KNEE_ROWS, MEDIUM_MEAN_CONTEXT
from amoe.perf.model.check import check_emulation
from amoe.perf.model.gpus import GPUS, gpu_profile
from amoe.perf.model.hosts import HOSTS, host_overhead
from amoe.perf.model.models import MODELS, model_profile
from amoe.perf.model.routing import (
    DEFAULT_LAMBDA,
    HOTTEST_TO_MEAN,
    RouterOverride,
    RoutingSpec,
    hottest_to_mean,
    row_keys,
)
from amoe.perf.model.shapes import model_config_of
from amoe.runtime.emulated import Emulation
from amoe.runtime.emulated_clock import EmulatedClock
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster

MIXTRAL = model_profile("mixtral-8x7b-mqa", top_k=1)
A100_40 = gpu_profile("a100-40g")
PAPER_HOST = host_overhead("amoe-paper")


def _router(mode: str = "skew-exp", experts: int = 8, top_k: int = 2, seed: int = 0) -> RouterOverride:
    return RouterOverride(RoutingSpec.parse(mode), experts, top_k, num_blocks=4, seed=seed)


# --- cost model -------------------------------------------------------------------------------------------


def test_profile_with_fewer_blocks():
    """`NAME:N` keeps N blocks and every per-layer cost, and pays N/32 of the head: an iteration is N/32 as long,
    so ratios between deployments do not move with the truncation."""
    short = model_profile("mixtral-8x7b-mqa:4", top_k=1)
    assert (short.num_blocks, short.name, short.top_k) == (4, "mixtral-8x7b-mqa:4", 1)
    g = gpu_profile("a100-80g")
    assert cm.expert_layer_time(short, g, 128) == cm.expert_layer_time(MIXTRAL, g, 128)
    assert cm.decode_attention_time(short, g, 64, 512) == cm.decode_attention_time(MIXTRAL, g, 64, 512)
    assert cm.head_time(short, g, 64) == pytest.approx(cm.head_time(MIXTRAL, g, 64) * 4 / 32)
    assert model_config_of(short).num_blocks == 4
    for bad in ("mixtral-8x7b-mqa:0", "mixtral-8x7b-mqa:33", "mixtral-8x7b-mqa:x"):
        with pytest.raises(ConfigError):
            model_profile(bad)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("gpu", list(GPUS))
def test_costs_grow_with_batch_and_context(model, gpu):
    m, g = model_profile(model), gpu_profile(gpu)
    batches = [1, 4, 16, 64, 128, 256, 1024]
    for host in HOSTS.values():
        expert = [cm.expert_layer_time(m, g, n, host) for n in batches]
        attn = [cm.decode_attention_time(m, g, n, 512, host) for n in batches]
        head = [cm.head_time(m, g, n, host=host) for n in batches]
        by_ctx = [cm.decode_attention_time(m, g, 64, c, host) for c in (1, 128, 2048, 32768)]
        for series in (expert, attn, head, by_ctx):
            assert all(a <= b for a, b in zip(series, series[1:])), series
        assert by_ctx[-1] > by_ctx[0]
    assert cm.expert_layer_time(m, g, 0) == 0.0 and cm.decode_attention_time(m, g, 0, 10) == 0.0


def test_prefill_chunk_costs_more_than_one_decode_row():
    prefill = cm.attention_layer_time(MIXTRAL, A100_40, [512], [512])
    decode = cm.attention_layer_time(MIXTRAL, A100_40, [1], [512])
    assert prefill > decode


def test_expert_throughput_has_figure3_shape():
    """Figure 3: rows/s rise ~linearly with batch until ~128 rows on an A100 40GB, then flatten."""
    knee = cm.expert_knee_rows(MIXTRAL, A100_40)
    assert 64 <= knee <= 256
    assert FIG3_KNEE_ROWS <= knee < 2 * FIG3_KNEE_ROWS  # read at powers of two: linear to 128, bent by 256

    def rows_per_s(n):
        return n / cm.expert_layer_time(MIXTRAL, A100_40, n)

    for n in (8, 16, 32, 64):  # doubling the batch doubles throughput up to 128 rows
        assert 1.85 <= rows_per_s(2 * n) / rows_per_s(n) <= 2.0
    assert rows_per_s(256) / rows_per_s(128) < 1.25  # then it flattens
    assert rows_per_s(1024) / rows_per_s(256) < 1.1


@pytest.mark.parametrize("point", CALIBRATION_POINTS, ids=lambda p: p.name)
def test_step_times_match_paper_section_5_4(point):
    m, g = model_profile(point.model, point.top_k), gpu_profile(point.gpu)
    if point.kind == "attention":
        predicted = cm.decode_attention_time(m, g, point.rows, point.context, PAPER_HOST)
    else:
        predicted = cm.expert_layer_time(m, g, point.rows, PAPER_HOST)
    assert 1 / 1.5 <= predicted / point.paper_s <= 1.5, (predicted, point.paper_s)


def test_expert_step_within_tolerance_over_the_derived_batch_range():
    g = gpu_profile("a100-80g")
    for rows in (256, 420, 512):
        assert 1 / 1.5 <= cm.expert_layer_time(MIXTRAL, g, rows, PAPER_HOST) / 0.8e-3 <= 1.5


def test_medium_workload_mean_context():
    assert cm.mean_decode_context((50, 150), (50, 250)) == pytest.approx(MEDIUM_MEAN_CONTEXT, abs=1)
    assert cm.mean_decode_context((10, 10), (1, 1)) == pytest.approx(10.5)


def test_kv_capacity_grows_with_memory_and_shrinks_with_weights():
    weights = cm.attention_rank_weight_bytes(MIXTRAL)
    tokens = [
        cm.kv_capacity_tokens(gpu_profile(g), MIXTRAL, weights) for g in ("a100-40g", "a100-80g", "h200")
    ]
    assert tokens[0] < tokens[1] < tokens[2]
    assert cm.kv_capacity_tokens(A100_40, MIXTRAL, 2 * weights) < tokens[0]
    assert cm.kv_capacity_tokens(A100_40, MIXTRAL, A100_40.memory) == 0
    # MQA: 512 bytes per token per block, 32 blocks → 16 KiB per token.
    assert tokens[1] == pytest.approx((80 * 2**30 * 0.9 - weights) / (512 * 32), rel=1e-6)


def test_transfers_cost_latency_plus_bytes_over_bandwidth():
    nvlink, net = A100_40.nvlink, A100_40.network
    assert cm.transfer_time(0, nvlink) == 0.0
    one_mb = cm.transfer_time(1e6, nvlink)
    assert one_mb == pytest.approx(nvlink.latency + 1e6 / nvlink.usable_bandwidth)
    assert cm.transfer_time(2e6, nvlink) > one_mb
    assert cm.transfer_time(1e6, net) > one_mb  # across nodes is slower
    assert cm.hidden_bytes(MIXTRAL, 10) == 10 * 4096 * 2


# --- routing override -------------------------------------------------------------------------------------


def test_routing_spec_parsing():
    assert RoutingSpec.parse("skew-exp").lam == DEFAULT_LAMBDA
    assert RoutingSpec.parse("skew-exp:0.7").lam == 0.7
    assert str(RoutingSpec.parse("skew-exp:0.7")) == "skew-exp:0.7"
    assert not RoutingSpec.parse("model").is_override
    spec = RoutingSpec.parse("skew-exp:0.08,rho=0.5,shift=2")
    assert (spec.lam, spec.rho, spec.shift_s) == (0.08, 0.5, 2.0)
    assert str(spec) == "skew-exp:0.08,rho=0.5,shift=2"
    assert RoutingSpec.parse(str(spec)) == spec
    for bad in ("zipf", "uniform:1", "skew-exp:x", "skew-exp:-1", "skew-exp,rho=1", "skew-exp,shift=0",
                "skew-exp,foo=1", "model,rho=0.5"):  # fmt: skip
        with pytest.raises(ConfigError):
            RoutingSpec.parse(bad)
    with pytest.raises(ConfigError):
        _router("model")


def test_routing_is_seeded_and_keyed():
    a, b = _router(seed=3).route(1, 500), _router(seed=3).route(1, 500)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], _router(seed=4).route(1, 500)[0])
    keys = row_keys(np.arange(100), np.arange(100) * 7)
    whole = _router(seed=3).route(2, 100, keys)[0]
    router = _router(seed=3)
    halves = np.concatenate([router.route(2, 50, keys[50:])[0], router.route(2, 50, keys[:50])[0]])
    assert np.array_equal(whole, np.concatenate([halves[50:], halves[:50]]))  # order-independent


@pytest.mark.parametrize("mode", ["uniform", "skew-exp", "skew-exp:2.0"])
@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (16, 2), (256, 8)])
def test_topk_ids_distinct_and_weights_sum_to_one(mode, experts, top_k):
    ids, weights = _router(mode, experts, top_k).route(0, 2000)
    assert ids.shape == weights.shape == (2000, top_k)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    assert ((ids >= 0) & (ids < experts)).all()
    assert all(len(set(row)) == top_k for row in ids.tolist())
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)


def test_uniform_routing_is_uniform():
    experts, rows = 16, 40_000
    ids, _ = _router("uniform", experts, 2).route(0, rows, row_keys(np.arange(rows), np.zeros(rows)))
    counts = np.bincount(ids.ravel(), minlength=experts)
    expected = rows * 2 / experts
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # chi-square with 15 dof: mean 15, sd ~5.5; top-2 without replacement is slightly under-dispersed.
    assert chi2 < 15 + 6 * 5.5, counts


@pytest.mark.parametrize("lam,experts,top_k", list(HOTTEST_TO_MEAN))
def test_skew_exp_hottest_to_mean_matches_documented(lam, experts, top_k):
    documented = HOTTEST_TO_MEAN[(lam, experts, top_k)]
    assert hottest_to_mean(experts, top_k, lam) == pytest.approx(documented, abs=0.006)
    router = _router(f"skew-exp:{lam}", experts, top_k, seed=5)
    rows = 100_000
    ids, _ = router.route(1, rows, row_keys(np.arange(rows), np.ones(rows)))
    counts = np.bincount(ids.ravel(), minlength=experts)
    assert counts.max() / counts.mean() == pytest.approx(documented, rel=0.03)
    assert counts.argmax() == router.hot_order[1][0]


def test_default_lambda_is_within_the_measured_mixtral_range():
    # OLMoE's Mixtral-8x7B routing counts: hottest/mean 1.16-1.58 for the first choice, 1.08-1.33 for top-2.
    assert 1.16 <= hottest_to_mean(8, 1, DEFAULT_LAMBDA) <= 1.58
    assert 1.08 <= hottest_to_mean(8, 2, DEFAULT_LAMBDA) <= 1.33


def test_hot_expert_is_fixed_per_block_and_varies_across_blocks():
    router = RouterOverride(RoutingSpec.parse("skew-exp"), 8, 1, num_blocks=32, seed=0)
    hottest = [order[0] for order in router.hot_order]
    assert len(set(hottest)) > 1
    assert np.array_equal(router.popularity, RouterOverride(router.spec, 8, 1, 32, seed=0).popularity)


# --- clock and executors ----------------------------------------------------------------------------------


class FakeWall:
    """Wall time that passes only when slept on, each sleep `late` seconds longer than asked (as time.sleep is)."""

    def __init__(self, late: float) -> None:
        self.t, self.late, self.asked = 0.0, late, []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.t += seconds + self.late


@pytest.mark.parametrize("late", [0.0, 1.5e-4, 2e-3])
def test_hold_sleeps_scaled_time_and_accounts_busy(late):
    """Ten holds of 0.5 ms at time scale 10 take 50 ms of wall time: each sleep asks for less by the clock's estimate
    of the oversleep and the rest is carried into the next hold, so however late the sleeps come back the total is
    the target's within one sleep's lateness."""
    wall = FakeWall(late)
    clock = EmulatedClock(time_scale=10.0, wall=wall.now, sleep=wall.sleep)
    for _ in range(10):
        clock.hold(0.5e-3, "expert", rows=4)  # 5 ms of wall time each
    assert len(wall.asked) == 10  # one sleep a hold
    assert wall.t == pytest.approx(0.05, abs=max(late, 1e-4))
    stats = clock.stats()
    assert stats["held_wall_s"] == pytest.approx(wall.t) and stats["elapsed_s"] == pytest.approx(wall.t / 10)
    assert stats["busy_s"] == pytest.approx(5e-3)
    assert stats["kinds"]["expert"] == {"steps": 10, "rows": 40, "busy_s": pytest.approx(5e-3)}
    with pytest.raises(ValueError):
        EmulatedClock(time_scale=0)


def emulated(**emulation) -> EmulationSection:
    return EmulationSection(routing="skew-exp", **emulation)


def test_emulation_config_validation():
    """The emulation reads the config's emulation section: the config checks its generic settings, the emulation
    (check_emulation, which every Emulation runs) the names the cost model owns."""
    for bad in (
        {"gpu": "v100"},
        {"profile": "gpt-5"},
        {"time_scale": 0},
        {"routing": "model"},
        {"host_overhead": "sglang"},
        {"profile": "mixtral-8x7b-mqa", "top_k": 9},
    ):
        with pytest.raises(ConfigError):
            check_emulation(EmulationSection(**{"routing": "skew-exp", **bad}))
    with pytest.raises(ConfigError, match="profile name or a checkpoint"):
        Emulation(EmulationSection(routing="skew-exp"))
    em = Emulation(emulated(profile="mixtral-8x7b-16e"), wire_hidden=32)
    assert (em.model_config.num_experts, em.model_config.top_k, em.model_config.hidden_size) == (16, 1, 32)
    assert em.profile.hidden_size == 4096  # costs use the real shapes


def test_an_ep_device_runs_its_experts_of_a_block_as_one_grouped_step():
    """EP's expert side is one grouped GEMM per device (bounds.py prices it so): the emulated executor holds once,
    for less than the experts run one by one would take, and returns each expert's rows."""
    from amoe.runtime.sync.batch import LayerBatch

    # Without step-time variance: the hold is then exactly the cost model's grouped step.
    em = Emulation(emulated(profile="mixtral-8x7b-mqa", gpu="a100-80g", time_scale=1e-3, step_variance="off"))
    ex = em.expert_executor()

    def batch(e, n):
        rows = torch.zeros(n, dtype=torch.int64)
        return LayerBatch("expert", 0, e, rows, rows, x=torch.zeros(n, 16), weights=torch.ones(n))

    outs = ex.run_grouped([batch(0, 30), batch(1, 2)])
    assert [tuple(o.shape) for o in outs] == [(30, 16), (2, 16)]
    kinds = ex.stats()["kinds"]["expert"]
    assert (kinds["steps"], kinds["rows"]) == (1, 32)
    one_by_one = sum(cm.expert_layer_time(em.profile, em.gpu, n, em.host) for n in (30, 2))
    assert kinds["busy_s"] == pytest.approx(cm.grouped_expert_time(em.profile, em.gpu, [30, 2], em.host))
    assert kinds["busy_s"] < one_by_one
    assert type(kinds["busy_s"]) is float  # the runtime report encodes it (no numpy scalars on the wire)


def test_expert_runtimes_of_a_heterogeneous_deployment_are_timed_on_their_own_gpu():
    """--expert-gpu: the expert runtimes' layers take the expert GPU's time (MegaScale-Infer's heterogeneous
    split); attention, KV and links stay on --gpu; an EP device or a torch executor refuses it."""
    from amoe.config import AmoeConfig, ParallelSection

    em = Emulation(
        emulated(
            profile="mixtral-8x7b-mqa",
            gpu="a100-80g",
            expert_gpu="h100",
            time_scale=1e-3,
            step_variance="off",
        )
    )
    assert (em.gpu.name, em.expert_gpu.name) == (gpu_profile("a100-80g").name, gpu_profile("h100").name)
    ex = em.expert_executor()
    rows = torch.zeros(64, dtype=torch.int64)
    from amoe.runtime.sync.batch import LayerBatch

    ex.run(LayerBatch("expert", 0, 0, rows, rows, x=torch.zeros(64, 16), weights=torch.ones(64)))
    busy = ex.stats()["kinds"]["expert"]["busy_s"]
    assert busy == pytest.approx(cm.expert_layer_time(em.profile, gpu_profile("h100"), 64, em.host))
    assert busy < cm.expert_layer_time(em.profile, gpu_profile("a100-80g"), 64, em.host)
    same = Emulation(emulated(profile="mixtral-8x7b-mqa", gpu="a100-80g"))
    assert same.expert_gpu == same.gpu
    with pytest.raises(ConfigError):
        Emulation(emulated(profile="mixtral-8x7b-mqa", expert_gpu="v100"))
    with pytest.raises(ConfigError, match="expert-gpu"):
        AmoeConfig(
            executor=ExecutorSection("emulated"),
            emulation=emulated(expert_gpu="h100"),
            parallel=ParallelSection(mode="ep", attn_ranks=2),
        )
    with pytest.raises(ConfigError, match="expert-gpu"):
        AmoeConfig(emulation=EmulationSection(expert_gpu="h100"))


@pytest.mark.timeout(60)
def test_emulated_cluster_runs_requests_to_max_tokens():
    em = Emulation(emulated(gpu="h100", profile="mixtral-8x7b-mqa", top_k=2, time_scale=0.5))
    cfg = em.model_config
    with InProcessCluster(emulation=em, num_attn_ranks=1, num_expert_ranks=2) as cluster:
        params = SamplingParams(max_tokens=3, temperature=0.8)
        outputs = cluster.generate([[5, 6, 7, 8]] * 4, params, timeout=30)
        (attn,) = cluster.attention
    token = attn.compute.token
    assert outputs == [[token] * 3] * 4
    assert token not in cfg.stop_token_ids
    assert attn.requests.kv_used_blocks == 0
    blocks = attn.requests.blocks
    assert blocks.num_total_blocks * blocks.block_size > 1_000_000  # an H100's memory, not a test-sized cache
    assert int(attn.routed.sum()) == 4 * (4 + 2) * cfg.num_blocks * cfg.top_k  # prompt rows + 2 decode rows
    stats = [x.stats() for x in cluster.executors]
    assert stats[0]["kinds"]["attention"]["rows"] == 4 * (4 + 2) * cfg.num_blocks
    assert sum(s["kinds"]["expert"]["rows"] for s in stats[1:]) == 4 * (4 + 2) * cfg.num_blocks * 2
    assert all(s["busy_s"] > 0 for s in stats)
