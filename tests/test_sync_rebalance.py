"""The stop-the-world rebalance of the synchronous baselines (amoe.runtime.sync.rebalance): every device pauses at
the same step boundary, the weights move (on an emulated GPU for their bytes over the link), and serving resumes —
greedy tokens as the reference engine's, every routed row run once, nothing lost."""

import dataclasses

import numpy as np
import pytest
import torch
from factories import random_prompts, reference_tokens

from amoe.config import AmoeConfig, EmulationSection, EplbSection
from amoe.expert_map import ExpertMap
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.links import weights_copy_time
from amoe.perf.model.models import model_profile
from amoe.perf.model.shapes import model_config_of
from amoe.placement import Placement
from amoe.runtime.emulated import Emulation
from amoe.runtime.sync.slots import SlotMap
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster
from amoe.testing.sync_inproc import SyncCluster

PARAMS = SamplingParams(temperature=0, max_tokens=12)
# Every 3 working iterations over the last 2: several rebalances in a 12-token run, each on another window.
EPLB = EplbSection(enable=True, num_redundant_experts=2, window_size=2, step_interval=3)


def test_slots_send_an_experts_copies_to_its_replicas_in_turn():
    place = Placement.expert_parallel(2, 4)
    table = [[[0], [1], [0, 1], [1]], [[0, 1], [1], [0], [1]]]
    slots = SlotMap(place.hosts, 3, ExpertMap.of(table))
    assert slots.expert_device == [0, 0, 0, 1, 1, 1]
    ids = torch.tensor([[2, 1], [2, 3], [2, 0]])  # [N, K]
    phys = slots.physical(0, ids)
    assert [slots.logical(0, s) for s in phys.flatten().tolist()] == ids.flatten().tolist()
    assert [slots.expert_device[s] for s in phys[:, 0].tolist()] == [0, 1, 0]  # expert 2: device 0, 1, 0
    assert [slots.logical(1, s) for s in slots.physical(1, ids).flatten().tolist()] == ids.flatten().tolist()
    with pytest.raises(Exception, match="slots"):
        SlotMap(place.hosts, 1, ExpertMap.of(table))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["ep", "pingpong"])
def test_greedy_tokens_are_unchanged_through_stop_the_world_rebalances(tiny_checkpoint, mode):
    prompts = random_prompts([3, 9, 5, 14, 2, 7])
    reference = reference_tokens(tiny_checkpoint, prompts, PARAMS)
    shape = {"num_devices": 2} if mode == "ep" else {"num_attn": 1, "num_expert": 2}
    with SyncCluster(tiny_checkpoint, mode=mode, eplb=EPLB, timeout_s=10, **shape) as cluster:
        assert cluster.generate(prompts, PARAMS, timeout=60) == reference
        stats = cluster.stats()
    assert not cluster.errors
    moved = [s for s in stats if s["rebalances"]]
    assert moved, "no rebalance moved a layer"
    # Every device paused at every rebalance that moved anything: the same count everywhere.
    assert len({s["rebalances"] for s in stats}) == 1, [s["rebalances"] for s in stats]
    expert_rows = sum(torch.tensor(s["expert_rows"]) for s in stats)
    routed = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts) * cluster.model_config.top_k
    assert int(expert_rows.sum()) == routed * cluster.model_config.num_blocks  # every routed row ran once


def _emulation(time_scale: float) -> Emulation:
    cfg = dataclasses.replace(model_config_of(model_profile("mixtral-8x7b-mqa", 2)), num_blocks=2)
    section = EmulationSection(gpu="a100-80g", top_k=2, time_scale=time_scale, routing="skew-exp:0.4",
                              step_variance="off")  # fmt: skip
    return Emulation(section, cfg, wire_hidden=16)


@pytest.mark.timeout(90)
def test_the_pause_holds_every_device_for_the_link_time_of_the_bytes_moved():
    em = _emulation(time_scale=0.5)
    eplb = EplbSection(enable=True, window_size=4, step_interval=6)
    cluster = SyncCluster(mode="ep", num_devices=4, emulation=em, num_kv_blocks=4096, eplb=eplb)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reqs = [cluster.submit([5, 6, 7, 8], params) for _ in range(32)]
    with cluster:
        outputs = cluster.wait(reqs, timeout=60)
        stats = cluster.stats()
    assert [len(o) for o in outputs] == [20] * 32  # nothing lost
    assert stats[0]["rebalances"] >= 1 and len({s["rebalances"] for s in stats}) == 1
    link = gpu_profile("a100-80g").nvlink
    for s in stats:
        held = s["emulated"]["experts"]["kinds"].get("rebalance", {"busy_s": 0.0})["busy_s"]
        # One hold per rebalance that brought layers: the link time of exactly the bytes it brought.
        assert held == pytest.approx(
            weights_copy_time(link, s["moved_bytes"]), abs=link.latency * s["rebalances"]
        )
        # Every device, movers or not, waited out the slowest move: no device paused less than it held.
        assert s["rebalance_s"] >= held * em.config.time_scale * 0.9
    moved = np.array([s["moved_bytes"] for s in stats])
    assert moved.sum() > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ep", "pingpong"])
def test_served_sync_runtimes_rebalance_with_the_eplb_flags(tiny_checkpoint, mode):
    """`amoe serve --parallel ep|pingpong --enable-eplb`: runtime processes behind the coordinator stop the world to
    rebalance, and greedy tokens are still the reference engine's."""
    prompts = random_prompts([4, 11, 6, 2])
    reference = reference_tokens(tiny_checkpoint, prompts, PARAMS)
    parallel = (
        {"mode": mode, "attn_ranks": 2}
        if mode == "ep"
        else {"mode": mode, "attn_ranks": 1, "expert_ranks": 2}
    )
    config = AmoeConfig().replace(parallel=parallel, device={"kind": "cpu"}, eplb=dataclasses.asdict(EPLB))
    with ServedCluster(tiny_checkpoint, config) as cluster:
        assert cluster.generate(prompts, PARAMS, timeout=90) == reference
        reports = cluster.runtime_stats(settled=True)  # a report sent after the last token
    counts = [r["rebalances"]["rebalances"] for r in reports]
    assert counts[0] >= 1 and len(set(counts)) == 1, counts  # every runtime paused at every one
    assert sum(r["rebalances"]["moved_bytes"] for r in reports) > 0
