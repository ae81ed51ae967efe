"""The training loop: random windows of the token stream drawn from the seed, AdamW, warm-up then cosine decay."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from amoe.train.settings import TrainSettings

logger = logging.getLogger(__name__)


def build_model(settings: TrainSettings) -> Any:
    """transformers' Mixtral with the settings' shape, initialised from the seed (its own initialiser)."""
    import transformers

    config = {**settings.hf_config(), "output_router_logits": True, "dtype": "float32"}
    config.pop("architectures")
    config.pop("model_type")
    torch.manual_seed(settings.seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**config, attn_implementation="sdpa"))


def learning_rate(settings: TrainSettings, step: int) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    done = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def train(
    model: Any, stream: torch.Tensor, settings: TrainSettings, evaluate: Callable[[], float]
) -> list[dict[str, float]]:
    """Train `model` in place on windows of `stream` (a 1-D token tensor); returns the loss curve, one point per
    log_every steps (mean training loss) with the held-out loss `evaluate` gives every eval_every steps."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    curve, losses, start = [], [], time.monotonic()
    model.train()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        batch = _windows(stream, settings, gen)  # [batch, seq_len]
        out = model(input_ids=batch, labels=batch)  # labels are shifted inside; loss includes the router's
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
            curve.append(_point(model, step, losses, settings, evaluate, time.monotonic() - start))
            losses = []
    model.eval()
    return curve


def _windows(stream: torch.Tensor, settings: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - settings.seq_len, (settings.batch_size,), generator=gen)
    return torch.stack([stream[s : s + settings.seq_len] for s in starts.tolist()])


def _point(model, step, losses, settings, evaluate, elapsed) -> dict[str, float]:
    point = {
        "step": step + 1,
        "train_loss": round(sum(losses) / len(losses), 4),
        "seconds": round(elapsed, 1),
    }
    if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
        model.eval()
        point["held_out_loss"] = round(evaluate(), 4)
        model.train()
    logger.info("[train] %s", point)
    return point
