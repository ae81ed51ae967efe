"""The sampler: logits of each request's last row → one token id each, per its SamplingParams."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from amoe.logprobs import Logprobs
from amoe.model.logits_processors import apply_processors, mask_grammars
from amoe.model.logprobs import SampleLogprobs
from amoe.request_rules import sequence_seed  # noqa: F401 - the sampler's seeds, where engines find them
from amoe.sampling_params import SamplingParams


class Sampler:
    """Greedy rows take the argmax; the others sample after temperature, min_p, top-k and top-p, in one vectorised
    pass (min_p and top-k both keep a prefix of the sorted row, so their order does not matter; top-p then takes
    what they left, renormalised, as vLLM's sampler does).

    Each sampled row draws one uniform number from its own request's generator, so a seeded request gets the same
    tokens whatever else shares its batch. The generators are host generators on every device: a seed draws the
    same numbers on a CPU and a GPU, and only those R numbers go up; the filtering runs where the logits are.
    """

    def forward(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """logits [R, V] float32 → R token ids."""
        tokens = logits.argmax(dim=-1)  # [R]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            chosen = self._sample(
                logits[rows], [params[i] for i in sampled], [generators[i] for i in sampled]
            )
            tokens[rows] = chosen
        return tokens.tolist()

    __call__ = forward

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits [S, V] → sampled token ids [S] (inverse-CDF sampling over the filtered, sorted distribution)."""
        vocab, dev = logits.shape[-1], logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
        sorted_logits, sorted_ids = (logits / temperature).sort(dim=-1, descending=True)  # [S, V]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)[:, None]
        sorted_logits.masked_fill_(torch.arange(vocab, device=dev)[None, :] >= top_k, float("-inf"))
        if any(p.min_p > 0 for p in params):
            # min_p (after temperature, as vLLM): keep p_i >= min_p * p_max, i.e. logit_i - logit_max >= log(min_p).
            floor = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev).log()[:, None]
            sorted_logits.masked_fill_(sorted_logits - sorted_logits[:, :1] < floor, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)[:, None]
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does.
        probs.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
        cdf = probs.cumsum(dim=-1)  # [S, V]
        uniform = torch.cat([torch.rand(1, generator=g) for g in generators]).to(dev)  # [S]
        choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
        return sorted_ids.gather(1, choice).squeeze(1)


@torch.inference_mode()  # the head's logits are inference tensors, and the processors change them in place
def sample_sequences(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[int],
    seqs: Sequence,
    eos_token_ids: Sequence[int],
) -> tuple[list[int], list[Logprobs | None]]:
    """logits [R, V] of a head step; sequence j samples from row rows[j] (the n sequences of a request that was
    just prefilled share its row) → one token per sequence, and each token's Logprobs where its sequence wants
    them (SamplingParams.num_logprobs: asked for, or best_of's ranking), else None. The log-probabilities are
    taken after the grammar's mask and before every other processor, as vLLM's default "raw_logprobs" (its model
    runner masks the logits before its sampler takes them). `seqs` are amoe.model.logits_processors views with
    a `generator`."""
    if rows != list(range(logits.shape[0])):
        logits = logits[rows]  # [S, V], a copy: the processors change it per sequence
    mask_grammars(logits, seqs)
    wanted = SampleLogprobs(logits, [s.params.num_logprobs for s in seqs])
    apply_processors(logits, seqs, eos_token_ids)
    tokens = sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
    return tokens, wanted.finish(tokens)


def make_generator(params: SamplingParams, seed: int | None) -> torch.Generator | None:
    """A sampled request's own generator (greedy requests draw nothing): seeded, or nondeterministic for None."""
    if params.is_greedy:
        return None
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # nondeterministic, as asked
    else:
        generator.manual_seed(seed)
    return generator
