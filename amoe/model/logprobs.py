"""Log-probabilities where the head runs: of each sampled token (a request's `logprobs`, and best_of's ranking) and
of its prompt's tokens (`prompt_logprobs`), from the same float32 logits the sampler gets, before the logits
processors and any sampling transform (penalties, logit_bias, temperature, top-k, top-p): vLLM's default
"raw_logprobs". A grammar's mask is the one edit they see, as in vLLM, whose model runner masks the logits before
its sampler takes them (amoe.model.sampler.sample_sequences). Only a few numbers per position leave the device
(the token's log-probability and rank, the top k), never a vocabulary row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from amoe.logprobs import Logprobs, concat

# Prompt rows scored per pass: bounds the [rows, V] float32 logits a long prompt needs at once (512 rows of a
# 128k vocabulary are 256 MiB).
PROMPT_ROWS_PER_PASS = 512


def gather(logprobs: torch.Tensor, targets: torch.Tensor, ks: Sequence[int]) -> list[Logprobs]:
    """logprobs [n, V] float32 (log-softmax rows), targets [n] → per row: the target's log-probability and rank,
    and the row's top ks[i] — one Logprobs of one position each."""
    chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
    # At least the top 1: it ranks most tokens without another pass over the vocabulary.
    top_values, top_ids = logprobs.topk(max(max(ks, default=0), 1), dim=-1)  # [n, k]
    # Rank: 1 + how many tokens are more likely (ties share the better rank, as vLLM counts). A token at or above
    # the row's k-th value is ranked by the top k alone (every greater value is among them); the others count
    # their whole row.
    ranks = (top_values > chosen).sum(dim=1) + 1  # [n]
    outside = (chosen[:, 0] < top_values[:, -1]).nonzero()[:, 0]
    if len(outside):
        ranks[outside] = (logprobs[outside] > chosen[outside]).sum(dim=1) + 1
    # One transfer to the host for all of it: a handful of numbers per row.
    rows = zip(
        targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), ks
    )
    return [Logprobs([t], [lp], [r], [i[:n]], [v[:n]]) for t, lp, r, i, v, n in rows]


class SampleLogprobs:
    """Log-probabilities of the tokens a head step samples, for the rows that want them (`ks[i]` top
    log-probabilities, None: none; SamplingParams.num_logprobs). The log-softmax is taken before the logits
    processors, which edit the logits in place, so they change nothing here; `finish` gathers each row's sampled
    token."""

    def __init__(self, logits: torch.Tensor, ks: Sequence[int | None]) -> None:
        self.num_rows = len(ks)
        self.rows = [i for i, k in enumerate(ks) if k is not None]
        self.ks = [ks[i] for i in self.rows]
        self.logprobs = None
        if len(self.rows) == self.num_rows:  # every row asked: no gathering copy first
            self.logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V], a new tensor
        elif self.rows:
            index = torch.tensor(self.rows, device=logits.device)
            self.logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [n, V]

    def finish(self, tokens: Sequence[int]) -> list[Logprobs | None]:
        """Per row, its sampled token's Logprobs (one position), or None where none was asked."""
        out: list[Logprobs | None] = [None] * self.num_rows
        if self.logprobs is None:
            return out
        targets = torch.tensor([tokens[i] for i in self.rows], device=self.logprobs.device)
        for i, lp in zip(self.rows, gather(self.logprobs, targets, self.ks)):
            out[i] = lp
        return out


def prompt_logprobs(
    logits_at: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, prompt: Sequence[int], k: int
) -> Logprobs:
    """The prompt's tokens 1..P-1 scored by the rows before them (`rows` [P-1]: the batch rows of positions
    0..P-2; `logits_at(rows)` → their float32 logits). Token 0 has nothing before it: the API shows it as null."""
    parts = []
    targets = torch.tensor(prompt[1:], dtype=torch.int64)
    for lo in range(0, len(rows), PROMPT_ROWS_PER_PASS):
        logits = logits_at(rows[lo : lo + PROMPT_ROWS_PER_PASS])  # [n, V]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        part_targets = targets[lo : lo + PROMPT_ROWS_PER_PASS].to(logprobs.device)
        parts += gather(logprobs, part_targets, [k] * len(part_targets))
    return concat(parts)


@dataclass(frozen=True)
class HeadSample:
    """What a head step hands back: per sequence it sampled, the token and its Logprobs where wanted; and the
    Logprobs of the prompts scored in this step (keyed by chunk)."""

    tokens: list[int]
    logprobs: list[Logprobs | None] | None = None  # None: no sequence wanted any
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)
