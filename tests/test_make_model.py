"""make_model writes deterministic random-weight checkpoints; default_model_path builds the demo model once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amoe.errors import ConfigError
from amoe.model import make
from amoe.model.make import DEMO_MODEL_NAME, default_model_path, make_model
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


def test_default_model_path_is_built_once_under_the_cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(make, "_announced", False)
    monkeypatch.setattr(
        logging.getLogger("amoe"), "propagate", True
    )  # in case setup_logging ran in this process
    path = default_model_path()
    assert path == tmp_path / "amoe" / "models" / DEMO_MODEL_NAME
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    built = path.stat().st_mtime_ns
    assert default_model_path() == path and path.stat().st_mtime_ns == built  # reused, not rebuilt
    assert sum("random-weight demo model" in r.getMessage() for r in caplog.records) == 1  # said once
    assert [p.name for p in path.parent.iterdir()] == [DEMO_MODEL_NAME]  # no temp dirs left behind


def test_default_model_path_is_race_safe(tmp_path):
    # Two processes build at the same time; both must end up with the one complete model.
    code = "from amoe.model.make import default_model_path; print(default_model_path())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    expected = tmp_path / "amoe" / "models" / DEMO_MODEL_NAME
    assert outputs == [str(expected)] * 2
    assert sorted(p.name for p in expected.iterdir()) == sorted(FILES)
    assert [p.name for p in expected.parent.iterdir()] == [DEMO_MODEL_NAME]


def test_losing_the_race_keeps_the_winners_model(monkeypatch, tmp_path):
    # Simulate another process finishing its rename while this one is still building.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = tmp_path / "amoe" / "models" / DEMO_MODEL_NAME
    real_make_model = make.make_model

    def make_model_and_lose(preset, out_dir, seed=0):
        real_make_model(preset, final, seed=seed)
        (final / "winner").touch()
        return real_make_model(preset, out_dir, seed=seed)

    monkeypatch.setattr(make, "make_model", make_model_and_lose)
    assert default_model_path() == final
    assert (final / "winner").exists()
    assert [p.name for p in final.parent.iterdir()] == [DEMO_MODEL_NAME]
