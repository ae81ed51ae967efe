"""End to end in one process: the real model through the C++ engine on 2 attention + 3 expert runtimes over the
loopback communicator gives the reference engine's greedy tokens, under every scheduling policy."""

import pytest
from factories import random_prompts, reference_tokens

from amoe.config import POLICIES, SchedulerSection
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster

PARAMS = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_checkpoint):
    prompts = random_prompts([1, 4, 17, 33, 9, 2])
    return prompts, reference_tokens(tiny_checkpoint, prompts, PARAMS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("caps", [{}, {"attn_batch_cap": 8, "expert_batch_cap": 3}])
def test_greedy_tokens_match_the_reference_engine(tiny_checkpoint, prompts_and_reference, policy, caps):
    prompts, reference = prompts_and_reference
    scheduler = SchedulerSection(policy=policy, **caps)
    with InProcessCluster(
        tiny_checkpoint, num_attn_ranks=2, num_expert_ranks=3, scheduler=scheduler
    ) as cluster:
        assert cluster.generate(prompts, PARAMS, timeout=60) == reference
        stats = cluster.stats()
    for s in stats:
        assert s["pool_entries"] == 0 and s["errors"] == 0 and sum(s["dropped"].values()) == 0
    assert sum(sum(s["batches"].values()) for s in stats[2:]) > 0  # the expert runtimes did the MoE
