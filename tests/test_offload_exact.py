"""Greedy tokens with expert offloading equal those without (and transformers'), at budgets of one expert, a
quarter of the experts and all of them, with concurrent requests, in local and aep; the counters add up; the
routing record holds every finished sequence."""

import asyncio
import json
import logging
import re
import time

import httpx
import pytest
import torch
import transformers
from factories import CheckedServer, hf_greedy

from amoe.config import OffloadSection
from amoe.llm import LLM
from amoe.model.config import load_model_config
from amoe.model.make import make_model
from amoe.offload.io import CheckpointIndex
from amoe.offload.store import dense_bytes, reader_bytes, routed_expert_bytes
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster

PROMPTS = [[1], [1, 5, 9, 200], [1] + list(range(30, 45)), [1] + list(range(100, 140))]
MAX_TOKENS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("offload") / "tiny-offload", seed=0)  # with a tokenizer


@pytest.fixture(scope="module")
def sizes(ckpt):
    """(config, dense part, one expert, the reader's buffers): a budget counts the reader's buffers too."""
    cfg = load_model_config(ckpt)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    reader = reader_bytes(CheckpointIndex(ckpt), cfg, keys, torch.float32)
    return (
        cfg,
        dense_bytes(cfg, torch.float32, attention=True),
        routed_expert_bytes(cfg, torch.float32),
        reader,
    )


@pytest.fixture(scope="module")
def reference_outputs(ckpt):
    return LLM(model=str(ckpt), num_kv_blocks=64).generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def reference(ckpt, reference_outputs):
    """Every expert resident; the same tokens transformers gives (checked on two prompts)."""
    tokens = [o.outputs[0].token_ids for o in reference_outputs]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for prompt, got in list(zip(PROMPTS, tokens))[1:3]:
        assert hf_greedy(hf, prompt, MAX_TOKENS)[0] == got
    return tokens


@pytest.fixture(scope="module")
def reference_texts(reference, reference_outputs):
    return [o.outputs[0].text for o in reference_outputs]


@pytest.mark.parametrize(
    ("slots", "policy", "prefetch"),
    [(1, "lru", False), (8, "lfu", True), (32, "lru", True)],
    ids=["one_expert", "quarter", "all"],
)
def test_local_engine_equals_reference(ckpt, sizes, reference, tmp_path, caplog, slots, policy, prefetch):
    cfg, dense, expert, reader = sizes
    record = tmp_path / "routing.jsonl"
    with caplog.at_level(logging.INFO, logger="amoe.offload"):
        llm = LLM(
            model=str(ckpt), num_kv_blocks=64, offload_budget=str(dense + reader + slots * expert), offload_policy=policy,
            offload_prefetch=prefetch, offload_record=str(record),
        )  # fmt: skip
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]  # all four batched together
        stats = llm.engine.offload_stats()
    finally:
        llm.engine.close()
    assert got == reference
    if slots == 32:  # a budget that holds every expert: served the usual way, and said so
        assert stats is None and "holds all 32 experts" in caplog.text
    else:
        assert stats["slots"] == slots and stats["resident"] <= slots
        assert stats["bytes_read"] == stats["loads"] * stats["expert_bytes"]
        assert stats["hits"] + stats["misses"] > 0
        if not prefetch:  # nothing is read but what a step waits for
            assert stats["loads"] == stats["misses"] and stats["prefetches"] == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines[0] == {"format": "amoe-routing/1", "num_blocks": 4, "num_experts": 8, "model": ckpt.name}
    assert sorted(line["seq"] for line in lines[1:]) == list(range(len(PROMPTS)))
    for line in lines[1:]:
        prompt = PROMPTS[line["seq"]]
        assert len(line["steps"]) == MAX_TOKENS  # the prefill, then a decode step per token but the last
        prefill, decode = line["steps"][0], line["steps"][1]
        assert [sum(n for _, n in block) for block in prefill] == [2 * len(prompt)] * cfg.num_blocks
        assert all(len(block) == 2 for block in decode)  # one token, top-2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slots", [1, 4], ids=["one_expert", "quarter"])
def test_aep_expert_runtimes_equal_reference(ckpt, sizes, reference, slots):
    """Two attention ranks, two expert runtimes of 16 (block, expert) keys each, every request at once."""
    _, _, expert, reader = sizes
    offload = OffloadSection(budget=str(reader + slots * expert), policy="lru")
    with InProcessCluster(ckpt, 2, 2, offload=offload) as cluster:
        got = cluster.generate(PROMPTS, PARAMS)
        stats = [e.offload.stats() for e in cluster.executors if getattr(e, "offload", None) is not None]
    assert got == reference
    assert len(stats) == 2
    for s in stats:
        assert s["slots"] == slots and s["experts"] == 16 and s["misses"] > 0
        assert s["bytes_read"] == s["loads"] * s["expert_bytes"]


async def _complete_all(url: str) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]

        return await asyncio.gather(*(one(p) for p in PROMPTS))


@pytest.mark.timeout(150)
def test_aep_server_offloads_records_and_reports(ckpt, sizes, reference_texts, tmp_path):
    """The real server: expert runtimes with one slot each, concurrent requests, the routing record written by
    the attention rank, and the store's counters on /metrics."""
    _, _, expert, reader = sizes
    record = tmp_path / "served.jsonl"
    flags = (
        "--model", str(ckpt), "--parallel", "aep", "--attn-ranks", "1", "--expert-ranks", "2",
        "--cache-num-kv-blocks", "64", "--offload-budget", str(reader + expert), "--offload-policy", "lru", "--offload-record", str(record),
    )  # fmt: skip
    with CheckedServer(*flags) as url:
        choices = asyncio.run(_complete_all(url))
        # The expert runtimes' counters come with their periodic reports: wait for both (a report, not a fixed time).
        deadline = time.monotonic() + 60
        while True:
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            misses = re.findall(
                r'^amoe_offload_misses_total\{role="expert",runtime="(\d)"\} (\S+)$', metrics, re.M
            )
            if (len(misses) == 2 and all(float(v) > 0 for _, v in misses)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert [c["text"] for c in choices] == reference_texts
    assert len(misses) == 2 and all(float(v) > 0 for _, v in misses), metrics
    assert re.search(r'^amoe_offload_slots\{role="expert",runtime="\d"\} 1\.0$', metrics, re.M)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines[0]["format"] == "amoe-routing/1" and len(lines) == 1 + len(PROMPTS)
    assert all(len(line["steps"]) == MAX_TOKENS for line in lines[1:])
