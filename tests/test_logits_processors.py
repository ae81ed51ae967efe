"""Each sampling parameter's effect on a logits row, against an independent reference on the same logits:
transformers' logits processors where it has one (repetition penalty, min_p), a direct numpy computation where it
does not (frequency / presence penalties, logit_bias, allowed_token_ids, bad words, min_tokens); seeded draws stay
reproducible with every one of them; the wire carries every field."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import transformers

from amoe import wire
from amoe.errors import RequestError
from amoe.model.logits_processors import apply_processors
from amoe.model.sampler import Sampler, sample_sequences
from amoe.sampling_params import SamplingParams

VOCAB = 64
EOS = (2,)


@dataclass
class Seq:
    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    grammar: object = None
    generator: torch.Generator | None = None
    num_generated: int = 0  # of output_ids, generated before a move (min_tokens was reduced by as many)


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(params: SamplingParams, prompt=(), output=(), seed=0) -> torch.Tensor:
    logits = _logits(seed=seed)
    return apply_processors(logits.clone(), [Seq(params, list(prompt), list(output))], EOS)[0]


def test_repetition_penalty_equals_transformers():
    prompt, output = [3, 5, 5, 9], [11, 3, 40]
    logits = _logits(seed=1)
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    ours = _processed(SamplingParams(repetition_penalty=1.7), prompt, output, seed=1)
    assert torch.equal(ours, hf[0])
    assert not torch.equal(ours, logits[0])  # it did something


def test_frequency_and_presence_penalties_count_the_output_only():
    prompt, output = [7, 7, 8], [3, 3, 3, 12, 8]
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4)
    ref = _logits(seed=2)[0].numpy().copy()
    counts = np.bincount(output, minlength=VOCAB)
    ref -= 0.7 * counts + -0.4 * (counts > 0)
    assert np.allclose(_processed(params, prompt, output, seed=2).numpy(), ref, rtol=0, atol=1e-6)


def test_logit_bias_allowed_ids_bad_words_and_min_tokens():
    params = SamplingParams(
        logit_bias={4: 5.0, 9: -100.0},
        allowed_token_ids=[2, 4, 9, 10, 20, 21],
        bad_words_token_ids=[[20], [30, 21]],  # 21 is banned only right after 30
        min_tokens=3,
        max_tokens=8,
    )
    ref = _logits(seed=3)[0].numpy().copy()
    mask = np.full(VOCAB, -np.inf)
    mask[[2, 4, 9, 10, 20, 21]] = 0
    ref += mask
    ref[20] = -np.inf  # a one-token bad word, always
    ref[2] = -np.inf  # eos before min_tokens
    ref[4] += 5.0
    ref[9] -= 100.0
    got = _processed(params, output=[30], seed=3).numpy()
    ref_after_30 = ref.copy()
    ref_after_30[21] = -np.inf
    assert np.array_equal(got, ref_after_30)
    # Not after 30, and past min_tokens: 21 and eos come back.
    got = _processed(params, output=[5, 6, 7], seed=3).numpy()
    ref[2] = _logits(seed=3)[0, 2].item()
    assert np.array_equal(got, ref)


def test_min_p_keeps_what_transformers_keeps():
    logits = _logits(seed=4)
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7)):
        scaled = logits / temperature
        hf = transformers.MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), scaled.clone())
        kept = set(torch.isfinite(hf[0]).nonzero().flatten().tolist())
        params = SamplingParams(min_p=min_p, temperature=temperature)
        gens = [torch.Generator().manual_seed(s) for s in range(3000)]
        drawn = set(Sampler()(logits.expand(3000, VOCAB), [params] * 3000, gens))
        assert drawn <= kept
        likely = {t for t in kept if torch.softmax(scaled[0], -1)[t] > 0.01}
        assert likely <= drawn  # every token it keeps with some mass is drawn


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=1, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.9, seed=1, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, seed=1, min_p=0.1),
        SamplingParams(temperature=0.9, seed=1, logit_bias={3: 4.0}, allowed_token_ids=list(range(40))),
        SamplingParams(temperature=0.9, seed=1, bad_words_token_ids=[[5], [6, 7]], min_tokens=2),
    ],
    ids=["penalties", "repetition", "min_p", "bias+allowed", "bad_words+min_tokens"],
)
def test_seeded_draws_are_reproducible_whatever_shares_the_batch(params):
    """A seeded sequence's tokens depend on its seed and its own tokens only: alone or beside others, the same."""

    def run(batch_with_others: bool) -> list[int]:
        seq = Seq(params, [1, 3, 5], [], generator=torch.Generator().manual_seed(7))
        other = Seq(SamplingParams(temperature=1.3), [1], [], generator=torch.Generator().manual_seed(99))
        out = []
        for step in range(12):
            logits = _logits(2, seed=100 + step)
            seqs, rows = ([other, seq], [0, 1]) if batch_with_others else ([seq], [1])
            tokens, _ = sample_sequences(Sampler(), logits, rows, seqs, EOS)
            seq.output_ids.append(tokens[-1])
            other.output_ids.append(tokens[0])
            out.append(tokens[-1])
        return out

    alone = run(False)
    assert alone == run(False) == run(True)
    assert len(set(alone)) > 1


