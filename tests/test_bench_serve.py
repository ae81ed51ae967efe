"""`amoe bench serve`: arrivals, workloads, metric math, the streaming client, and a run against a real amoe serve."""

import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from amoe.bench.arrivals import arrival_times
from amoe.bench.client import BenchClient, RequestResult
from amoe.bench.report import compute_metrics, error_summary, format_table
from amoe.bench.workloads import (
    PAPER_WORKLOADS,
    RequestSpec,
    make_requests,
    make_workload,
    sample_lengths,
    steady_state_requests,
)
from amoe.cli import main
from amoe.errors import ConfigError
from amoe.model.make import make_model
from amoe.tokenizer import Tokenizer

MODEL_NAME = "tiny-bench"


# --- arrivals ---------------------------------------------------------------------------------------------------


def _gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_have_the_mean_rate_and_gamma_cv(burstiness):
    rate = 8.0
    gaps = _gaps(arrival_times(40_001, rate, burstiness, seed=3))
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    # Gamma with shape k: the coefficient of variation is 1/sqrt(k); 1 for Poisson (exponential gaps).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_and_start_at_zero():
    first = arrival_times(50, 3.0, 0.5, seed=7)
    assert first == arrival_times(50, 3.0, 0.5, seed=7)
    assert first != arrival_times(50, 3.0, 0.5, seed=8)
    assert first[0] == 0.0 and len(first) == 50


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 2.0) == []


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0)])
def test_bad_arrival_parameters_are_config_errors(rate, burstiness):
    with pytest.raises(ConfigError):
        arrival_times(3, rate, burstiness)


# --- workloads --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PAPER_WORKLOADS))
def test_paper_workload_lengths_cover_their_inclusive_ranges(name):
    (in_lo, in_hi), (out_lo, out_hi) = PAPER_WORKLOADS[name]
    lengths = np.array(sample_lengths(make_workload(name), 5000, np.random.default_rng(0)))
    assert lengths[:, 0].min() == in_lo and lengths[:, 0].max() == in_hi
    assert lengths[:, 1].min() == out_lo and lengths[:, 1].max() == out_hi


def test_the_cost_models_paper_workloads_are_the_load_generators():
    """The cost model keeps its own table of the paper workloads' lengths (the load generator imports nothing from the
    modelling wing): the same lengths, so a plan's mean context is that of the requests `amoe bench serve` sends."""
    from amoe.perf.model.workloads import PAPER_WORKLOADS as MODELLED

    assert MODELLED == PAPER_WORKLOADS


def test_random_workload_uses_the_range_ratio():
    workload = make_workload("random", input_len=100, output_len=10, range_ratio=0.5)
    assert (workload.input_range, workload.output_range) == ((50, 150), (5, 15))
    fixed = make_workload("random", input_len=7, output_len=3)
    assert {(7, 3)} == set(sample_lengths(fixed, 20, np.random.default_rng(0)))


def test_id_prompts_have_the_exact_length_and_are_reproducible():
    requests = make_requests(make_workload("short"), 50, seed=1, prompt_format="ids")
    assert requests == make_requests(make_workload("short"), 50, seed=1, prompt_format="ids")
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert all(10 <= t < 1000 for t in r.prompt)
        assert 70 <= r.output_len <= 130


