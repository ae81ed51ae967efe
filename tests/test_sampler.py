"""Sampler behaviour and SamplingParams validation."""

import pytest
import torch

from amoe.errors import RequestError
from amoe.model.sampler import Sampler
from amoe.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits, params, seeds):
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return Sampler()(logits, params, gens)


def test_greedy_is_argmax():
    logits = _logits(4)
    greedy = SamplingParams(temperature=0)
    assert _sample(logits, [greedy] * 4, [None] * 4) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6, temperature=2.0)])
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = _logits(6, seed=1)
    assert _sample(logits, [params] * 6, list(range(6))) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = _logits(3, seed=2)
    params = SamplingParams(temperature=1.0, seed=5)
    # Run the seeded row for several steps alone and in a batch with others; its draws must not change.
    alone_gen, batch_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    other = torch.Generator().manual_seed(99)
    sampler = Sampler()
    alone = [sampler(logits[1:2], [params], [alone_gen])[0] for _ in range(20)]
    batched = [sampler(logits, [params] * 3, [other, batch_gen, other])[1] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it does sample


def test_top_k_only_returns_top_tokens():
    logits = _logits(1, seed=3).expand(200, VOCAB)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens = _sample(logits, [SamplingParams(top_k=3, temperature=5.0)] * 200, range(200))
    assert set(tokens) <= top3 and len(set(tokens)) == 3


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().expand(3000, 3)
    tokens = torch.tensor(_sample(logits, [SamplingParams()] * 3000, range(3000)))
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_mixed_greedy_and_sampled_rows():
    logits = _logits(2, seed=4)
    tokens = _sample(logits, [SamplingParams(temperature=0), SamplingParams(top_k=1)], [None, 1])
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_params_raise_request_error(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_params_normalise_stop_lists():
    params = SamplingParams(stop="###", stop_token_ids=[7, 8])
    assert params.stop == ("###",) and params.stop_token_ids == (7, 8)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
