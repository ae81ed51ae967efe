"""Does a retrained model say what the shipped one says? Greedy continuations of five fixed prompts, compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS = (
    "Once upon a time",
    "In the beginning",
    "And the king said unto",
    "The expert said",
    "Blessed are they that",
)
MAX_TOKENS = 32


def greedy_outputs(
    model_dir: Path, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[Any]:
    """Each prompt's greedy token ids and text from amoe's reference engine (float32 on the CPU)."""
    from amoe.llm import LLM
    from amoe.sampling_params import SamplingParams

    llm = LLM(model=str(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0] for r in llm.generate(list(prompts), params)]


def compare(model_dir: Path, reference_dir: Path) -> list[dict[str, Any]]:
    """Per prompt: both models' greedy texts and whether their token ids are equal."""
    ours, theirs = greedy_outputs(model_dir), greedy_outputs(reference_dir)
    return [
        {"prompt": p, "equal": list(a.token_ids) == list(b.token_ids), "text": a.text, "reference": b.text}
        for p, a, b in zip(PROMPTS, ours, theirs)
    ]
