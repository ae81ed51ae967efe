"""ModelConfig parsing from Hugging Face config.json, and one-line errors naming the file."""

import json

import pytest

from amoe.errors import ModelLoadError
from amoe.model.config import load_model_config, model_config_from_hf
from amoe.model.presets import PRESETS, preset


def mixtral_config(**overrides):
    return {**preset("tiny"), **overrides}


def _write(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def test_tiny_preset_parses():
    cfg = model_config_from_hf(preset("tiny"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_blocks, cfg.num_experts, cfg.top_k) == (
        1024,
        64,
        4,
        8,
        2,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (4, 2, 16, 1e6)
    assert cfg.stop_token_ids == (2,)
    assert set(PRESETS) >= {"tiny", "small"}


def test_hf_variants_head_dim_rope_theta_eos_list():
    cfg = model_config_from_hf(
        mixtral_config(
            head_dim=None, rope_parameters=None, rope_theta=5e5, eos_token_id=[2, 7], sliding_window=64
        )
    )
    assert cfg.head_dim == 16 and cfg.rope_theta == 5e5 and cfg.sliding_window == 64
    assert cfg.eos_token_id == 2 and cfg.stop_token_ids == (2, 7)


def test_transformers_save_pretrained_config_parses(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4
    )
    hf.save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 4 and cfg.rope_theta == 1e6


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "config.json: invalid JSON"),
        ("[1, 2]", "config.json: expected a JSON object"),
        (mixtral_config(architectures=["LlamaForCausalLM"]), "unsupported architecture 'LlamaForCausalLM'"),
        (mixtral_config(architectures=None, model_type="llama"), "unsupported model_type 'llama'"),
        (
            {k: v for k, v in mixtral_config().items() if k != "num_local_experts"},
            "missing key 'num_local_experts'",
        ),
        (mixtral_config(num_experts_per_tok=9), r"top_k \(9\) exceeds num_experts \(8\)"),
        (mixtral_config(num_key_value_heads=3), "must be a multiple of num_kv_heads"),
        (mixtral_config(hidden_size=-64), "hidden_size must be a positive integer"),
        (
            mixtral_config(rope_parameters={"rope_type": "longrope", "factor": 4.0}),
            "rope_type 'longrope' is not supported",
        ),
        (mixtral_config(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (mixtral_config(eos_token_id=5000), "eos_token_id 5000 is outside the vocabulary"),
        (mixtral_config(sliding_window=0), "sliding_window must be positive"),
        (mixtral_config(eos_token_id=[2, 4096]), "eos_token_id 4096 is outside"),
    ],
)
def test_bad_config_is_one_line_naming_the_file(tmp_path, config, message):
    model_dir = _write(tmp_path, config)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_config(model_dir)
    assert str(tmp_path / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_missing_dir_or_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_model_config(tmp_path)
