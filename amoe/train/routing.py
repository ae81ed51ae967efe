"""The default model's real routing, measured for the studies: per-block expert popularity on held-out text, the
skew fitted as the emulation's `skew-exp` λ, and recorded traces replayed under the offloading policies beside
synthetic traces of the same shape.

λ is the emulation's (amoe.perf.model.routing): expert popularity p_r ∝ exp(−λ r) by popularity rank r. Two fits per
block: `lambda_hottest` matches the hottest expert's first-choice share over the mean, as the emulation's default
λ = 0.08 was derived from Mixtral-8x7B's published counts; `lambda_slope` is the least-squares slope of
log(first-choice share) against rank over all experts (the whole shape, not only its head).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from amoe.offload import replay as rp
from amoe.offload.activation import ActivationPolicy
from amoe.offload.eam import EAMC
from amoe.offload.policy import LFU, LRU
from amoe.offload.trace import TaskRouting, Trace, stats
from amoe.perf.model.routing import hottest_to_mean

EAMC_SIZE = 64  # expert activation matrices kept from the first half of a trace (MoE-Infinity's EAMC)


@torch.no_grad()
def router_counts(
    model: Any, windows: torch.Tensor, top_k: int, batch_size: int = 8
) -> tuple[np.ndarray, ...]:
    """Per block and expert: how often it was a token's first choice, and how often among its top_k, over every
    token of `windows` ([n, seq_len])."""
    first = inclusion = None
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch, output_router_logits=True).router_logits  # per block [b * seq, E]
        picks = torch.stack([block.float().topk(top_k, dim=-1).indices for block in logits])  # [B, rows, k]
        num_blocks, _, _ = picks.shape
        num_experts = logits[0].shape[-1]
        f = torch.stack([torch.bincount(picks[b, :, 0], minlength=num_experts) for b in range(num_blocks)])
        i = torch.stack(
            [torch.bincount(picks[b].flatten(), minlength=num_experts) for b in range(num_blocks)]
        )
        first = f if first is None else first + f
        inclusion = i if inclusion is None else inclusion + i
    return first.numpy(), inclusion.numpy()


def fit_lambda_hottest(ratio: float, num_experts: int) -> float:
    """λ whose hottest expert's first-choice share over the mean equals `ratio` (bisection; 0 if even)."""
    if ratio <= 1.0:
        return 0.0
    lo, hi = 0.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hottest_to_mean(num_experts, 1, mid) < ratio else (lo, mid)
    return (lo + hi) / 2


def fit_lambda_slope(shares: np.ndarray) -> float:
    """−slope of log(share) against popularity rank, least squares over the experts with any share."""
    ranked = np.sort(shares[shares > 0])[::-1]
    if len(ranked) < 2:
        return 0.0
    slope = np.polyfit(np.arange(len(ranked)), np.log(ranked), 1)[0]
    return float(-slope)


def popularity(first: np.ndarray, inclusion: np.ndarray, top_k: int) -> list[dict[str, Any]]:
    """Per block: first-choice shares by expert id, hottest over mean (first choice, and top-k inclusion), and λ."""
    rows = []
    num_experts = first.shape[1]
    for b in range(first.shape[0]):
        shares = first[b] / first[b].sum()
        top1 = float(shares.max() * num_experts)
        topk = float(inclusion[b].max() / (inclusion[b].sum() / num_experts))
        rows.append(
            {
                "block": b,
                "first_choice_share": [round(float(s), 4) for s in shares],
                "hottest_to_mean_top1": round(top1, 3),
                f"hottest_to_mean_top{top_k}": round(topk, 3),
                "lambda_hottest": round(fit_lambda_hottest(top1, num_experts), 4),
                "lambda_slope": round(fit_lambda_slope(shares), 4),
            }
        )
    return rows


def synthetic_like(trace: Trace, top_k: int, prompt_tokens: int, max_tokens: int) -> Trace:
    """As many sequences of the task-clustered routing model, at the recorded trace's shape and lengths: its tasks,
    popularity and spread as set from MoE-Infinity §3; its per-block support and core scaled to the block's
    experts (half of them, and top_k)."""
    model = TaskRouting(
        num_blocks=trace.num_blocks, num_experts=trace.num_experts, top_k=top_k,
        support=max(top_k, trace.num_experts // 2), core=top_k, prompt=(prompt_tokens, prompt_tokens),
        output=(max_tokens, max_tokens),
    )  # fmt: skip
    return model.generate(len(trace.sequences), seed=1)


def replay_rows(name: str, trace: Trace, capacities: list[int], batch: int = 1) -> list[dict[str, Any]]:
    """Hit ratios of LRU, LFU, activation-aware (with and without the EAMC's history) and Bélády's optimum on the
    second half of `trace`, the EAMC built from the first half (as bench/offload_replay.py does)."""
    train, test = trace.split(len(trace.sequences) // 2)
    eamc = EAMC.build(train.eams(), EAMC_SIZE, seed=0)
    evs = rp.events(test, batch)
    rows = []
    for cap in capacities:
        row: dict[str, Any] = {"trace": name, "batch": batch, "capacity": cap}
        for policy in (
            LRU(),
            LFU(),
            ActivationPolicy(trace.num_blocks, trace.num_experts, eamc=eamc),
            ActivationPolicy(trace.num_blocks, trace.num_experts, eamc=eamc, history=True),
        ):
            row[policy.name] = round(rp.replay(evs, policy, cap).hit_ratio, 4)
        row["belady"] = round(rp.belady(rp.accesses(evs), cap).hit_ratio, 4)
        rows.append(row)
    return rows


def locality_rows(name: str, trace: Trace) -> list[dict[str, Any]]:
    """MoE-Infinity §3's statistics: share of experts a batch activates, share of those reused across steps."""
    rows = []
    for b in (1, 4, 16):
        if len(trace.sequences) >= b:
            s = stats(trace, b)
            rows.append({"trace": name, "batch": b, "activated": round(s["activated"], 4),
                         "reused": round(s["reused"], 4)})  # fmt: skip
    return rows


def held_out_prompts(
    tokenizer: Any, chapters: list[str], num_prompts: int, prompt_tokens: int
) -> list[list[int]]:
    """Up to `num_prompts` prompts of `prompt_tokens` tokens (after <s>), cut in order from the held-out chapters."""
    prompts = []
    for chapter in chapters:
        ids = tokenizer.encode(chapter, add_special_tokens=False)
        for start in range(0, len(ids) - prompt_tokens + 1, prompt_tokens):
            prompts.append([tokenizer.bos_token_id, *ids[start : start + prompt_tokens]])
            if len(prompts) == num_prompts:
                return prompts
    return prompts
