"""make_model writes deterministic random-weight checkpoints of the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amoe.errors import ConfigError
from amoe.model.make import make_model
from amoe.tokenizer import Tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _contents(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_writes_a_complete_checkpoint(tiny):
    assert sorted(p.name for p in tiny.iterdir()) == sorted(FILES)
    config = json.loads((tiny / "config.json").read_text())
    tok = Tokenizer.from_dir(tiny)
    assert tok.vocab_size <= config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_same_seed_same_bytes(tiny, tmp_path):
    assert _contents(make_model("tiny", tmp_path / "again", seed=0)) == _contents(tiny)


def test_different_seed_different_weights(tiny, tmp_path):
    other = _contents(make_model("tiny", tmp_path / "other", seed=1))
    first = _contents(tiny)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_overrides_reach_config_and_tokenizer(tmp_path):
    out = make_model("tiny", tmp_path / "m", overrides={"vocab_size": 512, "num_hidden_layers": 1})
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"]) == (512, 1)
    assert Tokenizer.from_dir(out).vocab_size == 512


def test_bad_input_is_a_config_error(tiny, tmp_path):
    with pytest.raises(ConfigError, match="preset"):
        make_model("huge", tmp_path / "a")
    with pytest.raises(ConfigError, match="not an empty directory"):
        make_model("tiny", tiny)
    with pytest.raises(ConfigError, match="vocab_size"):
        make_model("tiny", tmp_path / "b", overrides={"vocab_size": 100})
