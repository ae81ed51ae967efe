"""The config object: validation with clear messages, files, and CLI flags generated from it."""

import argparse
import json

import pytest

from amoe.config import AmoeConfig, add_config_flags, config_from_args
from amoe.errors import ConfigError


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


def test_the_emulation_checks_the_executor_sections_profiles_and_routing():
    from amoe.perf.model.check import check_executor

    config = AmoeConfig.from_dict(
        {"executor": {"kind": "emulated", "gpu": "h100", "routing": "skew-exp:0.4"}}
    )
    check_executor(config.executor)
    assert config.executor.gpu == "h100"
    with pytest.raises(ConfigError, match="no router weights"):
        check_executor(AmoeConfig.from_dict({"executor": {"kind": "emulated", "routing": "model"}}).executor)
    with pytest.raises(ConfigError, match="unknown GPU"):
        check_executor(AmoeConfig.from_dict({"executor": {"gpu": "v100"}}).executor)
    with pytest.raises(ConfigError, match="executor.kind"):
        AmoeConfig.from_dict({"executor": {"kind": "tpu"}})