def test_steady_state_requests_are_a_running_deployments_snapshot():
    """A deployment in steady state runs length-biased requests part-way through: the contexts (prompt plus what
    was generated) average the cost model's steady-state decode context, and the tokens left sum a request's
    output. Decode-only emulation takes the generated part as prompt, so these are what the server is sent."""
    from amoe.perf.model.cost_model import mean_decode_context

    workload = make_workload("short")
    requests = steady_state_requests(workload, 20_000, seed=3)
    assert steady_state_requests(workload, 50, seed=3) == steady_state_requests(workload, 50, seed=3)
    prompts = np.array([r.prompt_len for r in requests])
    left = np.array([r.output_len for r in requests])
    assert all(len(r.prompt) == r.prompt_len for r in requests[:100])
    assert prompts.mean() == pytest.approx(mean_decode_context(*PAPER_WORKLOADS["short"]), rel=0.01)
    assert left.min() >= 1 and left.max() <= 130 and prompts.min() >= 30 and prompts.max() < 70 + 130
    # Length bias: a snapshot holds the requests that live long more often than arrivals do (mean 100 tokens).
    assert (prompts - 50 + left).mean() == pytest.approx(np.mean(np.arange(70, 131) ** 2) / 100, rel=0.02)
    with pytest.raises(ConfigError):
        steady_state_requests(make_workload("sharegpt:" + __file__), 1)


def test_text_prompts_reach_the_length_with_a_tokenizer(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    for r in make_requests(make_workload("medium"), 10, prompt_format="text", tokenizer=tokenizer):
        num_tokens = len(tokenizer.encode(r.prompt))  # as the server counts it: with the BOS it adds
        shorter = " ".join(r.prompt.split()[:-1])
        assert num_tokens >= r.prompt_len > len(tokenizer.encode(shorter))


@pytest.mark.parametrize("spec", ["long", "sharegpt:/no/such/file.json"])
def test_unknown_workloads_are_config_errors(spec):
    with pytest.raises(ConfigError):
        make_workload(spec)


def _conversation(human: str, gpt: str) -> dict:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_takes_the_first_human_turn_and_estimates_reply_tokens(tmp_path):
    words = " ".join(["word"] * 10)  # 10 words ≈ 13 tokens without a tokenizer
    entries = [
        _conversation(f"question {i} " + words, words + " " + words) for i in range(3)
    ]  # usable: 13-ish + 26 tokens
    entries += [
        _conversation("hi", words),  # prompt too short
        _conversation(words * 100, words),  # too long for max_model_len
        {"conversations": [{"from": "gpt", "value": words}]},  # no human turn
        "not a conversation",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    requests = make_requests(make_workload(f"sharegpt:{path}"), 3, max_model_len=100)
    assert sorted(r.prompt for r in requests) == sorted(e["conversations"][0]["value"] for e in entries[:3])
    assert all(r.output_len == round(20 * 1.3) and r.prompt_len == round(12 * 1.3) for r in requests)
    # More requests than usable conversations: they are reused.
    assert len(make_requests(make_workload(f"sharegpt:{path}"), 7, max_model_len=100)) == 7


def test_sharegpt_counts_prompts_as_served_and_replies_as_generated(tmp_path, model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt, reply = "Why is the sky blue today?", "Because of Rayleigh scattering, mostly."
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([_conversation(prompt, reply)]))
    (request,) = make_requests(make_workload(f"sharegpt:{path}"), 1, tokenizer=tokenizer)
    # The server encodes the prompt with the <s> its tokenizer adds; the model generates the reply without one.
    assert request.prompt_len == len(tokenizer.encode(prompt, add_special_tokens=False)) + 1
    assert request.prompt_len == len(tokenizer.encode(prompt))
    assert request.output_len == len(tokenizer.encode(reply, add_special_tokens=False))


# --- metrics ----------------------------------------------------------------------------------------------------


def _result(ttft: float, itl: list[float], tail: float = 0.001, prompt_tokens: int = 10) -> RequestResult:
    latency = ttft + sum(itl) + tail
    return RequestResult(True, prompt_tokens, len(itl) + 1, ttft, list(itl), latency)


def test_metrics_equal_a_direct_numpy_computation():
    done = [
        _result(0.050, [0.010, 0.012, 0.030]),
        _result(0.200, [0.020] * 9),
        _result(0.120, []),  # one output token: no TPOT sample
        _result(0.080, [0.015, 0.011]),
    ]
    failed = RequestResult(error="HTTP 500: boom", prompt_tokens=99)
    metrics = compute_metrics([*done, failed, RequestResult(error="HTTP 500: boom")], duration=2.0)

    ttft = np.array([r.ttft for r in done]) * 1000
    itl = np.array([g for r in done for g in r.itl]) * 1000
    tpot = (
        np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]) * 1000
    )
    e2el = np.array([r.latency for r in done]) * 1000
    assert metrics["completed"] == 4 and metrics["failed"] == 2
    output_tokens = 4 + 10 + 1 + 3
    assert metrics["total_output_tokens"] == output_tokens and metrics["total_input_tokens"] == 40
    assert metrics["request_throughput"] == pytest.approx(2.0)
    assert metrics["output_throughput"] == pytest.approx(output_tokens / 2)
    assert metrics["total_token_throughput"] == pytest.approx((40 + output_tokens) / 2)
    for name, samples in {"ttft": ttft, "itl": itl, "tpot": tpot, "e2el": e2el}.items():
        assert metrics[f"mean_{name}_ms"] == pytest.approx(samples.mean())
        assert metrics[f"median_{name}_ms"] == pytest.approx(np.median(samples))
        assert metrics[f"p90_{name}_ms"] == pytest.approx(np.percentile(samples, 90))
        assert metrics[f"p99_{name}_ms"] == pytest.approx(np.percentile(samples, 99))
    assert error_summary([*done, failed, failed]) == [{"error": "HTTP 500: boom", "count": 2}]


