"""The `amoe` command. One small `add_*_command` function per subcommand, listed in SUBCOMMANDS.

User mistakes (argparse errors, every AmoeError) print one line on stderr and exit non-zero; anything else is a bug
and keeps its traceback. Heavy imports happen inside the run functions so that `amoe --help` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from amoe import __version__
from amoe.errors import AmoeError, ConfigError, RequestError
from amoe.log import setup_logging
from amoe.offload.cli import add_offload_command
from amoe.queue_viewer import add_queues_command  # light: its heavy imports are in its run function
from amoe.scale_cli import add_scale_command
from amoe.train.cli import add_default_model_command

logger = logging.getLogger(__name__)

EXIT_USER_ERROR = 1
EXIT_USAGE = 2  # what argparse uses
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line like every other user mistake; `--help` still shows the full usage.
        self.exit(EXIT_USAGE, f"amoe: error: {message} (see '{self.prog} --help')\n")


def add_make_model_command(sub: Any) -> None:
    from amoe.model.presets import PRESETS

    p = sub.add_parser(
        "make-model", help="write a random-weight model in the Hugging Face format (any supported family)"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    p.add_argument("--out", required=True, metavar="DIR", help="new or empty directory to write")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files (default: 1)")
    p.set_defaults(run=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    from amoe.model.make import make_model

    out = make_model(args.preset, args.out, seed=args.seed, shards=args.shards)
    print(out)
    return 0


def add_generate_command(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text offline, in this process")
    p.add_argument("--model", metavar="PATH", help="model directory (default: the shipped default model)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    p.add_argument("--max-tokens", type=int, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, help="0 is greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument(
        "--generation-config", default="auto", metavar="auto|vllm|DIR",
        help="where unset sampling flags take their defaults from, as vLLM's (default: auto, the model's own)",
    )  # fmt: skip
    p.add_argument(
        "--parallel", default="local", help="local (one engine) | ep: --attn-ranks devices in this process"
    )
    p.add_argument("--attn-ranks", type=int, default=2, help="ep: the devices (default: 2)")
    p.add_argument("--ep-pipelines", help="ep: EPS-MoE's expert pipeline, N | auto (docs/serve.md)")
    p.add_argument("--ep-kernel", help="ep: auto | grouped | dense")
    from amoe.config import add_config_flags

    add_config_flags(p, ("offload",))  # --offload-budget SIZE, --offload-policy, ... as `amoe serve` has them
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from amoe.config import config_from_args
    from amoe.llm import LLM

    flags = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    given = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    offload = config_from_args(args).offload
    if args.parallel != "local" or args.ep_pipelines is not None or args.ep_kernel is not None:
        return _generate_ep(args, given, offload)
    options = {f"offload_{name}": value for name, value in vars(offload).items()}
    # model None: the shipped default model
    llm = LLM(model=args.model, generation_config=args.generation_config, **options)
    params = dataclasses.replace(llm.get_default_sampling_params(), **given)
    prompts = _chat_prompts(llm, args.prompt) if args.chat else args.prompt
    results = llm.generate(prompts, params)
    for prompt, result in zip(args.prompt, results):
        if len(args.prompt) > 1:
            print(f"--- {prompt!r}")
        print(result.outputs[0].text)
    return 0


def _generate_ep(args: argparse.Namespace, given: dict[str, Any], offload: Any) -> int:
    """`amoe generate --parallel ep`: the EP devices as threads of this process (amoe.runtime.sync.group), with
    the expert pipeline when asked; greedy tokens are the local engine's."""
    from amoe.config import AmoeConfig
    from amoe.generation_config import sampling_defaults
    from amoe.model.config import load_model_config
    from amoe.model.make import default_model_path
    from amoe.runtime import build
    from amoe.runtime.sync.group import SyncCluster
    from amoe.sampling_params import SamplingParams
    from amoe.tokenizer import Tokenizer

    if args.chat:
        raise ConfigError("--chat runs on the local engine; drop --parallel ep")
    parallel = {"mode": args.parallel, "attn_ranks": args.attn_ranks}
    parallel |= {k: getattr(args, k) for k in ("ep_pipelines", "ep_kernel") if getattr(args, k) is not None}
    config = AmoeConfig().replace(parallel=parallel, offload=vars(offload))  # a budget with ep is refused
    if config.parallel.mode != "ep":
        raise ConfigError(f"generate runs --parallel local or ep; got --parallel {config.parallel.mode}")
    model_dir = args.model or default_model_path()
    params = SamplingParams(**{**sampling_defaults(model_dir, args.generation_config), **given})
    cfg = load_model_config(model_dir)
    pipeline = build.ep_pipeline(config, build.placement(config, cfg.num_expert_ids), cfg, None)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.encode(p) for p in args.prompt]
    with SyncCluster(model_dir, mode="ep", num_devices=args.attn_ranks, pipeline=pipeline) as cluster:
        outputs = cluster.generate(prompts, params)
    for prompt, tokens in zip(args.prompt, outputs):
        if len(args.prompt) > 1:
            print(f"--- {prompt!r}")
        print(tokenizer.decode(tokens))
    return 0


