"""Held-out perplexity of a model, and of the unigram baseline on the same predicted tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def token_stream(chapters: Sequence[list[int]], bos: int, eos: int) -> torch.Tensor:
    """Chapters as one stream, each `<s> ... </s>`."""
    ids: list[int] = []
    for chapter in chapters:
        ids += [bos, *chapter, eos]
    return torch.tensor(ids, dtype=torch.long)


def held_out_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into consecutive non-overlapping windows (the tail shorter than a window dropped)."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len)  # [windows, seq_len]


@torch.no_grad()
def mean_nll(model: Any, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean negative log-likelihood (nats) of every token after the first in each window."""
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch, output_router_logits=False).logits.float()  # [b, seq, vocab]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        total -= float(logp.gather(-1, batch[:, 1:, None]).sum())
        count += batch[:, 1:].numel()
    return total / count


def unigram_nll(train: torch.Tensor, windows: torch.Tensor, vocab_size: int) -> float:
    """The same targets under token frequencies of the training stream (add-one smoothed)."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[windows[:, 1:]].mean())


def perplexity(nll: float) -> float:
    return math.exp(nll)
