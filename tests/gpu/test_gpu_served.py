"""A served cluster on GPUs (one runtime per GPU, attention and experts apart, NCCL between them): greedy requests give
the tokens Hugging Face transformers gives on the same checkpoint in float32 — over the OpenAI API of a real
`amoe serve --device cuda --transport auto`, and as token ids from the launcher driven in-process. On one GPU, two
runtimes share it (--runtimes-per-gpu 2) and give the same tokens over the inline plane."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster
from amoe.testing.servers import ServerProcess
from amoe.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

MODEL = "tiny-gpu"  # the served model's name is its directory's
NEW_TOKENS = 24
# One token, short, exactly one KV block, several blocks: prefill and decode batches of mixed shapes.
PROMPT_LENGTHS = (1, 4, 16, 33, 60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("gpu-served") / MODEL, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [[1] + torch.randint(3, 1024, (n - 1,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts) -> list[list[int]]:
    """transformers' greedy tokens in float32 on the first GPU, per prompt (no padding), eos not stopping them (the
    requests ignore it too); the model is freed after, so the cluster's runtime on that GPU has its memory back."""
    model = (
        transformers.MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0").eval()
    )
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            seq = model.generate(
                torch.tensor([prompt], device="cuda:0"), do_sample=False, max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(seq[0, len(prompt) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def _text(tokenizer: Tokenizer, prompt: list[int], tokens: list[int]) -> str:
    """What the server streams for `tokens` after `prompt` (its detokenizer, flushed at the end)."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detok.add(t) for t in tokens) + detok.flush()


async def _complete_all(url: str, prompts: list[list[int]]):
    """Every prompt's completion, all in flight at once so the runtimes batch them."""
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for prompt in prompts
            )
        )
    finally:
        await client.close()


@pytest.mark.gpus(2)
@pytest.mark.timeout(900)
def test_openai_api_greedy_completions_equal_transformers(model_dir, prompts, hf_tokens):
    config = AmoeConfig().replace(
        model={"path": str(model_dir), "dtype": "float32"}, device={"kind": "cuda"}, transport={"plane": "auto"},
        parallel={"attn_ranks": 1, "expert_ranks": 1},
    )  # fmt: skip
    server = ServerProcess(config, startup_timeout_s=300)
    with server as url:
        startup = list(server.lines)
        replies = asyncio.run(_complete_all(url, prompts))
    # --transport auto between GPU runtimes on one host is NCCL (amoe.serve logs "..., nccl transport, ...").
    assert any("nccl transport" in line for line in startup), "\n".join(startup)
    tokenizer = Tokenizer.from_dir(model_dir)
    for i, (reply, prompt, want) in enumerate(zip(replies, prompts, hf_tokens)):
        assert reply.usage.completion_tokens == NEW_TOKENS, i
        assert reply.choices[0].text == _text(tokenizer, prompt, want), (
            f"prompt {i} differs from transformers"
        )


@pytest.mark.gpus(2)
@pytest.mark.timeout(900)
def test_served_token_ids_equal_transformers_over_nccl(model_dir, prompts, hf_tokens):
    # Text can hide a wrong token (ids the small tokenizer decodes to nothing): compare ids too, and spread the
    # experts over every other visible GPU (up to 4) so routed rows cross more than one NCCL pair.
    experts = min(torch.cuda.device_count() - 1, 4)
    config = AmoeConfig().replace(
        device={"kind": "cuda"},
        model={"dtype": "float32"},
        parallel={"attn_ranks": 1, "expert_ranks": experts},
        transport={"plane": "auto"},
    )
    assert config.tensor_plane == "nccl"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with ServedCluster(model_dir, config) as cluster:
        got = cluster.generate(prompts, params, timeout=300)
        reports = _reports_after_traffic(cluster)
    assert {r["comm"]["plane"] for r in reports} == {"nccl"}
    assert all(r["comm"]["transfer_errors"] == 0 and r["comm"]["timeouts"] == 0 for r in reports), reports
    for i, (ours, want) in enumerate(zip(got, hf_tokens)):
        first = next((j for j, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        assert ours == want, (
            f"prompt {i} (length {len(prompts[i])}) diverged from transformers at token {first}"
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["aep", "ep"])
def test_runtimes_sharing_one_gpu_give_transformers_tokens(model_dir, prompts, hf_tokens, mode):
    """aep's attention and expert runtimes, or two ep devices, both on GPU 0: what a one-GPU host serves. Their
    tensors go through pinned host memory (the inline plane): NCCL refuses two ranks on one GPU."""
    parallel = (
        {"mode": "aep", "attn_ranks": 1, "expert_ranks": 1}
        if mode == "aep"
        else {"mode": "ep", "attn_ranks": 2}
    )
    config = AmoeConfig().replace(
        device={"kind": "cuda", "runtimes_per_gpu": 2}, model={"dtype": "float32"}, parallel=parallel
    )
    assert config.tensor_plane == "inline"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with ServedCluster(model_dir, config) as cluster:
        got = cluster.generate(prompts, params, timeout=120)
        reports = _reports_after_traffic(cluster)
    assert len(reports) == 2 and {r["comm"]["plane"] for r in reports} == {"inline"}, reports
    for i, (ours, want) in enumerate(zip(got, hf_tokens)):
        first = next((j for j, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        assert ours == want, (
            f"{mode}: prompt {i} (length {len(prompts[i])}) diverged from transformers at {first}"
        )


def _reports_after_traffic(cluster: ServedCluster, timeout: float = 10.0) -> list[dict]:
    """The runtimes' reports once each shows the messages it sent: reports come every 0.5 s, so the latest one may
    predate a run this short."""
    deadline = time.monotonic() + timeout
    while True:
        reports = cluster.runtime_stats(settled=False)
        if reports and all(r.get("comm", {}).get("messages_out", 0) > 0 for r in reports):
            return reports
        assert time.monotonic() < deadline, f"no runtime report shows the traffic: {reports}"
        time.sleep(0.1)
