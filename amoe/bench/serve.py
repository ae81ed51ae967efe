"""`amoe bench serve`: load-test any OpenAI-compatible server and report serving metrics like `vllm bench serve`.

Requests from a workload are sent at seeded Poisson (or gamma) arrival times, optionally capped at a number in
flight, each streamed and timed by the client; the run ends when every request has completed or failed. The table
and one JSON line go to stdout, logs and the progress bar to stderr. Heavy modules are imported when the command
runs, so that `amoe --help` stays quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from amoe.errors import ConfigError

if TYPE_CHECKING:
    from amoe.bench.client import BenchClient, RequestResult
    from amoe.bench.workloads import RequestSpec

logger = logging.getLogger(__name__)

PROMPT_FORMAT_CHOICES = ("auto", "ids", "text")
_PROBE_IDS = [
    11,
    12,
    13,
    14,
]  # inside every vocabulary the workloads assume (see workloads._DEFAULT_ID_RANGE)
_PROBE_TEXT = "Hello, how are you"


def add_bench_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (amoe, vLLM, SGLang)")
    p.add_argument(
        "--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)"
    )
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument(
        "--workload",
        default="short",
        metavar="NAME",
        help="short | medium | reasonable (the AMoE paper's §5), random, or sharegpt:PATH (default: short)",
    )
    p.add_argument(
        "--input-len", type=int, default=1024, help="random workload: prompt tokens (default: 1024)"
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="random workload: output tokens (default: 128)"
    )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random workload: lengths uniform in L·[1−r, 1+r] (default: 0)",
    )
    p.add_argument("--num-requests", type=int, default=100, help="requests to send (default: 100)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean requests per second; inf sends all at once (default)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrivals: 1 is Poisson, <1 burstier, >1 more even (default: 1)",
    )
    p.add_argument(
        "--max-concurrency", type=int, help="at most this many requests in flight (default: no limit)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the workload (default: 0)")
    p.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMAT_CHOICES,
        default="auto",
        help="send prompts as token ids or text; auto tries ids with a test request first (default: auto)",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="a tokenizer.json directory: exact text lengths and id range"
    )
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a request counts as failed (300)"
    )
    p.add_argument("--result-file", metavar="PATH", help="also write the JSON result here")
    p.set_defaults(run=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    _check_args(args)
    return asyncio.run(_bench(args))


def _check_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1; got {args.num_requests}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0; got {args.timeout}")


async def _bench(args: argparse.Namespace) -> int:
    try:
        from amoe.bench.client import BenchClient
    except ModuleNotFoundError as e:  # httpx is optional for serving, needed here
        raise ConfigError(f"amoe bench serve needs the {e.name} package: pip install {e.name}") from None
    from amoe.bench.arrivals import arrival_times
    from amoe.bench.report import compute_metrics, error_summary, format_table
    from amoe.bench.workloads import make_requests, make_workload

    workload = make_workload(args.workload, args.input_len, args.output_len, args.range_ratio)
    arrivals = arrival_times(args.num_requests, args.request_rate, args.burstiness, args.seed)
    tokenizer = _load_tokenizer(args.tokenizer)
    client = BenchClient(
        args.base_url, api_key=args.api_key, timeout=args.timeout, max_connections=args.max_concurrency
    )
    async with client:
        client.model, max_model_len = await _resolve_model(client, args.model)
        prompt_format = (
            "text" if workload.sharegpt_path else await _choose_prompt_format(client, args.prompt_format)
        )
        requests = make_requests(
            workload,
            args.num_requests,
            seed=args.seed,
            prompt_format=prompt_format,
            tokenizer=tokenizer,
            max_model_len=max_model_len,
        )
        logger.info(
            "%d %s requests to %s (%s) at %s req/s, burstiness %g, max concurrency %s, %s prompts",
            len(requests), workload.name, client.base_url, client.model, args.request_rate, args.burstiness,
            args.max_concurrency or "unlimited", prompt_format,
        )  # fmt: skip
        with _Progress(len(requests)) as progress:
            results, duration = await run_requests(
                client, requests, arrivals, args.max_concurrency, progress.update
            )
    metrics = compute_metrics(results, duration)
    record = {**_run_config(args, client, prompt_format), **metrics, "errors": error_summary(results)}
    print(format_table(metrics))
    print(json.dumps(record))
    if args.result_file:
        _write_json(Path(args.result_file), record)
    if not metrics["completed"]:
        logger.error("no request completed; the most frequent error: %s", record["errors"][0]["error"])
        return 1
    return 0


async def run_requests(
    client: BenchClient,
    requests: Sequence[RequestSpec],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival offset (waiting for a slot when capped); results and wall-clock seconds."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def send(spec: RequestSpec, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            result = await client.complete(spec)
        if on_done is not None:
            on_done(result)
        return result

    results = await asyncio.gather(*(send(spec, at) for spec, at in zip(requests, arrivals)))
    return list(results), time.perf_counter() - start


async def _resolve_model(client: BenchClient, model: str | None) -> tuple[str, int | None]:
    """The model name to send and, when the server reports it, its context length."""
    try:
        cards = await client.list_models()
    except ConfigError:
        if model is None:
            raise
        logger.warning("could not list the server's models; sending model %r as given", model)
        return model, None
    if model is None:
        if not cards or not isinstance(cards[0].get("id"), str):
            raise ConfigError(f"{client.base_url}/v1/models lists no model; pass --model")
        model = cards[0]["id"]
    card = next((c for c in cards if c.get("id") == model), {})
    max_model_len = card.get("max_model_len")
    return model, max_model_len if isinstance(max_model_len, int) else None


async def _choose_prompt_format(client: BenchClient, requested: str) -> str:
    """ids when the server accepts token-id prompts (exact lengths), else text; also a test that the server serves."""
    from amoe.bench.workloads import RequestSpec

    if requested != "auto":
        return requested
    ids_probe = await client.complete(RequestSpec(_PROBE_IDS, len(_PROBE_IDS), 2))
    if ids_probe.success:
        return "ids"
    text_probe = await client.complete(RequestSpec(_PROBE_TEXT, 5, 2))
    if text_probe.success:
        logger.info("the server refused a token-id prompt (%s); sending text prompts", ids_probe.error)
        return "text"
    raise ConfigError(f"a test request to {client.base_url} failed: {text_probe.error}")


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from amoe.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def _run_config(args: argparse.Namespace, client: BenchClient, prompt_format: str) -> dict[str, Any]:
    config = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "base_url": client.base_url,
        "model": client.model,
        "workload": args.workload,
        "num_requests": args.num_requests,
        # "inf" rather than Infinity, which strict JSON parsers reject.
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "prompt_format": prompt_format,
    }
    if args.workload == "random":
        config.update(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio)
    return config


def _write_json(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write the result file {path}: {e.strerror or e}") from None
    logger.info("wrote %s", path)


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    _BAR = 30

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.num_done = self.num_failed = 0
        self.start = time.perf_counter()

    def __enter__(self) -> _Progress:
        self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def update(self, result: RequestResult) -> None:
        self.num_done += 1
        self.num_failed += not result.success
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self._BAR * self.num_done // max(1, self.total)
        bar = "#" * filled + "-" * (self._BAR - filled)
        elapsed = time.perf_counter() - self.start
        self.stream.write(
            f"\r[{bar}] {self.num_done}/{self.total} done, {self.num_failed} failed, {elapsed:.1f} s"
        )
        self.stream.flush()
