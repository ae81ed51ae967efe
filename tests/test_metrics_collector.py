"""The coordinator's /metrics view of runtime reports: exact against `Engine.stats()` of real runtimes under load,
monotonic across runtime restarts, bounded in series, fast, documented; and the request metrics of the API."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from metrics_support import FakeBackend, attention_report, series_bound
from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from amoe.config import AmoeConfig
from amoe.runtime.report import BATCH_ROWS_BUCKETS
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster
from coordinator.api.app import create_app
from coordinator.metrics import REASONS, CoordinatorMetrics, text_format
from coordinator.requests.backend import RankKV
from coordinator.requests.cluster_backend import ClusterBackend

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def scrape(metrics: CoordinatorMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of one render, keyed (name, labels without empty values)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if v != ""))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def assert_counters_monotonic(before: dict, after: dict) -> None:
    for key, old in before.items():
        if key[0].endswith(COUNTER_SUFFIXES) and key in after:
            assert after[key] >= old, f"{key} went from {old} to {after[key]}"


# ---- restarts


def test_a_restart_never_makes_a_counter_go_backwards():
    backend = FakeBackend([attention_report(scale=4)])
    metrics = CoordinatorMetrics(backend)
    seen = [scrape(metrics)]
    assert value(seen[0], "amoe_runtime_busy_seconds_total", runtime="0", role="attention") == 2.0
    assert value(seen[0], "amoe_expert_routed_tokens_total", block="1", expert="0") == 12

    backend.reports = [attention_report(incarnation="b", scale=1)]  # restarted: its counters start again
    seen.append(scrape(metrics))
    assert value(seen[1], "amoe_runtime_busy_seconds_total", runtime="0", role="attention") == 2.5
    assert value(seen[1], "amoe_runtime_executed_batches_total", runtime="0", block="0", rank="0") == 10
    assert value(seen[1], "amoe_comm_sent_bytes_total", runtime="0", role="attention") == 500
    assert value(seen[1], "amoe_runtime_batch_size_rows_count", runtime="0", kind="attn") == 5
    assert value(seen[1], "amoe_runtime_restarts_total", runtime="0", role="attention") == 1

    # A restart whose report carries no new incarnation: any counter lower than before gives it away, and then
    # every series of the runtime is folded, even one that already grew past its old value.
    old = attention_report(incarnation=None, scale=2)
    old["busy_s"] = 100.0
    backend.reports = [old]
    seen.append(scrape(metrics))
    backend.reports = [attention_report(incarnation=None, scale=1)]
    backend.reports[0]["busy_s"] = 150.0
    seen.append(scrape(metrics))
    assert value(seen[3], "amoe_runtime_restarts_total", runtime="0", role="attention") == 2
    assert value(seen[3], "amoe_runtime_idle_seconds_total", runtime="0", role="attention") == 6.0 + 3.0 + 1.5
    assert value(seen[3], "amoe_runtime_busy_seconds_total", runtime="0", role="attention") == 2.0 + 100 + 150

    backend.reports = []  # the runtime is gone: its series go, but the routing totals keep what it counted
    seen.append(scrape(metrics))
    assert ("amoe_runtime_up", frozenset({("runtime", "0"), ("role", "attention")})) not in seen[4]
    assert value(seen[4], "amoe_expert_routed_tokens_total", block="0", expert="1") == 12 + 6 + 3
    backend.reports = [attention_report(incarnation="c", scale=1)]
    seen.append(scrape(metrics))
    for before, after in zip(seen, seen[1:]):
        assert_counters_monotonic(before, after)


# ---- real runtimes under load


@pytest.fixture
def cluster(tiny_checkpoint):
    c = InProcessCluster(tiny_checkpoint, 2, 4, num_kv_blocks=256, block_size=16, report=True)
    with c:
        yield c


class RecordingBackend:
    """runtime_stats() of the live reporters, remembering what the last scrape read."""

    def __init__(self, cluster: InProcessCluster) -> None:
        self.cluster = cluster
        self.last: list[dict] = []

    def runtime_stats(self) -> list[dict]:
        self.last = [r.report() for r in self.cluster.reporters]
        return self.last

    def kv_usage(self) -> list[RankKV]:
        blocks = [x.requests.blocks for x in self.cluster.attention]
        return [RankKV(b.num_free_blocks, b.num_total_blocks) for b in blocks]


def layer_labels(runtime: int, layer: tuple[str, int, int]) -> dict[str, str]:
    kind, block, index = layer
    return {
        "runtime": str(runtime),
        "block": str(block),
        ("expert" if kind == "expert" else "rank"): str(index),
    }


@pytest.mark.timeout(120)
def test_exported_queue_depths_equal_the_runtimes_stats_under_load(cluster):
    backend = RecordingBackend(cluster)
    per_layer, per_runtime = CoordinatorMetrics(backend), CoordinatorMetrics(backend, per_layer=False)
    prompts = [[1, *range(5 + i, 25 + i)] for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    load = threading.Thread(target=cluster.generate, args=(prompts, params), daemon=True)
    load.start()
    busiest, previous = 0.0, None
    while load.is_alive():
        samples = scrape(per_layer)
        for report in backend.last:
            rt = report["runtime"]
            for layer, depth in report["depth"].items():
                assert value(samples, "amoe_runtime_queue_depth_tokens", **layer_labels(rt, layer)) == depth
            for layer, n in report["batches"].items():
                assert value(samples, "amoe_runtime_executed_batches_total", **layer_labels(rt, layer)) == n
            role = {"runtime": str(rt), "role": report["role"]}
            assert value(samples, "amoe_runtime_pool_parts", **role) == report["pool_parts"]
            assert value(samples, "amoe_runtime_idle_seconds_total", **role) == report["idle_s"]
            busiest = max(busiest, sum(report["depth"].values()))
        totals = scrape(per_runtime)
        for report in backend.last:
            depth = value(totals, "amoe_runtime_queue_depth_tokens", runtime=str(report["runtime"]))
            assert depth == sum(report["depth"].values())
        if previous is not None:
            assert_counters_monotonic(previous, samples)
        previous = samples
        time.sleep(0.01)
    assert busiest > 0, "the load never left a token waiting: the comparison proved nothing"


@pytest.mark.timeout(60)
def test_batch_size_histogram_is_exact_and_routing_adds_up(cluster):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cluster.generate([[1, *range(3, 3 + n)] for n in (1, 5, 17, 40)], params)
    time.sleep(0.1)  # the last expert batches may still be in a dispatcher's hands
    backend = RecordingBackend(cluster)
    samples = scrape(CoordinatorMetrics(backend))
    cfg = cluster.model_config
    for report in backend.last:
        rt = str(report["runtime"])
        kinds = ("attn", "head") if report["role"] == "attention" else ("expert",)
        count = sum(value(samples, "amoe_runtime_batch_size_rows_count", runtime=rt, kind=k) for k in kinds)
        total = sum(value(samples, "amoe_runtime_batch_size_rows_sum", runtime=rt, kind=k) for k in kinds)
        if report["role"] == "attention":
            assert count == sum(report["batches"].values())
        else:  # one grouped step drains several of its (block, expert) queues, each counting a batch
            assert 0 < count <= sum(report["batches"].values())
        assert total == sum(report["rows"].values())
    # Every token a router sent to (block, expert) was executed there: nothing is left in flight.
    for block in range(cfg.num_blocks):
        for expert in range(cfg.num_experts):
            routed = value(samples, "amoe_expert_routed_tokens_total", block=str(block), expert=str(expert))
            executed = sum(
                v for (name, labels), v in samples.items()
                if name == "amoe_runtime_executed_rows_total" and {("block", str(block)), ("expert", str(expert))} <= labels
            )  # fmt: skip
            assert routed == executed
    assert sum(v for (n, _), v in samples.items() if n == "amoe_expert_routed_tokens_total") > 0


# ---- bounded series, the page


def synthetic_reports(num_blocks: int, num_experts: int, num_attn: int, num_expert_ranks: int) -> list[dict]:
    reports = [attention_report(r, num_blocks=num_blocks, num_experts=num_experts) for r in range(num_attn)]
    for rank in range(num_attn):
        for layer in list(reports[rank]["depth"]):
            for name in ("depth", "batches", "rows"):
                reports[rank][name][("attn", layer[1], rank)] = reports[rank][name].pop(layer)
    for r in range(num_expert_ranks):
        runtime = num_attn + r
        layers = [
            ("expert", b, e) for b in range(num_blocks) for e in range(r, num_experts, num_expert_ranks)
        ]
        rep = attention_report(runtime, num_blocks=0)
        rep.update(role="expert", routed=None, kv_used_blocks=None, kv_total_blocks=None)
        rep.update({name: dict.fromkeys(layers, 1) for name in ("depth", "batches", "rows")})
        rep["batch_rows"] = {
            "buckets": list(BATCH_ROWS_BUCKETS),
            "counts": {"expert": [1] * 13},
            "sum": {"expert": 1},
        }
        reports.append(rep)
    return reports


@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize(
    "shape", [(4, 8, 2, 4), (61, 256, 8, 32)], ids=["tiny-6-runtimes", "deepseek-v3-like"]
)
def test_series_count_is_bounded_and_the_page_is_what_prometheus_client_writes(shape, per_layer):
    metrics = CoordinatorMetrics(
        FakeBackend(synthetic_reports(*shape), num_ranks=shape[2]), per_layer=per_layer
    )
    num_series = len(scrape(metrics))
    assert num_series <= series_bound(*shape, per_layer)
    if not per_layer:  # the flag makes the count independent of the number of blocks
        one_block = CoordinatorMetrics(
            FakeBackend(synthetic_reports(1, *shape[1:]), shape[2]), per_layer=False
        )
        assert num_series == len(scrape(one_block))
    # The fast writer behind /metrics is byte for byte prometheus_client's own (its speed: bench/metrics_endpoint.py).
    metrics.requests.labels("completions", "success").inc()
    metrics.itl.observe(0.02)
    assert metrics.render() == generate_latest(metrics.registry)


def test_text_format_escapes_label_values_and_refuses_names_it_cannot_write():
    registry = CollectorRegistry()
    Counter("amoe_test_things", "Odd \\ help\nsecond line", ["what"], registry=registry).labels(
        'a"b\\c\nd'
    ).inc(3)
    Gauge("amoe_test_level", "A gauge", registry=registry).set(float("inf"))
    assert text_format(registry) == generate_latest(registry)
    Gauge("amoe_test_unitless", "OK", registry=registry)
    Info("amoe_test_build", "an info family is not written", registry=registry).info({"v": "1"})
    with pytest.raises(ValueError, match="amoe_test_build"):
        text_format(registry)


# ---- docs


def test_every_exported_metric_is_documented():
    metrics = CoordinatorMetrics(FakeBackend([attention_report()]))
    names = {family.name for family in text_string_to_metric_families(metrics.render().decode())}
    text = metrics.render().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    docs = DOCS.read_text()
    documented = set(re.findall(r"`(amoe_[a-z0-9_]+)`", docs))
    missing = sorted(n for n in types if n not in documented)
    assert not missing, f"metrics exported but not in docs/metrics.md: {missing}"
    assert len(names) >= 30


# ---- request metrics through the API


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from amoe.model.make import make_model

    return make_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)  # with its tokenizer


@pytest.mark.timeout(120)
def test_request_metrics_follow_the_requests(model_dir):
    async def run() -> tuple[dict, list[int]]:
        config = AmoeConfig().replace(
            parallel={"attn_ranks": 2, "expert_ranks": 2}, cache={"num_kv_blocks": 64}
        )
        backend = ClusterBackend(config, model_dir)  # the real launcher: four runtime processes
        await backend.start()
        try:
            app = create_app(backend, _tokenizer(model_dir), _model_info(), _detokenizer(model_dir))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://amoe") as client:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
                replies = await asyncio.gather(
                    *(client.post("/v1/completions", json={**body, "stream": i % 2 == 1}) for i in range(4))
                )
                bad = await client.post("/v1/completions", json={**body, "max_tokens": -1})
                text = (await client.get("/metrics")).text
        finally:
            await backend.shutdown()
        return _parse(text), [r.status_code for r in replies] + [bad.status_code]

    samples, codes = asyncio.run(run())
    assert codes == [200, 200, 200, 200, 400]
    assert value(samples, "amoe_request_ttft_seconds_count") == 4
    assert value(samples, "amoe_request_e2e_seconds_count") == 4
    assert value(samples, "amoe_request_queue_seconds_count") == 4
    assert value(samples, "amoe_request_itl_seconds_count") == 4 * 5
    assert value(samples, "amoe_coordinator_generation_tokens_total") == 4 * 6
    assert value(samples, "amoe_requests_finished_total", reason="length") == 4
    assert value(samples, "amoe_requests_finished_total", reason="rejected") == 1
    assert {r for r in REASONS} == {
        dict(labels)["reason"] for (n, labels) in samples if n == "amoe_requests_finished_total"
    }
    assert value(samples, "amoe_requests_running") == 0 and value(samples, "amoe_requests_waiting") == 0
    assert value(samples, "amoe_kv_total_blocks", rank="1") == 64
    assert value(samples, "amoe_runtime_up", runtime="3", role="expert") == 1


def _parse(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if v != ""))] = s.value
    return out


def _tokenizer(model_dir):
    from amoe.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def _detokenizer(model_dir):
    from amoe.tokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer(model_dir)
    return lambda prompt_ids: IncrementalDetokenizer(tokenizer, prompt_ids)


def _model_info():
    from coordinator.api.validation import ModelInfo

    return ModelInfo(name="tiny", max_model_len=1024, vocab_size=1024)
