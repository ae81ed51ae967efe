"""Training the default model, on a small corpus and a tiny shape: the corpus split, the schedule, the baseline, a
seed that fixes the weights, and a checkpoint that transformers and amoe read alike."""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import pytest
import torch

from amoe.errors import ConfigError
from amoe.train import corpus as corpus_module
from amoe.train import default as default_module
from amoe.train.corpus import Corpus, split_chapters
from amoe.train.evaluate import held_out_windows, token_stream, unigram_nll
from amoe.train.loop import build_model, learning_rate, train
from amoe.train.settings import TrainSettings
from amoe.train.words import dictionary_fraction

transformers = pytest.importorskip("transformers")

TINY = TrainSettings(
    vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8, expert_size=16,
    seq_len=16, batch_size=2, steps=4, warmup_steps=2, log_every=2, eval_every=4, threads=1,
)  # fmt: skip


def test_verses_become_chapters_in_order():
    text = "Ge1:1 In the beginning.\nGe1:2 And the earth.\nGe2:1 Thus.\n1Jo1:1 That which was.\n"
    assert split_chapters(text) == ["In the beginning. And the earth.", "Thus.", "That which was."]
    with pytest.raises(ConfigError, match="unexpected line"):
        split_chapters("Ge1:1 fine\nnot a verse\n")


def test_every_twentieth_chapter_is_held_out(monkeypatch, tmp_path):
    lines = [f"Ge{c}:1 chapter {c}." for c in range(1, 43)]
    monkeypatch.setattr(corpus_module, "bible_text", lambda cache_dir: "\n".join(lines) + "\n")
    corpus = corpus_module.load_corpus(tmp_path)
    assert corpus.held_out == ["chapter 20.", "chapter 40."]
    assert len(corpus.train) == 40 and "chapter 20." not in corpus.train