def _chat_prompts(llm: Any, prompts: list[str]) -> list[list[int]]:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise RequestError(f"{llm.model_dir} has no tokenizer, which --chat needs")
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def add_serve_command(sub: Any) -> None:
    from amoe.config import add_config_flags

    p = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API")
    vllm = add_config_flags(p)
    vllm.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model directory (as --model; `vllm serve MODEL`)"
    )
    vllm.add_argument(
        "--headless",
        action="store_true",
        help="a node agent (what --node-rank R >= 1 runs anyway): this node's runtimes only",
    )
    vllm.add_argument(
        "--tensor-parallel-size", "-tp", type=int, metavar="N",
        help="1 only: amoe spreads a model by its experts (--attn-ranks, --expert-ranks), not by sharding tensors",
    )  # fmt: skip
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from amoe.config import config_from_args
    from amoe.serve import main as serve_main

    _vllm_positionals(args)
    return serve_main(config_from_args(args), headless=args.headless)


def _vllm_positionals(args: argparse.Namespace) -> None:
    """`amoe serve MODEL` as `vllm serve MODEL`; vLLM's tensor parallelism has no counterpart beyond 1."""
    if args.model_tag is not None:
        if args.model__path is not None and args.model__path != args.model_tag:
            raise ConfigError(
                f"the model is given twice: {args.model_tag!r} and --model {args.model__path!r}"
            )
        args.model__path = args.model_tag
    if args.tensor_parallel_size not in (None, 1):
        raise ConfigError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: amoe does not shard tensors; it spreads a model "
            "over devices by its experts: --attn-ranks A --expert-ranks E (aep, pingpong) or --parallel ep "
            "--attn-ranks N (docs/serve.md)"
        )


def add_bench_and_plan_commands(sub: Any) -> None:
    """`amoe bench` (the load generator's `serve`, then the studies) and `amoe plan`: the modelling wing's commands
    all come from amoe.perf.studies.commands.add_commands, which builds parsers only (no torch)."""
    from amoe.bench import BENCH_SUBCOMMANDS
    from amoe.perf.studies.commands import add_commands

    p = sub.add_parser("bench", help="benchmark a running server, or the planner's plans on emulated GPUs")
    nested = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    # The nested commands get the same common flags (-v) as the top-level ones.
    bench = _WithParents(nested, sub._parents)
    for add_bench_subcommand in BENCH_SUBCOMMANDS:
        add_bench_subcommand(bench)
    add_commands(sub, bench)


SUBCOMMANDS = (
    add_serve_command,
    add_make_model_command,
    add_generate_command,
    add_bench_and_plan_commands,
    add_queues_command,
    add_scale_command,
    add_offload_command,
    add_default_model_command,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand in SUBCOMMANDS."""
    parser = _Parser(
        prog="amoe", description="Serve Mixture-of-Experts models with asynchronous expert parallelism."
    )
    parser.add_argument("--version", action="version", version=f"amoe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    # -v also after the subcommand; SUPPRESS keeps the subparser from resetting a -v given before it.
    common = _Parser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in SUBCOMMANDS:
        add_command(_WithParents(sub, [common]))
    return parser


class _WithParents:
    """Lets each add_*_command call plain `sub.add_parser(name, help=...)` and still get the common flags."""

    def __init__(self, sub: Any, parents: list[argparse.ArgumentParser]) -> None:
        self._sub = sub
        self._parents = parents

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("description", kwargs.get("help"))
        return self._sub.add_parser(name, parents=self._parents, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `amoe` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        setup_logging(verbose=args.verbose)
        return args.run(args) or 0
    except AmoeError as e:
        print(f"amoe: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("amoe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
