"""Emulated offloading tiers: a miss holds the emulated expert step for its copy over PCIe (and NVMe)."""

from types import SimpleNamespace

import pytest
import torch

from amoe.config import EmulationSection
from amoe.errors import ConfigError
from amoe.offload.policy import LRU
from amoe.perf.model import cost_model
from amoe.perf.model.gpus import NVME_GEN4, PCIE4_X16
from amoe.perf.model.models import model_profile
from amoe.perf.model.offload_tiers import EmulatedTiers, OffloadSpec
from amoe.runtime.emulated import Emulation

MIXTRAL = model_profile("mixtral-8x7b-mqa")
EXPERT_BYTES = MIXTRAL.params_of(0) * MIXTRAL.bytes_per_param  # 352 MB in BF16


def _emulation(budget_experts: float, **spec) -> Emulation:
    section = EmulationSection(
        gpu="a5000",
        profile="mixtral-8x7b-mqa",
        time_scale=1e-6,
        routing="uniform",
        step_variance="off",  # exact times: the copies are what is checked
    )
    offload = OffloadSpec(budget_bytes=budget_experts * EXPERT_BYTES, **spec) if budget_experts else None
    return Emulation(section, offload=offload)


def _batch(block: int, expert: int, request_ids: list[int]):
    n = len(request_ids)
    return SimpleNamespace(
        num_rows=n, group_experts=None, index=expert, block=block, request_ids=torch.tensor(request_ids)
    )


def test_a_miss_holds_the_step_for_its_copy():
    em = _emulation(1, policy="lru", prefetch=False)
    ex = em.expert_executor()
    compute = cost_model.expert_layer_time(em.profile, em.expert_gpu, 1, em.host, 0)
    copy = cost_model.transfer_time(EXPERT_BYTES, PCIE4_X16)
    assert 0.013 < copy < 0.015  # 352 MB at 80 % of 31.5 GB/s
    ex.run(_batch(0, 0, [7]))  # (0, 0) was placed on the device first: a hit
    ex.run(_batch(0, 1, [7]))  # a miss from host memory
    ex.run(_batch(0, 1, [7]))  # now resident
    busy = ex.stats()["kinds"]["expert"]["busy_s"]
    assert busy == pytest.approx(3 * compute + copy, rel=1e-6)
    s = ex.tiers.stats
    assert (s.device_hits, s.host_misses, s.ssd_misses, s.pcie_bytes) == (2, 1, 0, EXPERT_BYTES)
    assert ex.stats()["offload"]["host_misses"] == 1 and ex.stats()["offload"]["stall_s"] == pytest.approx(
        copy
    )


def test_no_budget_no_tiers_and_a_budget_below_one_expert_is_refused():
    assert _emulation(0).expert_executor().tiers is None
    with pytest.raises(ConfigError, match="minimum is one expert"):
        _emulation(0.5).expert_executor()


def test_ssd_copies_are_pipelined_into_pcie():
    tiers = EmulatedTiers(LRU(), 2, 4, 1e8, device_experts=1, host_experts=1, prefetch=False)
    pcie, nvme = cost_model.transfer_time(1e8, PCIE4_X16), cost_model.transfer_time(1e8, NVME_GEN4)
    assert tiers.acquire((0, 0), 0.0) == 0.0  # on the device from the start
    assert tiers.acquire((0, 1), 0.0) == pytest.approx(pcie)  # in host memory
    assert tiers.acquire((1, 3), 1.0) == pytest.approx(1.0 + nvme + pcie)  # on SSD: NVMe, then PCIe
    assert tiers.stats.ssd_misses == 1 and tiers.stats.nvme_bytes == 1e8


def test_ep_grouped_step_waits_for_each_missing_expert():
    em = _emulation(2, policy="lru", prefetch=False)
    ex = em.expert_executor()
    batches = [_batch(5, 0, [1, 2]), _batch(5, 3, [2])]  # block 5 starts in host memory
    ex.run_grouped(batches)
    compute = cost_model.grouped_expert_time(em.profile, em.expert_gpu, [2, 1], em.host, [0, 3])
    copy = cost_model.transfer_time(EXPERT_BYTES, PCIE4_X16)
    assert ex.stats()["kinds"]["expert"]["busy_s"] == pytest.approx(compute + 2 * copy, rel=1e-6)
    assert ex.tiers.stats.host_misses == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["activation", "lru"])
def test_emulated_aep_cluster_with_offloading(policy):
    """The real AEP runtimes (engines, queues, loops) over emulated experts with a two-expert budget each."""
    from amoe.sampling_params import SamplingParams  # noqa: PLC0415 - the in-process cluster's imports are heavy
    from amoe.testing.inproc import InProcessCluster  # noqa: PLC0415

    section = EmulationSection(gpu="a5000", profile="mixtral-8x7b-mqa:2", time_scale=0.05, routing="uniform")
    em = Emulation(section, offload=OffloadSpec(budget_bytes=2 * EXPERT_BYTES, policy=policy))
    with InProcessCluster(emulation=em, num_attn_ranks=1, num_expert_ranks=2) as cluster:
        outputs = cluster.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=3), timeout=50)
        stats = [x.stats() for x in cluster.executors[1:]]
    assert [len(o) for o in outputs] == [3, 3, 3]
    offload = [s["offload"] for s in stats]
    misses = sum(o["host_misses"] + o["ssd_misses"] for o in offload)
    assert misses > 0 and sum(o["stall_s"] for o in offload) > 0
    copies = misses + sum(o["prefetched"] for o in offload)
    assert sum(o["pcie_bytes"] for o in offload) == pytest.approx(copies * EXPERT_BYTES)
    if policy == "lru":
        assert all(o["prefetched"] == 0 for o in offload)


def test_the_offload_flags_reach_the_emulated_executor():
    """`amoe serve --executor emulated --offload-budget ...`: the runtimes' emulation gets the budget and policy."""
    from amoe.config import AmoeConfig  # noqa: PLC0415
    from amoe.runtime.build import emulation  # noqa: PLC0415

    emulated = {"kind": "emulated"}
    settings = {"gpu": "a5000", "profile": "mixtral-8x7b-mqa:2", "routing": "uniform"}
    config = AmoeConfig().replace(
        executor=emulated, emulation=settings, offload={"budget": "800MB", "policy": "lfu"}
    )
    assert emulation(config, None).offload == OffloadSpec(800e6, "lfu", None, prefetch=True)
    assert emulation(AmoeConfig().replace(executor=emulated, emulation=settings), None).offload is None