def test_forked_sequences_share_a_row_and_best_of_gets_raw_logprobs():
    logits = _logits(2, seed=5)
    params = SamplingParams(temperature=1.0, n=1, best_of=3)
    seqs = [Seq(params, [1], [], generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    tokens, logprobs = sample_sequences(Sampler(), logits, [1, 1, 1], seqs, EOS)
    expected = torch.log_softmax(logits[1], -1)[tokens]
    assert [lp.token_ids for lp in logprobs] == [[t] for t in tokens]
    assert torch.allclose(torch.tensor([lp.logprobs[0] for lp in logprobs]), expected)
    plain = [Seq(SamplingParams(), [1], [], generator=torch.Generator().manual_seed(1))]
    assert sample_sequences(Sampler(), logits, [0], plain, EOS)[1] == [None]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 2, "temperature": 0}, "best_of"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {1: 200.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
    ],
)
def test_bad_values_name_their_parameter(kwargs, param):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_the_wire_carries_every_sampling_field():
    params = SamplingParams(
        max_tokens=9, temperature=0.5, top_k=7, top_p=0.9, seed=3, stop_token_ids=[4], ignore_eos=True, n=2,
        best_of=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.05,
        min_tokens=2, logit_bias={5: -3.0}, allowed_token_ids=[1, 5, 9], bad_words_token_ids=[[7, 8]],
        grammar='{"grammars": []}',
    )  # fmt: skip
    message = wire.AddRequest(1, [1, 2], wire.to_wire_sampling(params, params.seed), seq_ids=[7, 8])
    decoded = wire.decode(wire.encode(message))
    assert decoded.seq_ids == [7, 8]
    assert wire.from_wire_sampling(decoded.params) == params


def test_a_moved_sequence_counts_min_tokens_from_its_readmission():
    """Moved after 3 tokens, a request with min_tokens 5 comes back with min_tokens 2: eos stays banned for exactly
    the 2 tokens it still owes, while the penalties see all of its output."""
    params = SamplingParams(min_tokens=2, max_tokens=7)
    logits = _logits(seed=6)
    for new, banned in ((0, True), (1, True), (2, False)):
        seq = Seq(params, [1], [9, 9, 9] + [4] * new, num_generated=3)
        row = apply_processors(logits.clone(), [seq], EOS)[0]
        assert (row[2] == float("-inf")) == banned


class _Allow:
    """A grammar state that allows a fixed set of tokens (amoe.structured.GrammarState's `allowed`)."""

    def __init__(self, tokens: list[int]) -> None:
        self.mask = np.zeros(VOCAB, dtype=bool)
        self.mask[tokens] = True

    def allowed(self) -> np.ndarray:
        return self.mask


def test_logprobs_are_the_raw_models_but_see_the_grammar_mask():
    """vLLM's default raw_logprobs: the processors (here logit_bias and a penalty) decide the draw but not the
    reported log-probabilities; a grammar's mask, which vLLM applies before its sampler, is in them."""
    logits = _logits(seed=9)
    raw = torch.log_softmax(logits[0], -1)
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={5: 100.0}, presence_penalty=1.0)
    tokens, logprobs = sample_sequences(Sampler(), logits.clone(), [0], [Seq(params, [1], [3])], EOS)
    assert tokens == [5]  # the bias decided it
    assert logprobs[0].logprobs[0] == pytest.approx(raw[5].item(), abs=1e-6)
    assert logprobs[0].top_ids[0] == raw.topk(2).indices.tolist()

    grammar = _Allow(list(range(10, 20)))
    seq = Seq(SamplingParams(temperature=0, logprobs=3), [1], [], grammar=grammar)
    tokens, logprobs = sample_sequences(Sampler(), logits.clone(), [0], [seq], EOS)
    masked = torch.log_softmax(logits[0].masked_fill(~torch.from_numpy(grammar.mask), float("-inf")), -1)
    assert 10 <= tokens[0] < 20
    assert logprobs[0].logprobs[0] == pytest.approx(masked[tokens[0]].item(), abs=1e-6)
    assert logprobs[0].top_ids[0] == masked.topk(3).indices.tolist()
