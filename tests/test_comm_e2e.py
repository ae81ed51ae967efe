"""End to end with runtimes as separate processes, started by the real launcher (the coordinator's cluster manager
and `amoe.runtime.worker`): the tiny Mixtral on 2 attention + 3 expert runtime processes over the `inline` and
`gloo` planes gives the reference engine's greedy tokens and transformers' log-probabilities, and leaves nothing
in flight."""

import pytest
import torch
import transformers
from factories import check_logprobs, hf_greedy, random_prompts, reference_tokens

from amoe.config import AmoeConfig
from amoe.logprobs import concat
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster

PARAMS = SamplingParams(temperature=0, max_tokens=10)
LOGPROBS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4, prompt_logprobs=2)


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_checkpoint):
    prompts = random_prompts([1, 4, 17, 33, 9, 2])
    return prompts, reference_tokens(tiny_checkpoint, prompts, PARAMS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plane", ["inline", "gloo"])
def test_runtime_processes_give_the_reference_tokens(tiny_checkpoint, prompts_and_reference, plane):
    prompts, reference = prompts_and_reference
    config = AmoeConfig().replace(parallel={"attn_ranks": 2, "expert_ranks": 3}, transport={"plane": plane})
    with ServedCluster(tiny_checkpoint, config) as cluster:
        assert cluster.generate(prompts, PARAMS, timeout=60) == reference
        assert cluster.generate(prompts[:3], PARAMS, timeout=60) == reference[:3]  # the cluster keeps serving
        scored = cluster.deltas(prompts[:3], LOGPROBS, timeout=60)
        stats = sorted(cluster.runtime_stats(), key=lambda s: s["runtime"])
    assert len(stats) == 5
    for s in stats:
        assert s["pool_entries"] == 0 and s["errors"] == 0 and sum(s["dropped"].values()) == 0
        comm = s["comm"]
        assert comm["plane"] == plane and sum(comm["dropped"].values()) == 0 and comm["failed_peers"] == []
        assert comm["messages_in"] > 0 and comm["in_flight_recv"] == 0
    assert sum(sum(s["batches"].values()) for s in stats[2:]) > 0  # the expert processes did the MoE
    # Log-probabilities computed on the attention ranks, the top k sent with each token: transformers' values.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    for prompt, deltas in zip(prompts, scored):
        output, ref = hf_greedy(hf, prompt, LOGPROBS.max_tokens)
        tokens = prompt + output
        check_logprobs(ref, tokens, concat([d.logprobs for d in deltas if d.token_ids]), len(prompt), 4)
        check_logprobs(ref, prompt, deltas[0].prompt_logprobs, 1, 2)
