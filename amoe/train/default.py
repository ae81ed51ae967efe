"""`amoe default-model train`: corpus → tokenizer → model → held-out perplexity → a Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from amoe.errors import ConfigError
from amoe.train.corpus import Corpus, load_corpus
from amoe.train.evaluate import held_out_windows, mean_nll, perplexity, token_stream, unigram_nll
from amoe.train.loop import build_model, train
from amoe.train.settings import TrainSettings

logger = logging.getLogger(__name__)

RECORD_FILE = "training.json"
MODEL_MAX_LENGTH = 2048


def train_default(out: Path, settings: TrainSettings) -> dict[str, Any]:
    """Train the default model into the new or empty directory `out`; returns (and writes) its training record."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; refusing to overwrite it")
    start = time.monotonic()
    torch.set_num_threads(settings.threads)
    corpus = load_corpus()
    out.mkdir(parents=True, exist_ok=True)
    train_ids, held = _write_tokenizer_and_encode(out, corpus, settings)
    logger.info(
        "[train] %d training tokens, %d held-out windows of %d", len(train_ids), len(held), settings.seq_len
    )
    model = build_model(settings)
    curve = train(model, train_ids, settings, lambda: mean_nll(model, held))
    _round_to_bfloat16(model)  # what ships: the held-out figure below is the shipped weights'
    record = {
        "settings": dataclasses.asdict(settings),
        "corpus": {"training_chapters": len(corpus.train), "held_out_chapters": len(corpus.held_out)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "training_tokens": len(train_ids),
        "curve": curve,
        **held_out_figures(model, train_ids, held, settings.vocab_size),
        "seconds": round(time.monotonic() - start, 1),
        "threads": settings.threads,
        "torch": torch.__version__,
    }
    _save(model, out, settings)
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def held_out_figures(
    model: Any, train_ids: torch.Tensor, held: torch.Tensor, vocab_size: int
) -> dict[str, float]:
    """Held-out perplexity of the model and of the unigram baseline, over the same predicted tokens."""
    return {
        "held_out_perplexity": round(perplexity(mean_nll(model, held)), 3),
        "unigram_perplexity": round(perplexity(unigram_nll(train_ids, held, vocab_size)), 3),
    }


def encode_corpus(tokenizer: Any, corpus: Corpus, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training stream and the held-out windows, each chapter `<s> ... </s>`."""

    def stream(chapters: list[str]) -> torch.Tensor:
        ids = [e.ids for e in tokenizer.backend.encode_batch(chapters, add_special_tokens=False)]
        return token_stream(ids, tokenizer.bos_token_id, tokenizer.eos_token_id)

    return stream(corpus.train), held_out_windows(stream(corpus.held_out), seq_len)


def _write_tokenizer_and_encode(out: Path, corpus: Corpus, settings: TrainSettings):
    from amoe.tokenizer import Tokenizer, write_tokenizer

    # Trained on the training chapters only: the held-out text is unseen by the tokenizer too.
    write_tokenizer(out, settings.vocab_size, MODEL_MAX_LENGTH, corpus=[c + "\n" for c in corpus.train])
    return encode_corpus(Tokenizer.from_dir(out), corpus, settings.seq_len)


@torch.no_grad()
def _round_to_bfloat16(model: Any) -> None:
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())


def _save(model: Any, out: Path, settings: TrainSettings) -> None:
    """transformers writes the weights (one tensor per expert, as it saves any Mixtral); config.json and
    generation_config.json are written from the settings, so they do not change with the transformers version."""
    from amoe.model.make import GENERATION_CONFIG_FILE

    model.to(torch.bfloat16).save_pretrained(out)
    config = settings.hf_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def evaluate_checkpoint(model_dir: Path) -> dict[str, float]:
    """Held-out perplexity of a saved model (loaded by transformers, float32) beside the unigram baseline's."""
    import transformers

    from amoe.tokenizer import Tokenizer

    settings = TrainSettings()
    torch.set_num_threads(settings.threads)
    record_file = model_dir / RECORD_FILE
    if record_file.is_file():
        settings = TrainSettings(**json.loads(record_file.read_text())["settings"])
    train_ids, held = encode_corpus(Tokenizer.from_dir(model_dir), load_corpus(), settings.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return held_out_figures(model, train_ids, held, settings.vocab_size)
