"""The synchronous baselines (`ep`, `pingpong`) on the tiny Mixtral with the real torch executors: greedy tokens
equal the reference engine's, also for a request joining while others decode; a dead peer ends a loop with
EngineDeadError instead of a hang."""

import threading
import time

import pytest
import torch
from factories import random_prompts, reference_tokens

from amoe.errors import EngineDeadError
from amoe.runtime.sync import run_sync_loop
from amoe.sampling_params import SamplingParams
from amoe.testing.sync_inproc import SyncCluster

PARAMS = SamplingParams(temperature=0, max_tokens=8)
CONFIGS = [
    {"mode": "ep", "num_devices": 1},
    {"mode": "ep", "num_devices": 2},
    {"mode": "ep", "num_devices": 3},
    {"mode": "pingpong", "num_attn": 1, "num_expert": 2, "micro_batches": 2},
    {"mode": "pingpong", "num_attn": 2, "num_expert": 3, "micro_batches": 2},
    {"mode": "pingpong", "num_attn": 2, "num_expert": 2, "micro_batches": 3},
]


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_checkpoint):
    prompts = random_prompts([1, 4, 17, 33, 9, 2, 12])
    return prompts, reference_tokens(tiny_checkpoint, prompts, PARAMS)


def _name(cfg: dict) -> str:
    return "-".join(str(v) for v in cfg.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_greedy_tokens_match_the_reference_with_a_late_joiner(tiny_checkpoint, prompts_and_reference, cfg):
    prompts, reference = prompts_and_reference
    with SyncCluster(tiny_checkpoint, timeout_s=10, **cfg) as cluster:
        early = [cluster.submit(p, PARAMS) for p in prompts[:-1]]
        deadline = time.monotonic() + 30
        while len(early[0].output) < 3:  # the last request joins while the others decode
            assert time.monotonic() < deadline
            time.sleep(0.002)
        late = cluster.submit(prompts[-1], PARAMS)
        assert cluster.wait([*early, late], timeout=30) == reference
        stats = cluster.stats()
    assert all(not t.is_alive() for t in cluster._threads)
    assert all(s["iterations"] >= len(reference[0]) for s in stats)
    expert_rows = sum(torch.tensor(s["expert_rows"]) for s in stats)
    routed = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts) * cluster.model_config.top_k
    assert int(expert_rows.sum()) == routed * cluster.model_config.num_blocks  # every routed row ran once


# Slow: the peer's 0.5 s timeout must really elapse (the margins, 5 and 10 s, are wide).
@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["ep", "pingpong"])
def test_a_silent_peer_raises_engine_dead_instead_of_hanging(tiny_checkpoint, mode):
    cluster = SyncCluster(tiny_checkpoint, mode=mode, num_devices=2, num_attn=1, num_expert=1, timeout_s=0.5)
    device = cluster.devices[0]  # device 1 never runs
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"peer\(s\) \[1\]"):
        comm = cluster.hub.communicator(0)
        run_sync_loop(mode, device, comm, threading.Event(), lambda out: None, timeout_s=0.5)
    assert time.monotonic() - start < 5


class _DeviceLost(BaseException):
    """Not an Exception: what takes a device's whole loop thread down (as a crash would), not one batch."""


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_a_peer_dying_mid_iteration_fails_generate(tiny_checkpoint, prompts_and_reference):
    prompts, _ = prompts_and_reference
    cluster = SyncCluster(tiny_checkpoint, mode="pingpong", num_attn=2, num_expert=2, timeout_s=0.5)

    def lost(batch):
        raise _DeviceLost("expert device lost")

    cluster.devices[3].experts.run = lost
    start = time.monotonic()
    with cluster, pytest.raises(EngineDeadError):
        cluster.generate(prompts, PARAMS, timeout=20)
    assert time.monotonic() - start < 10
    assert isinstance(cluster.errors[3], _DeviceLost)
    assert all(isinstance(cluster.errors[r], EngineDeadError) for r in (0, 1, 2))  # the survivors timed out


def _raising_for(request_id: int, run):
    def run_or_raise(batch, *args):
        if request_id in batch.request_ids.tolist():
            raise RuntimeError("injected layer failure")
        return run(batch, *args)

    return run_or_raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[4]], ids=_name)
@pytest.mark.parametrize("layer", ["attention", "expert"])
def test_a_failing_layer_fails_its_batch_and_the_group_serves_on(
    tiny_checkpoint, prompts_and_reference, cfg, layer
):
    """A layer that raises ends the requests of its batch with "error" (freeing their KV); every device stays in
    the lock-step group, and requests after it get the reference tokens."""
    prompts, reference = prompts_and_reference
    with SyncCluster(tiny_checkpoint, timeout_s=10, **cfg) as cluster:
        bad_id = 1  # the cluster numbers requests from 1
        if layer == "attention":
            compute = cluster.attention[
                0
            ].attention.compute  # inside the executor, which catches what it raises
            compute.attend = _raising_for(bad_id, compute.attend)
        else:
            device = next(d for d in cluster.devices if d.experts is not None)
            device.experts.run = _raising_for(bad_id, device.experts.run)
        bad = cluster.submit([1, 5, 3, 4], PARAMS, rank=0)
        assert bad.done.wait(30) and bad.finish_reason == "error" and not bad.output
        free = [d.attention.requests.blocks.num_free_blocks for d in cluster.attention]
        assert free == [cluster.num_kv_blocks] * len(free)
        assert cluster.generate(prompts, PARAMS, timeout=30) == reference
        assert not cluster.errors