def test_metrics_without_completions_are_none_and_shown_as_na():
    metrics = compute_metrics([RequestResult(error="refused")], duration=1.0)
    assert metrics["completed"] == 0 and metrics["mean_ttft_ms"] is None and metrics["p99_itl_ms"] is None
    table = format_table(metrics)
    assert re.search(r"Failed requests:\s+1$", table, re.M)
    assert re.search(r"Mean TTFT \(ms\):\s+n/a$", table, re.M)
    json.dumps(metrics, allow_nan=False)  # strict JSON


# --- client against fake servers --------------------------------------------------------------------------------


def _sse(*events: object) -> bytes:
    """Server-sent events: dicts as JSON data, other strings as data, strings starting with ':' as comments."""

    def line(e: object) -> str:
        if isinstance(e, str):
            return e if e.startswith(":") else f"data: {e}"
        return f"data: {json.dumps(e)}"

    return "".join(f"{line(e)}\n\n" for e in events).encode()


def _chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


SPEC = RequestSpec([11, 12], 2, 3)


async def _complete_with(handler, spec=SPEC, timeout=10.0) -> RequestResult:
    async with BenchClient(
        "http://fake/v1/", "m", timeout=timeout, transport=httpx.MockTransport(handler)
    ) as c:
        return await c.complete(spec)


def test_client_counts_chunks_and_takes_tokens_from_usage():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), path=request.url.path)
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
        return httpx.Response(
            200, content=_sse(_chunk("a"), ": comment", _chunk("b"), _chunk(""), usage, "[DONE]")
        )

    result = asyncio.run(_complete_with(handler))
    assert result.success and result.error == ""
    assert (result.prompt_tokens, result.output_tokens, len(result.itl)) == (3, 4, 2)
    assert 0 < result.ttft <= result.latency
    assert seen["path"] == "/v1/completions" and seen["prompt"] == [11, 12] and seen["max_tokens"] == 3
    assert (
        seen["ignore_eos"] is True
        and seen["stream"] is True
        and seen["stream_options"] == {"include_usage": True}
    )


