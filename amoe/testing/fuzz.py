"""Property-based fuzzing of a live server's API from its own OpenAPI schema (schemathesis + hypothesis): every
generated request, valid or not, must get an answer below 500. Used by bench/fuzz_api.py (long runs) and the
test suite (a short one)."""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

# Share of the examples per operation: generation is what the fuzzing is for; the GETs take no input (one case).
_WEIGHTS = {"POST /v1/completions": 0.5, "POST /v1/chat/completions": 0.5}
# Most cases name the served model: a random name stops at "model not found", before everything worth fuzzing.
_SERVED_MODEL_SHARE = 0.9


@dataclass
class FuzzReport:
    requests: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)  # one line per response >= 500
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.server_errors


@dataclass
class _Target:
    url: str
    headers: dict | None
    timeout_s: float
    model: str
    rng: random.Random


def fuzz(
    url: str, examples: int, seed: int = 0, headers: dict | None = None, timeout_s: float = 60.0
) -> FuzzReport:
    """About `examples` generated requests against the server at `url`, spread over its operations."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s).json()["data"][0]["id"]
    target = _Target(url, headers, timeout_s, model, random.Random(seed))
    report = FuzzReport()
    start = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        _run_cases(op, label, max(1, int(examples * _WEIGHTS.get(label, 0))), seed, target, report)
    report.seconds = time.monotonic() - start
    return report


def _run_cases(op, label: str, count: int, seed: int, target: _Target, report: FuzzReport) -> None:
    import hypothesis

    @hypothesis.settings(
        max_examples=count,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate],  # no shrinking: every case is one more request, not a repro hunt
    )
    @hypothesis.seed(seed)
    @hypothesis.given(case=op.as_strategy())
    def run(case):
        if isinstance(case.body, dict) and "model" in case.body and target.rng.random() < _SERVED_MODEL_SHARE:
            case.body["model"] = target.model
        response = case.call(base_url=target.url, headers=target.headers, timeout=target.timeout_s)
        report.requests += 1
        report.by_status[response.status_code] += 1
        if response.status_code >= 500:
            line = f"{label} -> {response.status_code}: {case.body!r:.300} -> {response.text[:300]}"
            report.server_errors.append(line)
            logger.error("[fuzz] %s", line)

    run()
