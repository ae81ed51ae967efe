"""Plain helpers shared by tests (fixtures live in conftest.py): prompts and the reference engine's tokens."""

from __future__ import annotations

from pathlib import Path

import torch


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    """Token-id prompts of the given lengths, each starting with BOS (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


def reference_tokens(checkpoint: Path, prompts: list[list[int]], params) -> list[list[int]]:
    """What the single-process reference engine generates for each prompt, all batched together."""
    from amoe.engine.config import EngineConfig
    from amoe.engine.local import LocalEngine

    engine = LocalEngine(checkpoint, EngineConfig())
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]
