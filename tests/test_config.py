"""The config object: validation with clear messages, files, and CLI flags generated from it."""

import argparse
import dataclasses
import json

import pytest

from amoe.config import (
    DEFAULT_POLICY,
    AmoeConfig,
    EmulationSection,
    ExecutorSection,
    add_config_flags,
    command_flags,
    config_from_args,
)
from amoe.errors import ConfigError


def parse(argv: list[str]) -> AmoeConfig:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_are_valid_and_frozen():
    config = AmoeConfig()
    assert config.parallel.mode == "aep"
    with pytest.raises(AttributeError):
        config.cache.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"scheduler": {"policy": "random"}}, "scheduler.policy must be one of"),
        ({"cache": {"block_size": 0}}, "cache.block_size must be positive"),
        ({"scheduler": {"decay": 1.5}}, r"scheduler.decay must be in \[0, 1\]"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"cache": {"blocks": 3}}, "unknown setting cache.blocks"),
        ({"caches": {}}, "unknown config section"),
        ({"scheduler": {"policy": "wave"}}, "scheduler.policy wave is retired: use waves"),
        ({"plan": "the best"}, "'plan' block must be an object"),
        (
            {"executor": {"gpu": "h100"}, "emulation": {"gpu": "h200"}},
            "executor.gpu and emulation.gpu both given",
        ),
    ],
)
def test_bad_values_name_the_setting(sections, message):
    with pytest.raises(ConfigError, match=message):
        AmoeConfig.from_dict(sections)


def test_file_then_flags_override(tmp_path):
    path = tmp_path / "amoe.json"
    path.write_text(
        json.dumps({"parallel": {"attn_ranks": 2, "expert_ranks": 3}, "scheduler": {"policy": "mtfs"}})
    )
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--config", str(path), "--expert-ranks", "4", "--scheduler-decay", "0.25"])
    config = config_from_args(args)
    assert (config.parallel.attn_ranks, config.parallel.expert_ranks) == (2, 4)
    assert config.scheduler.policy == "mtfs"
    assert config.scheduler.decay == 0.25


def test_unreadable_or_invalid_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        AmoeConfig.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        AmoeConfig.from_file(bad)


def test_the_emulation_checks_the_emulation_sections_profiles_and_routing():
    from amoe.perf.model.check import check_emulation

    config = AmoeConfig.from_dict(
        {"executor": {"kind": "emulated"}, "emulation": {"gpu": "h100", "routing": "skew-exp:0.4"}}
    )
    check_emulation(config.emulation)
    assert config.emulation.gpu == "h100"
    with pytest.raises(ConfigError, match="no router weights"):
        check_emulation(AmoeConfig.from_dict({"emulation": {"routing": "model"}}).emulation)
    check_emulation(AmoeConfig().emulation, emulated=False)  # torch routes by the router's weights
    with pytest.raises(ConfigError, match="unknown GPU"):
        check_emulation(AmoeConfig.from_dict({"emulation": {"gpu": "v100"}}).emulation)
    with pytest.raises(ConfigError, match="executor.kind"):
        AmoeConfig.from_dict({"executor": {"kind": "tpu"}})


def test_one_default_policy():
    """`amoe serve`, `amoe plan` and the studies take one default (amoe.config.DEFAULT_POLICY): waves."""
    assert DEFAULT_POLICY == "waves" and AmoeConfig().scheduler.policy == DEFAULT_POLICY


