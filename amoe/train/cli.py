"""`amoe default-model`: train the default model, reprint its held-out perplexity, check a retrained copy against
the shipped one, and measure how much of a server's text is English."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from amoe.errors import ConfigError


def add_default_model_command(sub: Any) -> None:
    p = sub.add_parser("default-model", help="train the default model, evaluate it, check a retrained copy")
    nested = p.add_subparsers(dest="default_model_command", metavar="ACTION", required=True)
    t = nested.add_parser("train", help="train it from a fixed seed on the CPU (about an hour on 2 cores)")
    t.add_argument("--out", required=True, metavar="DIR", help="new or empty directory to write")
    t.add_argument("--steps", type=int, help="training steps (default: the shipped model's)")
    t.add_argument("--seed", type=int, help="seed (default: the shipped model's, 0)")
    t.set_defaults(run=_run_train)
    e = nested.add_parser("eval", help="held-out perplexity of a model beside the unigram baseline's")
    e.add_argument("--model", metavar="DIR", help="model directory (default: the shipped default model)")
    e.set_defaults(run=_run_eval)
    c = nested.add_parser("compare", help="greedy output on five fixed prompts against the shipped model's")
    c.add_argument("--model", required=True, metavar="DIR", help="the retrained model")
    c.add_argument("--reference", metavar="DIR", help="default: the shipped default model")
    c.set_defaults(run=_run_compare)
    w = nested.add_parser("words", help="share of dictionary words in a server's greedy completion")
    w.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    w.add_argument("--prompt", default="Once upon a time")
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--min-fraction", type=float, default=0.9, help="exit 1 below this share (default: 0.9)")
    w.set_defaults(run=_run_words)
    r = nested.add_parser(
        "routing", help="its routing on held-out text, recorded while serving, and replayed"
    )
    r.add_argument("--model", metavar="DIR", help="default: the shipped default model")
    r.add_argument("--out", required=True, metavar="DIR", help="where routing.json (and the trace) go")
    r.add_argument("--prompts", type=int, default=96, help="held-out prompts served (default: 96)")
    r.set_defaults(run=_run_routing)


def _run_train(args: argparse.Namespace) -> int:
    from amoe.train.default import train_default
    from amoe.train.settings import TrainSettings

    settings = TrainSettings().with_overrides(steps=args.steps, seed=args.seed)
    record = train_default(Path(args.out), settings)
    _print_figures(record)
    print(json.dumps({k: v for k, v in record.items() if k not in ("curve", "settings")}))
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    from amoe.train.default import evaluate_checkpoint

    figures = evaluate_checkpoint(_model_or_default(args.model))
    _print_figures(figures)
    print(json.dumps(figures))
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from amoe.train.compare import compare

    rows = compare(Path(args.model), _model_or_default(args.reference))
    for row in rows:
        print(f"{'equal' if row['equal'] else 'DIFFERENT':9s} {row['prompt']!r} -> {row['text']!r}")
        if not row["equal"]:
            print(f"{'':9s} reference:  {row['reference']!r}")
    equal = sum(r["equal"] for r in rows)
    print(json.dumps({"prompts": len(rows), "equal": equal}))
    return 0 if equal == len(rows) else 1


def _run_words(args: argparse.Namespace) -> int:
    from amoe.train.words import dictionary_fraction, load_dictionary, served_completion, words

    dictionary = load_dictionary()
    text = served_completion(args.base_url, args.prompt, args.max_tokens)
    fraction = dictionary_fraction(text, dictionary)
    print(f"{args.prompt}{text}")
    print(
        json.dumps(
            {"prompt": args.prompt, "words": len(words(text)), "dictionary_fraction": round(fraction, 4)}
        )
    )
    return 0 if fraction >= args.min_fraction else 1


def _run_routing(args: argparse.Namespace) -> int:
    from amoe.train.study import routing_study

    figures = routing_study(_model_or_default(args.model), Path(args.out), num_prompts=args.prompts)
    print("block  hottest/mean top-1  top-2  lambda (hottest)  lambda (slope)")
    for b in figures["blocks"]:
        print(
            f"{b['block']:5d}  {b['hottest_to_mean_top1']:18.3f}  {b['hottest_to_mean_top2']:5.3f}"
            f"  {b['lambda_hottest']:16.4f}  {b['lambda_slope']:14.4f}"
        )
    print("trace       batch  activated  reused")
    for row in figures["locality"]:
        print(f"{row['trace']:10s}  {row['batch']:5d}  {row['activated']:9.3f}  {row['reused']:6.3f}")
    print("trace       capacity  lru     lfu     activation  +history  belady")
    for row in figures["replay"]:
        print(
            f"{row['trace']:10s}  {row['capacity']:8d}  {row['lru']:.4f}  {row['lfu']:.4f}  "
            f"{row['activation']:.4f}      {row['activation+history']:.4f}    {row['belady']:.4f}"
        )
    summary = {
        k: figures[k] for k in ("model", "held_out_tokens", "lambda_hottest_median", "lambda_slope_median")
    }
    print(json.dumps({**summary, "replay": figures["replay"]}))
    return 0


def _print_figures(figures: dict[str, Any]) -> None:
    print(
        f"held-out perplexity {figures['held_out_perplexity']:.2f} "
        f"(unigram baseline {figures['unigram_perplexity']:.2f}, same tokens)"
    )


def _model_or_default(path: str | None) -> Path:
    if path is not None:
        return Path(path)
    from amoe.model.make import default_model_path

    found = default_model_path()
    if not found.is_dir():
        raise ConfigError(f"{found}: the default model is missing")
    return found
