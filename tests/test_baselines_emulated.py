"""The synchronous baselines on emulated GPUs (times from the cost model, held as sleeps × a time scale):
ping-pong's iteration time agrees with MegaScale-Infer's T_total (Eq. 5) when its conditions hold, and EP stalls
at its barriers more under skewed routing than under uniform routing at the same load (AMoE Figure 4b)."""

import dataclasses

import pytest

from amoe.config import EmulationSection
from amoe.perf.model import cost_model
from amoe.perf.model.models import model_profile
from amoe.perf.model.shapes import model_config_of
from amoe.runtime.emulated import Emulation
from amoe.runtime.sync import t_total
from amoe.sampling_params import SamplingParams
from amoe.testing.sync_inproc import SyncCluster


def emulation(routing: str, time_scale: float, num_blocks: int = 4, num_experts: int = 8) -> Emulation:
    """Mixtral 8x7B-MQA shapes on an A100 80GB, with fewer blocks (and experts) so iterations are short."""
    cfg = model_config_of(model_profile("mixtral-8x7b-mqa", 2))
    cfg = dataclasses.replace(cfg, num_blocks=num_blocks, num_experts=num_experts)
    executor = EmulationSection(gpu="a100-80g", top_k=2, time_scale=time_scale, routing=routing)
    return Emulation(executor, cfg, wire_hidden=16)


def test_t_total_formula():
    assert t_total(1.0, 1.0, 0.0, 1, 4) == 8.0  # m = 1: no overlap
    assert t_total(1.0, 2.0, 0.5, 2, 3) == (1 + 2 + 1) + 2 * 5
    assert t_total(2.0, 1.0, 0.0, 3, 2) == 3 + 2 * 5


@pytest.mark.timeout(60)
def test_pingpong_iteration_time_agrees_with_t_total():
    """T_a ≈ T_e (16 decode rows per micro-batch vs one expert per device), T_c ≈ 0 (loopback), m = 2."""
    scale, m, rows = 200.0, 2, 16
    em = emulation("uniform", scale, num_experts=4)
    cluster = SyncCluster(
        mode="pingpong", num_attn=1, num_expert=4, micro_batches=m, emulation=em, num_kv_blocks=4096
    )
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    reqs = [cluster.submit([5, 6, 7, 8], params) for _ in range(m * rows)]  # all join the first iteration
    with cluster:
        cluster.wait(reqs, timeout=45)
        stats = cluster.stats()[0]
    decode = [t for t, n in zip(stats["iteration_s"], stats["iteration_rows"]) if n == m * rows]
    # The fastest decode iteration: other work on the host can only add time to an iteration (the emulated
    # executor sleeps the cost model's times), never remove it.
    measured = min(decode) / scale
    prof, gpu, host = em.profile, em.gpu, em.host
    t_a = cost_model.attention_layer_time(prof, gpu, [1] * rows, [6] * rows, host)
    t_e = cost_model.expert_layer_time(prof, gpu, rows * 2 // 4, host)  # one expert per device
    t_head = cost_model.head_time(
        prof, gpu, rows, rows, host
    )  # the last micro-batch's head is not overlapped
    predicted = t_total(t_a, t_e, 0.0, m, em.model_config.num_blocks) + t_head
    assert 0.8 < t_a / t_e < 1.25
    assert len(decode) >= 3
    assert measured == pytest.approx(predicted, rel=0.2), (measured, predicted, decode)


def _ep_stall(routing: str) -> float:
    em = emulation(routing, time_scale=40.0)
    cluster = SyncCluster(mode="ep", num_devices=4, emulation=em, num_kv_blocks=4096)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    # 512 prefill rows per device: the experts run past their knee, where rows cost time and skew shows.
    reqs = [cluster.submit(list(range(3, 259)), params) for _ in range(8)]
    with cluster:
        cluster.wait(reqs, timeout=30)
        stats = cluster.stats()
    busy, wait = sum(s["busy_s"] for s in stats), sum(s["wait_s"] for s in stats)
    return wait / (busy + wait)


@pytest.mark.timeout(60)
def test_ep_stalls_more_under_skewed_routing():
    uniform, skewed = _ep_stall("uniform"), _ep_stall("skew-exp:0.4")  # the stress case
    assert skewed > uniform + 0.1, (uniform, skewed)