def test_client_without_usage_counts_chunks():
    result = asyncio.run(
        _complete_with(lambda r: httpx.Response(200, content=_sse(_chunk("a"), _chunk("b"), "[DONE]")))
    )
    assert result.success and result.output_tokens == 2 and result.prompt_tokens == 2


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(400, json={"error": {"message": "bad prompt"}}), "HTTP 400: bad prompt"),
        (httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
        (httpx.Response(200, content=_sse(_chunk("a"), {"error": {"message": "died"}})), "error event"),
        (httpx.Response(200, content=_sse(_chunk("a"))), "without [DONE]"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
    ],
)
def test_client_reports_bad_responses_as_failures(response, error):
    result = asyncio.run(_complete_with(lambda r: response))
    assert not result.success and error in result.error


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(30)
def test_a_dead_url_is_a_failed_request():
    async def run() -> RequestResult:
        async with BenchClient(_dead_url(), "m", timeout=10) as client:
            return await client.complete(RequestSpec([11], 1, 1))

    result = asyncio.run(run())
    assert not result.success and "ConnectError" in result.error


# Slow: the client's 0.5 s timeout must really fire (the margin, 5 s, is wide).
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_a_server_that_never_answers_times_out():
    with socket.socket() as listener:  # accepts connections (the backlog) but never reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def run() -> RequestResult:
            async with BenchClient(url, "m", timeout=0.5) as client:
                return await client.complete(RequestSpec([11], 1, 1))

        start = time.monotonic()
        result = asyncio.run(run())
    assert not result.success and "timed out" in result.error.lower()
    assert time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_bench_against_a_dead_url_reports_failures(capsys):
    url = _dead_url()
    flags = ["--workload", "random", "--input-len", "4", "--output-len", "4", "--num-requests", "3"]
    code = main(["bench", "serve", "--base-url", url, "--model", "m", "--prompt-format", "ids", *flags])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err
    assert re.search(r"Failed requests:\s+3$", out, re.M)
    assert json.loads(out.strip().splitlines()[-1])["errors"][0]["count"] == 3
    # Without --model the server must answer /v1/models: one line, exit 1.
    assert main(["bench", "serve", "--base-url", url, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("amoe: error: cannot list the models") and "Traceback" not in err


# --- end to end against amoe serve ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / MODEL_NAME, seed=0)


@pytest.fixture(scope="module")
def server_url(model_dir):
    cmd = [sys.executable, "-m", "amoe", "serve", "--model", str(model_dir), "--port", "0"]
    env = {**os.environ, "AMOE_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stderr), daemon=True).start()
    try:
        yield _wait_for_url(proc, lines)
    finally:
        proc.kill()
        proc.wait(10)


def _wait_for_url(proc: subprocess.Popen, lines: list[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := re.search(r"amoe serve: listening on (http://\S+)$", line):
                return match.group(1)
        assert proc.poll() is None, "server exited early:\n" + "\n".join(lines)
        time.sleep(0.05)
    raise AssertionError("no listening line:\n" + "\n".join(lines))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [
        ["--prompt-format", "auto"],
        ["--prompt-format", "text", "--request-rate", "50", "--max-concurrency", "3"],
    ],
)
def test_bench_serve_against_amoe_serve(server_url, tmp_path, capsys, extra):
    result_file = tmp_path / "result.json"
    workload = ["--workload", "random", "--input-len", "8", "--output-len", "8", "--num-requests", "8"]
    code = main(
        ["bench", "serve", "--base-url", server_url, *workload, "--result-file", str(result_file), *extra]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(result_file.read_text())
    assert json.loads(out.strip().splitlines()[-1]) == record
    assert record["model"] == MODEL_NAME and record["prompt_format"] == ("ids" if "auto" in extra else "text")
    assert (record["completed"], record["failed"], record["errors"]) == (8, 0, [])
    assert record["total_output_tokens"] == 8 * 8  # ignore_eos: every request ran to max_tokens
    if record["prompt_format"] == "ids":
        assert record["total_input_tokens"] == 8 * 8
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < record[f"median_{name}_ms"] <= record[f"p99_{name}_ms"]
    assert record["mean_e2el_ms"] >= record["mean_ttft_ms"]
    assert re.search(r"Successful requests:\s+8$", out, re.M)
