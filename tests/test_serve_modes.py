"""`amoe serve --parallel ep|pingpong` through the real server equals the single-process reference (greedy, tiny
model); `--executor emulated` with a model profile (no checkpoint) answers a request with max_tokens tokens."""

import asyncio
import re
import time

import httpx
import pytest
import torch
import transformers
from factories import CheckedServer, check_echo_choice, hf_greedy

from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams

PROMPTS = [[1], [1, 5, 9, 200], [1] + list(range(30, 45)), [1] + list(range(100, 140))]
MAX_TOKENS = [9, 6, 7, 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("modes") / "tiny-modes", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=str(model_dir))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf, prompt, 3) for prompt in PROMPTS]


async def _complete_all(url: str, prompts, max_tokens, model=None) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt, n):
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags",
    [
        ("--parallel", "ep", "--attn-ranks", "2"),
        (
            "--parallel",
            "pingpong",
            "--attn-ranks",
            "1",
            "--expert-ranks",
            "2",
            "--parallel-micro-batches",
            "2",
        ),
    ],
    ids=["ep", "pingpong"],
)
def test_sync_modes_match_reference(model_dir, reference, hf_reference, flags):
    server = CheckedServer("--model", str(model_dir), *flags)
    with server as url:
        answers = asyncio.run(_complete_all(url, PROMPTS, MAX_TOKENS))
        health = httpx.get(f"{url}/health").json()
        body = {"model": answers[0]["model"], "prompt": PROMPTS, "max_tokens": 3, "temperature": 0}
        scored = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 3}, timeout=60)
    assert [a["choices"][0]["text"] for a in answers] == reference
    # Every prompt in one request, scored where the head runs: transformers' log-probabilities, echo included.
    assert scored.status_code == 200, scored.text
    choices = scored.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS)))
    for prompt, (output, ref), choice in zip(PROMPTS, hf_reference, choices):
        check_echo_choice(ref, prompt + output, choice, 3)
    assert health["status"] == "ok" and health["mode"] == flags[1]
    # Lock-step devices cannot rejoin a running group: start-up says so, once (docs/healing.md)
    said = [line for line in server.lines if "self-healing is off" in line]
    assert len(said) == 1 and f"--parallel {flags[1]}" in said[0], said


@pytest.mark.timeout(120)
def test_emulated_profile_serves_max_tokens():
    flags = (
        "--executor", "emulated", "--executor-profile", "mixtral-8x7b-mqa", "--executor-top-k", "1",
        "--routing", "skew-exp", "--time-scale", "2", "--attn-ranks", "1", "--expert-ranks", "2",
    )  # fmt: skip
    with CheckedServer(*flags) as url:
        answers = asyncio.run(_complete_all(url, [[11, 12, 13, 14], [20] * 30], [7, 3]))
        health = httpx.get(f"{url}/health").json()
    assert [a["usage"]["completion_tokens"] for a in answers] == [7, 3]
    assert answers[0]["model"] == "mixtral-8x7b-mqa"
    assert health["executor"]["time_scale"] == 2.0
    # Memory, not cache.num_kv_blocks, bounds the KV cache of an emulated A100 80GB: millions of tokens.
    assert health["kv"][0]["total_blocks"] * 16 > 1_000_000


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["aep", "ep"])
def test_decode_only_emulation_skips_the_prompt(mode):
    """`--executor-decode-only true` (the paper's decode-only evaluation): a prompt's KV counts as written, so a
    request costs max_tokens decode rows whatever its prompt length, and its KV is still reserved and freed."""
    flags = (
        "--parallel", mode, "--attn-ranks", "2", *(["--expert-ranks", "2"] if mode == "aep" else []),
        "--executor", "emulated", "--executor-profile", "mixtral-8x7b-mqa:2", "--executor-top-k", "1",
        "--routing", "skew-exp", "--time-scale", "2", "--executor-decode-only", "true",
    )  # fmt: skip
    prompts, max_tokens = [[11, 12, 13, 14], [20] * 300, [7]], [7, 3, 5]
    server = CheckedServer(*flags)
    with server as url:
        answers = asyncio.run(_complete_all(url, prompts, max_tokens))
        time.sleep(1.5)  # runtime stats reach /metrics with the heartbeats (every 0.5 s)
        metrics = httpx.get(f"{url}/metrics").text
        health = httpx.get(f"{url}/health").json()
    assert [a["usage"]["completion_tokens"] for a in answers] == max_tokens
    assert [a["usage"]["prompt_tokens"] for a in answers] == [len(p) for p in prompts]
    assert all(kv["free_blocks"] == kv["total_blocks"] for kv in health["kv"])  # every reservation freed
    healing_off = sum("self-healing is off" in line for line in server.lines)
    assert healing_off == (0 if mode == "aep" else 1), server.lines
    if mode == "aep":  # rows through attention block 0: one per output token, none for the prompts
        rows = re.findall(
            r'^amoe_runtime_executed_rows_total\{[^}]*block="0"[^}]*rank="\d+"[^}]*\} (\S+)', metrics, re.M
        )
        assert rows and sum(float(r) for r in rows) == sum(max_tokens)


def test_decode_only_needs_the_emulated_executor(capsys):
    from amoe.cli import main

    assert main(["serve", "--executor-decode-only", "true"]) == 1
    assert "decode_only needs --executor emulated" in capsys.readouterr().err
