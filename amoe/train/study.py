"""`amoe default-model routing`: the default model's routing on held-out text, recorded by the real server and
replayed under the offloading policies beside synthetic traces of its shape; one JSON file of figures."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amoe.errors import ConfigError
from amoe.train import routing
from amoe.train.corpus import load_corpus
from amoe.train.default import RECORD_FILE, encode_corpus
from amoe.train.record import record_served
from amoe.train.settings import TrainSettings

logger = logging.getLogger(__name__)

TRACE_FILE = "routing.jsonl"
FIGURES_FILE = "routing.json"


def routing_study(
    model_dir: Path, out: Path, num_prompts: int = 96, prompt_tokens: int = 32, max_tokens: int = 32
) -> dict[str, Any]:
    """Popularity and λ per block on the held-out windows; a trace recorded while serving held-out prompts (kept
    if `out` has one); its replay and locality beside the synthetic model's. Writes out/routing.json."""
    import transformers

    from amoe.offload.trace import read_routing
    from amoe.tokenizer import Tokenizer

    settings = TrainSettings(**json.loads((model_dir / RECORD_FILE).read_text())["settings"])
    torch.set_num_threads(settings.threads)
    corpus, tokenizer = load_corpus(), Tokenizer.from_dir(model_dir)
    _, held = encode_corpus(tokenizer, corpus, settings.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first, inclusion = routing.router_counts(model, held, settings.top_k)
    blocks = routing.popularity(first, inclusion, settings.top_k)
    out.mkdir(parents=True, exist_ok=True)
    trace_file = out / TRACE_FILE
    if not trace_file.is_file():
        prompts = routing.held_out_prompts(tokenizer, corpus.held_out, num_prompts, prompt_tokens)
        logger.info("[train] recording the routing of %d held-out prompts while serving", len(prompts))
        record_served(model_dir, prompts, trace_file, max_tokens)
    real = read_routing(trace_file)
    if len(real.sequences) < 16:
        raise ConfigError(f"{trace_file}: {len(real.sequences)} sequences; the replay needs at least 16")
    synthetic = routing.synthetic_like(real, settings.top_k, prompt_tokens, max_tokens)
    total = real.num_blocks * real.num_experts
    # From what one decode step touches (blocks × top_k experts) up to three quarters of all experts.
    step = real.num_blocks * settings.top_k
    capacities = sorted({step, 3 * total // 8, total // 2, 3 * total // 4})
    figures = {
        "model": model_dir.name,
        "held_out_tokens": int(first[0].sum()),
        "blocks": blocks,
        "lambda_hottest_median": round(float(np.median([b["lambda_hottest"] for b in blocks])), 4),
        "lambda_slope_median": round(float(np.median([b["lambda_slope"] for b in blocks])), 4),
        "trace": {"sequences": len(real.sequences), "prompt_tokens": prompt_tokens, "max_tokens": max_tokens},
        "locality": routing.locality_rows("recorded", real) + routing.locality_rows("synthetic", synthetic),
        "replay": routing.replay_rows("recorded", real, capacities)
        + routing.replay_rows("synthetic", synthetic, capacities),
    }
    (out / FIGURES_FILE).write_text(json.dumps(figures, indent=1) + "\n")
    return figures
