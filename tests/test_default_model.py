"""The shipped default model: a small Mixtral that `amoe serve` serves without --model, that writes English, and
whose greedy tokens are transformers' in every mode."""

from __future__ import annotations

import json

import pytest
import torch
from factories import CheckedServer, hf_greedy, reference_tokens

from amoe import LLM, SamplingParams
from amoe.model.config import load_model_config
from amoe.model.make import default_model_path
from amoe.tokenizer import Tokenizer
from amoe.train.words import DICTIONARY, dictionary_fraction, load_dictionary

transformers = pytest.importorskip("transformers")

MAX_BYTES = 24 * 2**20  # the checkpoint travels with the repository
PROMPTS = ("Once upon a time", "And the king said unto", "The expert said")
NEW_TOKENS = 4
needs_dictionary = pytest.mark.skipif(not DICTIONARY.is_file(), reason="needs Debian's wamerican word list")


@pytest.fixture(scope="module")
def model_dir():
    return default_model_path()


@pytest.fixture(scope="module")
def prompts_and_hf(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return prompts, [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]


def test_the_shipped_checkpoint_is_a_small_mixtral(model_dir):
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    assert size <= MAX_BYTES, f"{size} bytes"
    cfg = load_model_config(model_dir)
    assert (cfg.num_experts, cfg.top_k) == (8, 2) and cfg.num_blocks >= 4
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.chat_template and tokenizer.vocab_size <= cfg.vocab_size
    record = json.loads((model_dir / "training.json").read_text())
    assert record["held_out_perplexity"] < record["unigram_perplexity"] / 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["local", "aep", "ep", "pingpong"])
def test_greedy_tokens_equal_transformers_in_every_mode(model_dir, prompts_and_hf, mode):
    from amoe.runtime.sync.group import SyncCluster
    from amoe.testing.inproc import InProcessCluster

    prompts, expected = prompts_and_hf
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if mode == "local":
        got = reference_tokens(model_dir, prompts, params)
    elif mode == "aep":
        with InProcessCluster(model_dir, num_attn_ranks=2, num_expert_ranks=3) as cluster:
            got = cluster.generate(prompts, params, timeout=60)
    else:
        shape = {"num_devices": 2} if mode == "ep" else {"num_attn": 1, "num_expert": 2, "micro_batches": 2}
        with SyncCluster(model_dir, mode=mode, **shape) as cluster:
            got = cluster.generate(prompts, params, timeout=60)
    assert got == expected


@needs_dictionary
def test_once_upon_a_time_is_english_offline():
    out = LLM().generate("Once upon a time", SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert dictionary_fraction(out.text, load_dictionary()) >= 0.9, out.text


@needs_dictionary
@pytest.mark.timeout(150)
def test_the_served_default_model_writes_english(capsys):
    """What a newcomer does first: `amoe serve` without --model, then the README's prompt."""
    from amoe.cli import main

    with CheckedServer() as url:
        code = main(["default-model", "words", "--base-url", url, "--prompt", "Once upon a time"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["dictionary_fraction"] >= 0.9 and result["words"] >= 20, result


def test_the_shipped_tokenizer_config_is_what_training_writes_today():
    """The chat template travels in tokenizer_config.json: a template change must reach the shipped model too
    (training writes it fresh, so a stale shipped copy would differ from a retrained model's)."""
    from amoe.model.make import DEFAULT_MODEL_DIR
    from amoe.tokenizer import CONFIG_FILE, _tokenizer_config

    shipped = json.loads((DEFAULT_MODEL_DIR / CONFIG_FILE).read_text())
    assert shipped == _tokenizer_config(shipped["model_max_length"])
