"""Logits processors: what a request's parameters do to its logits row before the sampler draws from it.

They run where the head runs (the attention rank, or the local engine), on each sequence's row, in vLLM v1's
order (its model runner's grammar mask, then vllm/v1/sample/sampler.py): the grammar's mask, allowed_token_ids,
bad words, min_tokens, logit_bias, then the penalties (repetition over prompt and output, frequency and presence
over the output). Temperature, min_p,
top-k and top-p belong to the sampler (amoe/model/sampler.py). Every step is a pure function of the sequence's
tokens so far, so a seeded draw stays reproducible with any of them: the sampler still takes one uniform number
per sampled token. Rows of requests without any of these parameters are not touched (the plain path pays a scan of
the batch's parameters, nothing more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from amoe.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class SequenceView(Protocol):
    """What the processors read of one sequence: its parameters, tokens and grammar state."""

    params: SamplingParams

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def grammar(self):  # amoe.structured.GrammarState | None
        ...


def mask_grammars(logits: torch.Tensor, seqs: Sequence[SequenceView]) -> None:
    """logits [R, V] float32, one row per sequence, in place: the tokens each sequence's grammar forbids out.
    Apart from the other processors: the log-probabilities a request gets back see this mask, not them."""
    for row, seq in zip(logits, seqs):
        if seq.grammar is not None:
            allowed = torch.from_numpy(seq.grammar.allowed()).to(row.device)  # [V] bool
            row.masked_fill_(~allowed, _NEG_INF)


def apply_processors(
    logits: torch.Tensor, seqs: Sequence[SequenceView], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """logits [R, V] float32, one row per sequence, its grammar's mask applied (mask_grammars) → the same tensor,
    each row processed per its sequence."""
    for i, seq in enumerate(seqs):
        if seq.params.has_processors:
            _process_row(logits[i], seq, eos_token_ids)
    return logits


def _process_row(row: torch.Tensor, seq: SequenceView, eos_token_ids: Sequence[int]) -> None:
    """row [V], in place."""
    params, vocab, out = seq.params, row.shape[0], seq.output_ids
    masked = row.clone() if seq.grammar is not None else None  # what the grammar alone allows
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        keep[_ids(params.allowed_token_ids, vocab, row.device)] = True
        row.masked_fill_(~keep, _NEG_INF)
    if params.bad_words_token_ids:
        banned = [w[-1] for w in params.bad_words_token_ids if _ends_with(out, w[:-1])]
        row[_ids(banned, vocab, row.device)] = _NEG_INF
    # min_tokens counts what this admission generated: a moved request comes with it reduced by what it had.
    if len(out) - getattr(seq, "num_generated", 0) < params.min_tokens:  # no end yet: eos and stop tokens out
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        row[_ids(stops, vocab, row.device)] = _NEG_INF
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=row.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=row.dtype, device=row.device)
        inside = ids < vocab
        row.index_add_(0, ids[inside], bias[inside])
    _penalize(row, seq, params)
    if masked is not None and not torch.isfinite(row).any():
        # The other parameters left nothing the grammar allows: the grammar wins (its output must parse).
        row.copy_(masked)


def _penalize(row: torch.Tensor, seq: SequenceView, params: SamplingParams) -> None:
    vocab, out = row.shape[0], seq.output_ids
    if params.repetition_penalty != 1.0:
        # HF / vLLM: every token seen in prompt or output; positive logits divided, negative ones multiplied.
        seen = torch.unique(_ids([*seq.prompt_ids, *out], vocab, row.device))
        values = row[seen]
        p = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / p, values * p)
    if (params.frequency_penalty or params.presence_penalty) and out:
        counts = torch.bincount(_ids(out, vocab, row.device), minlength=vocab).to(row.dtype)  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _ends_with(tokens: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether `tokens` ends with `prefix` (a bad word's tokens before its last)."""
    n = len(prefix)
    return n == 0 or (len(tokens) >= n and list(tokens[len(tokens) - n :]) == list(prefix))


def _ids(ids: Sequence[int], vocab: int, device) -> torch.Tensor:
    """Token ids as an index tensor, those past the logits' width dropped (a tokenizer larger than lm_head)."""
    return torch.tensor([t for t in ids if t < vocab], dtype=torch.long, device=device)
