"""Step-time variance of emulated GPUs (amoe.perf.model.variance): the flag, the seeded draws every process agrees on,
the clock that applies them, and what a barrier pays for them in the bounds and the simulation."""

from __future__ import annotations

import golden
import numpy as np
import pytest

from amoe import core
from amoe.config import AmoeConfig, EmulationSection, config_from_args
from amoe.errors import ConfigError
from amoe.perf.model.check import check_emulation
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.variance import OFF, SOURCED, SOURCED_JITTER, SOURCED_SPREAD, StepVariance, expected_max
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds as B
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import simulate
from amoe.placement import Placement
from amoe.runtime.emulated import Emulation
from amoe.runtime.emulated_clock import EmulatedClock

CTX, HOST = mean_context("short"), host_overhead("amoe-paper")


def test_the_flag_parses_and_refuses_bad_values_by_name():
    assert StepVariance.parse("sourced") == SOURCED == StepVariance(SOURCED_SPREAD, SOURCED_JITTER)
    assert StepVariance.parse("off").is_off
    assert StepVariance.parse("0.2") == StepVariance(0.2, SOURCED_JITTER)
    assert StepVariance.parse("0.08,jitter=0,seed=3") == StepVariance(0.08, 0.0, 3)
    for bad in ("fast", "0.1,speed=2", "-0.1", "0.1,jitter=1.5", "sourced,seed=x"):
        with pytest.raises(ConfigError, match="step-variance"):
            StepVariance.parse(bad)
    # The serving flag reaches the emulation section, and a bad value is refused before anything starts.
    from amoe.cli import build_parser

    argv = ["serve", "--executor", "emulated", "--step-variance", "off"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.emulation.step_variance == "off"
    assert AmoeConfig().emulation.step_variance == "sourced"
    with pytest.raises(ConfigError, match="step-variance"):
        check_emulation(EmulationSection(profile="mixtral-8x7b-mqa:2", step_variance="x"))


def test_each_gpu_has_a_seeded_speed_within_the_sourced_range():
    speeds = SOURCED.speeds(0, 4000)
    assert speeds.min() >= 1 - SOURCED_SPREAD / 2 and speeds.max() <= 1 + SOURCED_SPREAD / 2
    assert speeds.max() - speeds.min() > 0.95 * SOURCED_SPREAD  # many GPUs span the measured range
    assert speeds.mean() == pytest.approx(1.0, abs=2e-3)  # the cost model's GPU is the median one
    # Keyed by (seed, device): the same in every process, different for another seed.
    np.testing.assert_array_equal(speeds[:8], StepVariance(SOURCED_SPREAD, SOURCED_JITTER).speeds(0, 8))
    assert not np.array_equal(speeds[:8], StepVariance(SOURCED_SPREAD, SOURCED_JITTER, seed=1).speeds(0, 8))
    assert OFF.speeds(0, 3).tolist() == [1.0, 1.0, 1.0]


def test_expected_max_is_the_mean_of_the_slowest():
    rng = np.random.default_rng(0)
    scales = np.array([1.0, 1.02, 0.97, 1.0, 1.01])
    draws = (scales * (1 + rng.uniform(-0.04, 0.04, (200_000, 5)))).max(axis=1).mean()
    assert expected_max(scales, 0.04) == pytest.approx(draws, rel=1e-3)
    # n alike devices: 1 + j (n − 1) / (n + 1), the mean of the largest of n uniforms.
    assert expected_max(np.ones(8), 0.04) == pytest.approx(1 + 0.04 * 7 / 9, rel=1e-4)
    assert expected_max(scales, 0.0) == scales.max()
    np.testing.assert_allclose(expected_max(np.array([[1.0, 0.0], [2.0, 3.0]]), 0.0), [1.0, 3.0])


def _expected_max_by_the_grid(scales, jitter):
    """expected_max as first written (every device over the whole grid, no memo): the reference its reductions
    must reproduce bit for bit."""
    a = np.asarray(scales, dtype=float)
    lo = (a * (1 - jitter)).max(axis=-1, keepdims=True)
    hi = (a * (1 + jitter)).max(axis=-1, keepdims=True)
    x = lo + (hi - lo) * np.linspace(0.0, 1.0, 512)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = (x[..., None, :] / a[..., :, None] - 1.0 + jitter) / (2 * jitter)
    cdf = np.where(a[..., :, None] > 0, np.clip(u, 0.0, 1.0), 1.0).prod(axis=-2)
    return lo[..., 0] + np.trapezoid(1.0 - cdf, x, axis=-1)


def test_expected_max_drops_only_devices_that_cannot_change_it_bit_for_bit():
    """Devices that cannot be the slowest are dropped and answers are memoised (`amoe plan`'s time on 256
    GPUs): every answer equals the full grid's to the last bit, batched rows as each row alone."""
    rng = np.random.default_rng(7)
    dropped = 0
    for trial in range(60):
        shape = [(9,), (5, 12), (3, 4, 7), (61, 48)][trial % 4]
        a = rng.uniform(0.5, 1.0, shape) ** rng.integers(1, 12)  # from alike to far apart
        if trial % 3 == 0:
            a[..., trial % shape[-1]] = 0.0  # a device with no step
        jitter = (0.04, 0.01, 0.3)[trial % 3]
        lo = (a * (1 - jitter)).max(axis=-1, keepdims=True)
        dropped += int((a * (1 + jitter) < lo).sum())
        want = _expected_max_by_the_grid(a, jitter)
        got = expected_max(a, jitter)
        np.testing.assert_array_equal(got, want)
        if a.ndim == 2:
            np.testing.assert_array_equal([expected_max(row, jitter) for row in a], want)
        if a.ndim > 1:
            got[...] = -1.0  # a memoised answer is the caller's copy
            np.testing.assert_array_equal(expected_max(a, jitter), want)
    assert dropped > 1000  # the reduction was exercised


def test_the_emulated_clock_holds_each_gpu_at_its_speed():
    em = Emulation(EmulationSection(profile="mixtral-8x7b-mqa:2", routing="uniform", time_scale=1e-3))
    slow = int(np.argmax(SOURCED.speeds(0, 4)))
    clock = em.clock(slow)
    for _ in range(200):
        clock.hold(1e-3, "expert", 1)
    busy = clock.stats()["busy_s"]
    # Jitter keeps the mean: 200 steps of ±4 % leave the busy time within ~1 % of the GPU's speed × the cost.
    assert busy == pytest.approx(0.2 * SOURCED.speed(slow), rel=0.01)
    assert len({round(em.clock(d).speed, 9) for d in range(4)}) == 4
    off = Emulation(
        EmulationSection(
            profile="mixtral-8x7b-mqa:2",
            routing="uniform",
            time_scale=1e-3,
            step_variance="off",
        )
    )
    plain = off.clock(slow)
    plain.hold(1e-3)
    assert plain.stats()["busy_s"] == 1e-3
    assert EmulatedClock(1e-3, speed=1.5).speed == 1.5


@golden.case("variance")
def variance_losses() -> golden.Figures:
    """The throughput the sourced step-time variance costs: the bounds of EP 8 and AEP 4 + 4 H100s (Mixtral, full
    depth, top-1), and the simulation of EP 4 H100s (4 blocks, uniform routing)."""
    model = B.full_depth(model_profile("mixtral-8x7b-mqa", 1))
    q = routing_inclusion(model, "skew-exp:0.08")
    loss = {}
    for dep in (Deployment("ep", "h100", 8, attn_cap=256), Deployment("aep", "h100", 4, "h100", 4)):
        off, on = (B.predict(model, dep, q, CTX, HOST, variance=v).tokens_per_s for v in (OFF, SOURCED))
        loss[f"{dep.mode} bound"] = 1 - on / off
    small = model_profile("mixtral-8x7b-mqa:4", 1)
    ep = Deployment("ep", "h100", 4, attn_cap=64)
    off, on = (
        simulate(small, ep, "uniform", CTX, HOST, 256, variance=v).tokens_per_s for v in (OFF, SOURCED)
    )
    loss["ep simulated"] = 1 - on / off
    return loss


def test_a_barrier_pays_the_slowest_device_and_a_queue_does_not():
    """EP waits at two barriers a block for the slowest device, jitter included. AEP's ranks whose waves meet at
    every expert step go at the slowest attention GPU's pace, but no step's jitter holds them: on an attention-bound
    AEP plan variance costs exactly what the slowest attention GPU's speed costs (the bound does not let faster
    ranks run ahead while their waves share steps with the slowest)."""
    loss = variance_losses.check()
    assert loss["ep bound"] > 0
    slowest = float(SOURCED.speeds(0, 4).max())  # of AEP's 4 attention GPUs
    assert slowest > 1.02  # the draw has a slow attention GPU, so the test can fail
    assert loss["aep bound"] == pytest.approx(1 - 1 / slowest, abs=1e-3)
    # The simulation pays it too: EP's iterations wait for this step's slowest device.
    assert loss["ep simulated"] > 0


def test_the_wave_hold_guard_is_emulated_time():
    place = Placement.disaggregated(1, 1, 2)
    shape = dict(num_blocks=2, num_experts=2, top_k=1, hidden=8)
    assert core.engine_config(0, place, **shape).max_wave_hold_s == core.MAX_WAVE_HOLD_S
    scaled = core.engine_config(0, place, **shape, time_scale=40.0)
    assert scaled.max_wave_hold_s == pytest.approx(40.0 * core.MAX_WAVE_HOLD_S)
    scaled.max_wave_hold_s = 0.0
    with pytest.raises(ValueError, match="scheduling settings"):
        scaled.validate()
