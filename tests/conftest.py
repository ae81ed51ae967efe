"""Shared factories: small Mixtral configs and random-weight checkpoints written once per session."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from amoe.model.checkpoint import write_random_checkpoint
from amoe.model.presets import preset

# The tests' own torch work (references, in-process engines, transformers) on one intra-op thread, as each runtime
# process runs (--threads-per-rank 1): the tiny models' ops are far too small to gain from a second thread, and on
# a 2-core host shared with runtimes or another job, two OpenMP threads waiting on each other made a 32-token
# generate 60x slower (18 s against 0.3 s beside a busy host). The processes the tests start (`amoe generate`,
# `--parallel local` servers) inherit it; runtimes set theirs from --threads-per-rank either way.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def mixtral_config(**overrides: Any) -> dict[str, Any]:
    """The tiny preset's Hugging Face config dict with some fields changed."""
    return {**preset("tiny"), **overrides}


class CheckpointFactory:
    """Writes random-weight checkpoints under one session temp dir, reusing identical ones."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, Path] = {}

    def __call__(self, seed: int = 0, shards: int = 1, **overrides: Any) -> Path:
        hf_config = mixtral_config(**overrides)
        key = json.dumps([hf_config, seed, shards], sort_keys=True)
        if key not in self._made:
            out = self.root / f"ckpt{len(self._made)}"
            self._made[key] = write_random_checkpoint(hf_config, out, seed=seed, shards=shards)
        return self._made[key]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """make_checkpoint(seed=0, shards=1, **hf_config_overrides) → a checkpoint dir (tiny preset by default)."""
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: CheckpointFactory) -> Path:
    return make_checkpoint()


@pytest.fixture(autouse=True)
def _restore_amoe_logging():
    """Tests that run the CLI in-process call setup_logging; put amoe's loggers back so caplog sees records once."""
    loggers = [logging.getLogger(name) for name in ("amoe", "coordinator")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