def test_a_changed_text_is_refused(tmp_path):
    (tmp_path / f"kjv-{corpus_module.PACKAGES[0][1]}.txt").write_text("Ge1:1 Not the pinned text.\n")
    with pytest.raises(ConfigError, match="sha256"):
        corpus_module.bible_text(tmp_path)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    s = TrainSettings(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert learning_rate(s, 0) == pytest.approx(1e-4)
    assert learning_rate(s, 9) == pytest.approx(1e-3)
    rates = [learning_rate(s, i) for i in range(10, 100)]
    assert rates == sorted(rates, reverse=True)
    assert learning_rate(s, 100) == pytest.approx(1e-4)


def test_unigram_baseline_is_the_smoothed_frequencies():
    train_ids = torch.tensor([3, 3, 3, 4])
    windows = torch.tensor([[0, 3, 4]])
    # add-one over a vocabulary of 5: p(3) = 4/9, p(4) = 2/9
    expected = -(math.log(4 / 9) + math.log(2 / 9)) / 2
    assert unigram_nll(train_ids, windows, vocab_size=5) == pytest.approx(expected)


def test_streams_and_windows():
    stream = token_stream([[5, 6], [7]], bos=1, eos=2)
    assert stream.tolist() == [1, 5, 6, 2, 1, 7, 2]
    assert held_out_windows(stream, 3).tolist() == [[1, 5, 6], [2, 1, 7]]


def test_dictionary_fraction_counts_words_as_written_or_lower_cased():
    dictionary = frozenset({"the", "Lord", "said", "unto"})
    assert dictionary_fraction("The Lord said unto Zxq, 42 times.", dictionary) == pytest.approx(4 / 6)
    assert dictionary_fraction(" 42 ...", dictionary) == 0.0


def _trained(settings: TrainSettings) -> dict[str, torch.Tensor]:
    torch.set_num_threads(settings.threads)
    stream = torch.randint(3, settings.vocab_size, (400,), generator=torch.Generator().manual_seed(5))
    model = build_model(settings)
    curve = train(model, stream, settings, evaluate=lambda: 0.0)
    assert [p["step"] for p in curve] == [2, 4] and "held_out_loss" in curve[-1]
    return model.state_dict()


def test_the_seed_fixes_the_weights():
    first, again, other = _trained(TINY), _trained(TINY), _trained(TINY.with_overrides(seed=1))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def _paragraphs() -> list[str]:
    text = resources.files("amoe").joinpath("model/data/corpus.txt").read_text(encoding="utf-8")
    return [p.replace("\n", " ") for p in text.split("\n\n") if p.strip()]


@pytest.mark.timeout(120)
def test_the_checkpoint_loads_alike_in_transformers_and_amoe(monkeypatch, tmp_path):
    paragraphs = _paragraphs()
    small = Corpus(train=paragraphs[:-2], held_out=paragraphs[-2:])
    monkeypatch.setattr(default_module, "load_corpus", lambda: small)
    out = tmp_path / "model"
    record = default_module.train_default(out, TINY)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "training.json").read_text()) == record
    assert record["held_out_perplexity"] > 1 and record["unigram_perplexity"] > 1
    with pytest.raises(ConfigError, match="not an empty directory"):
        default_module.train_default(out, TINY)

    from amoe import LLM, SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert next(hf.parameters()).dtype == torch.float32
    llm = LLM(model=str(out))
    prompt = llm.tokenizer.encode("The keeper")
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert list(got[0].outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    assert default_module.evaluate_checkpoint(out) == {
        k: record[k] for k in ("held_out_perplexity", "unigram_perplexity")
    }


def test_lambda_fits_recover_the_emulations_skew():
    from amoe.perf.model.routing import hottest_to_mean, popularity_by_rank
    from amoe.train.routing import fit_lambda_hottest, fit_lambda_slope

    for lam in (0.0, 0.08, 0.4):
        assert fit_lambda_hottest(hottest_to_mean(8, 1, lam), 8) == pytest.approx(lam, abs=1e-6)
        shares = popularity_by_rank(8, lam)[[3, 0, 7, 1, 2, 6, 5, 4]]  # by expert id, not by rank
        assert fit_lambda_slope(shares) == pytest.approx(lam, abs=1e-9)


def test_popularity_per_block():
    from amoe.train.routing import popularity

    first = np.array([[30, 10, 10, 10], [10, 10, 10, 10]])
    inclusion = np.array([[40, 30, 20, 10], [20, 20, 20, 20]])
    rows = popularity(first, inclusion, top_k=2)
    assert rows[0]["hottest_to_mean_top1"] == 2.0 and rows[0]["hottest_to_mean_top2"] == 1.6
    assert rows[1]["lambda_hottest"] == 0.0 and rows[1]["first_choice_share"] == [0.25] * 4


def test_replay_and_locality_of_a_trace():
    from amoe.offload.trace import TaskRouting
    from amoe.train.routing import locality_rows, replay_rows

    trace = TaskRouting(num_blocks=4, num_experts=8, top_k=2, support=4, core=2).generate(20, seed=1)
    rows = replay_rows("synthetic", trace, [8, 16])
    assert [r["capacity"] for r in rows] == [8, 16]
    for r in rows:  # Bélády's optimum bounds every policy
        assert all(
            0 <= r[p] <= r["belady"] + 1e-9 for p in ("lru", "lfu", "activation", "activation+history")
        )
    assert rows[1]["belady"] >= rows[0]["belady"]
    assert [r["batch"] for r in locality_rows("synthetic", trace)] == [1, 4, 16]


@pytest.mark.timeout(150)
def test_the_served_routing_is_recorded_per_prompt(tmp_path):
    from amoe.model.make import make_model
    from amoe.offload.trace import read_routing
    from amoe.train.record import record_served

    model = make_model("tiny", tmp_path / "tiny")
    prompts = [[1, 5 + i, 9, 200] for i in range(10)]
    record_served(model, prompts, tmp_path / "routing.jsonl", max_tokens=3)
    trace = read_routing(tmp_path / "routing.jsonl")
    assert len(trace.sequences) == 10
    assert all(len(seq) == 3 for seq in trace.sequences)  # the prefill step, then two decode steps