EMULATION_FLAGS = [
    # (every spelling users have seen, the field it sets, the flag's text, the value)
    (("--gpu", "--emulation-gpu", "--executor-gpu"), "gpu", "h100", "h100"),
    (("--expert-gpu", "--emulation-expert-gpu", "--executor-expert-gpu"), "expert_gpu", "h100", "h100"),
    (("--executor-profile", "--emulation-profile"), "profile", "mixtral-8x7b-mqa", "mixtral-8x7b-mqa"),
    (("--executor-top-k", "--emulation-top-k"), "top_k", "2", 2),
    (("--time-scale", "--emulation-time-scale", "--executor-time-scale"), "time_scale", "2.5", 2.5),
    (("--routing", "--emulation-routing", "--executor-routing"), "routing", "uniform", "uniform"),
    (("--executor-seed", "--emulation-seed"), "seed", "7", 7),
    (("--executor-host-overhead", "--emulation-host-overhead"), "host_overhead", "none", "none"),
    (("--executor-decode-only", "--emulation-decode-only"), "decode_only", "true", True),
    (("--executor-gpus-per-node", "--emulation-gpus-per-node"), "gpus_per_node", "4", 4),
    (
        ("--step-variance", "--emulation-step-variance", "--executor-step-variance"),
        "step_variance",
        "off",
        "off",
    ),
]


@pytest.mark.parametrize(("flags", "name", "text", "value"), EMULATION_FLAGS)
def test_every_spelling_of_an_emulation_flag_sets_the_emulation_section(flags, name, text, value):
    for flag in flags:
        config = parse(["--executor", "emulated", "--parallel", "pingpong", flag, text])
        assert config.emulation == dataclasses.replace(EmulationSection(), **{name: value}), flag
        assert config.executor == ExecutorSection("emulated")


def test_every_emulation_field_keeps_its_former_flag():
    assert {f.name for f in dataclasses.fields(EmulationSection)} == {
        name for _, name, _, _ in EMULATION_FLAGS
    }
    for flags, name, _, _ in EMULATION_FLAGS:
        assert "--executor-" + name.replace("_", "-") in flags


def test_a_file_with_the_former_executor_keys_is_read_with_one_log_line(tmp_path, caplog):
    path = tmp_path / "old.json"
    old = {"kind": "emulated", "gpu": "h100", "routing": "uniform", "time_scale": 3.0, "decode_only": True}
    path.write_text(json.dumps({"executor": old}))
    with caplog.at_level("INFO", logger="amoe.config"):
        config = AmoeConfig.from_file(path)
    assert config.executor == ExecutorSection("emulated")
    assert config.emulation == EmulationSection(
        gpu="h100", routing="uniform", time_scale=3.0, decode_only=True
    )
    moved = [r.getMessage() for r in caplog.records if "their section now" in r.getMessage()]
    assert len(moved) == 1 and "executor.gpu" in moved[0] and "emulation.gpu" in moved[0]


def test_a_plan_block_is_logged_not_a_setting(caplog):
    with caplog.at_level("INFO", logger="amoe.config"):
        config = AmoeConfig.from_dict(
            {"plan": {"summary": "aep 2x h100 attn"}, "parallel": {"attn_ranks": 2}}
        )
    assert config == AmoeConfig().replace(parallel={"attn_ranks": 2})
    assert [r.getMessage() for r in caplog.records] == ["[config] planned by amoe plan: aep 2x h100 attn"]
    with pytest.raises(ConfigError, match="unknown config section 'plans'"):
        AmoeConfig.from_dict({"plans": {}})  # no other unknown key is let through


def test_changes_and_command_flags_read_back_to_the_config(tmp_path):
    config = AmoeConfig().replace(
        parallel={"mode": "pingpong", "attn_ranks": 3, "expert_map": "0,1,1"},
        scheduler={"policy": "defrag", "decay": 0.25},
        executor={"kind": "emulated"},
        emulation={"gpu": "h100", "routing": "skew-exp:0.08", "decode_only": True, "time_scale": 40.0},
        cache={"max_num_seqs": 1000000},
    )
    assert AmoeConfig().changes() == {}
    path = tmp_path / "short.json"
    path.write_text(json.dumps(config.changes()))
    assert AmoeConfig.from_file(path) == config
    flags = command_flags(config)
    assert flags[:2] == ["--max-num-seqs", "1000000"] and "--scheduler" in flags and "--gpu" in flags
    assert parse(flags) == config
