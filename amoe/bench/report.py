"""Serving metrics from per-request timings, named and computed as `vllm bench serve` does.

Per completed request: TTFT = time to the first token chunk; ITL = every gap between consecutive token chunks (all
requests' gaps pooled); TPOT = (E2E − TTFT) / (output tokens − 1), for requests with more than one output token;
E2E = time to the end of the stream. Throughputs divide completed work by the wall-clock duration of the run.
Percentiles interpolate linearly (numpy's default). A statistic over no samples is None (null in JSON, n/a in the
table) rather than a misleading 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from amoe.bench.client import RequestResult

LATENCIES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
STATISTICS = ("mean", "median", "p90", "p99")
_MAX_DISTINCT_ERRORS = 5
_WIDTH = 50


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The flat metrics dict: counts, throughputs, and <stat>_<latency>_ms for each latency and statistic."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _per_second(len(done), duration),
        "output_throughput": _per_second(output_tokens, duration),
        "total_token_throughput": _per_second(input_tokens + output_tokens, duration),
    }
    for name, seconds in latency_samples(done).items():
        metrics.update(_statistics(name, seconds))
    return metrics


def latency_samples(done: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Latency samples in seconds per metric, from completed requests."""
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def _statistics(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"{stat}_{name}_ms": None for stat in STATISTICS}
    ms = np.asarray(seconds) * 1000.0
    values = (ms.mean(), np.median(ms), np.percentile(ms, 90), np.percentile(ms, 99))
    return {f"{stat}_{name}_ms": float(v) for stat, v in zip(STATISTICS, values)}


def _per_second(amount: float, duration: float) -> float | None:
    return amount / duration if duration > 0 else None


def error_summary(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """The most frequent failure messages with their counts."""
    counts = Counter(r.error for r in results if not r.success)
    return [{"error": error, "count": n} for error, n in counts.most_common(_MAX_DISTINCT_ERRORS)]


def format_table(metrics: dict[str, Any]) -> str:
    """A readable table in the layout of vLLM's benchmark result."""
    rows = [
        _title("Serving Benchmark Result", "="),
        _row("Successful requests:", metrics["completed"]),
        _row("Failed requests:", metrics["failed"]),
        _row("Benchmark duration (s):", metrics["duration"]),
        _row("Total input tokens:", metrics["total_input_tokens"]),
        _row("Total generated tokens:", metrics["total_output_tokens"]),
        _row("Request throughput (req/s):", metrics["request_throughput"]),
        _row("Output token throughput (tok/s):", metrics["output_throughput"]),
        _row("Total token throughput (tok/s):", metrics["total_token_throughput"]),
    ]
    for name, title in LATENCIES.items():
        rows.append(_title(title, "-"))
        label = name.upper()
        rows += [
            _row(f"{stat.capitalize()} {label} (ms):", metrics[f"{stat}_{name}_ms"]) for stat in STATISTICS
        ]
    rows.append("=" * _WIDTH)
    return "\n".join(rows)


def _title(text: str, fill: str) -> str:
    return f" {text} ".center(_WIDTH, fill)


def _row(label: str, value: Any) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.2f}"
    else:
        shown = str(value)
    return f"{label:<40}{shown:>10}"
