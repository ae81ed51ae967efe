"""The coordinator's Prometheus metrics, all in one place: names `amoe_<component>_<quantity>_<unit>`, every one
listed with its meaning in docs/metrics.md.

Two sources. Request metrics are recorded by each request's RequestLifetime (coordinator/requests/lifetime.py), once per
request. Runtime metrics are read at scrape time by `RuntimeCollector` from the latest report of every runtime
(`backend.runtime_stats()`, the shape of docs/CONTRACTS.md "Runtime stats"), so one scrape is one consistent view.
Runtime counters are cumulative in the runtime; `CounterOffsets` keeps them monotonic here when a runtime restarts
and starts again from zero.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

OUTCOMES = ("success", "error", "aborted")  # per endpoint, as the API answered
REASONS = ("stop", "length", "abort", "error", "rejected")  # why a request ended

# vLLM's buckets, with a finer low end: CPU test models answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)  # fmt: skip

LAYER_LABELS = ("runtime", "block", "expert", "rank")  # expert or rank is "" (Prometheus drops empty labels)

# (metric, report key, help): per-runtime values of the report, labels (runtime, role).
RUNTIME_GAUGES = (
    ("amoe_runtime_pool_entries", "pool_entries", "Chunks in the token pool waiting for their other parts"),
    ("amoe_runtime_pool_parts", "pool_parts", "Parts (residuals, expert outputs) held in the token pool"),
    (
        "amoe_runtime_dispatch_pending_jobs",
        "dispatch_pending",
        "Layer outputs waiting for the dispatcher thread",
    ),
)
RUNTIME_COUNTERS = (
    ("amoe_runtime_busy_seconds", "busy_s", "Time the executor spent running layers"),
    ("amoe_runtime_idle_seconds", "idle_s", "Time the runtime loop waited for a batch (stall time)"),
    ("amoe_runtime_uptime_seconds", "uptime_s", "Runtime's age at the report busy_s came in"),
    (
        "amoe_runtime_barrier_idle_seconds",
        "barrier_idle_s",
        "Time a synchronous device's steps waited for a slower peer's at the barriers (transfers excluded)",
    ),
    (
        "amoe_runtime_attention_idle_seconds",
        "attention_idle_s",
        "Of the barrier idle time, the waits for a slower peer's attention step or head",
    ),
    ("amoe_runtime_received_tokens", "tokens_in", "Rows received by the receptor"),
    ("amoe_runtime_sent_tokens", "tokens_out", "Rows sent by the dispatcher"),
    ("amoe_runtime_sent_messages", "messages_out", "Messages sent by the dispatcher"),
    ("amoe_runtime_engine_errors", "errors", "Exceptions caught on the engine's C++ threads"),
    (
        "amoe_runtime_resent_rows",
        "resent_rows",
        "Rows an attention runtime sent to the experts again (a replaced expert runtime, or lost answers)",
    ),
)
# Seconds from a runtime's loss to its replacement serving (self-healing).
RECOVERY_BUCKETS = (0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 60, 120)
COMM_COUNTERS = (
    ("amoe_comm_sent_bytes", "bytes_out", "Bytes sent to other runtimes"),
    ("amoe_comm_received_bytes", "bytes_in", "Bytes received from other runtimes"),
    ("amoe_comm_sent_messages", "messages_out", "Messages sent to other runtimes"),
    ("amoe_comm_received_messages", "messages_in", "Messages received from other runtimes"),
    ("amoe_comm_timeouts", "timeouts", "Transfers not done within transport.timeout_s"),
    ("amoe_comm_cancelled_transfers", "cancelled", "Transfers abandoned because their peer was replaced"),
    ("amoe_comm_delayed_messages", "delayed_messages", "Messages held by an emulated link"),
    ("amoe_comm_link_delay_seconds", "delay_s", "Wall seconds messages were held by emulated links"),
    (
        "amoe_comm_rejected_handshakes",
        "rejected_handshakes",
        "Connections refused before any frame: no CURVE, or not the cluster's keys",
    ),
)
# The expert store of a process that offloads (docs/offload.md): report key "offload", labels (runtime, role).
OFFLOAD_COUNTERS = (
    ("amoe_offload_hits", "hits", "Expert lookups of a step that found the expert resident"),
    ("amoe_offload_misses", "misses", "Expert lookups of a step that had to wait for a copy from disk"),
    ("amoe_offload_loads", "loads", "Experts copied from disk into a slot (misses and prefetches)"),
    ("amoe_offload_evictions", "evictions", "Resident experts dropped to make room"),
    ("amoe_offload_read_bytes", "bytes_read", "Expert bytes read from disk"),
    ("amoe_offload_stall_seconds", "stall_s", "Time steps waited for an expert's copy"),
    ("amoe_offload_prefetches", "prefetches", "Experts copied before a step asked for them"),
    (
        "amoe_offload_prefetch_used",
        "prefetch_used",
        "Prefetched experts a step used before they were evicted (recall = this / prefetches)",
    ),
)
OFFLOAD_GAUGES = (
    ("amoe_offload_slots", "slots", "Expert slots of the store (its budget beside the dense part)"),
    ("amoe_offload_resident_experts", "resident", "Experts resident now"),
    ("amoe_offload_experts", "experts", "Experts the store serves (resident or on disk)"),
)
COMM_DROP_REASONS = (
    "garbage",
    "truncated",
    "version",
    "inconsistent",
    "no_memory",
)  # cpp/zmq_comm.h kDropNames


class CoordinatorMetrics:
    """The registry /metrics renders: request metrics, plus the runtimes' metrics when given a backend."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, backend: Any = None, *, per_layer: bool = True) -> None:
        # No `_created` twin of every counter and histogram: it doubles the series and no dashboard reads it.
        disable_created_metrics()  # process-wide, and only the coordinator exports metrics
        self.registry = r = CollectorRegistry()  # one per app: several servers in one process don't collide
        self.requests = Counter(
            "amoe_coordinator_requests", "Finished API requests by endpoint and outcome", ["endpoint", "outcome"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "amoe_coordinator_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("amoe_coordinator_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("amoe_requests_running", "Requests bound to an attention rank", registry=r)
        self.waiting = Gauge("amoe_requests_waiting", "Requests waiting for KV space", registry=r)
        self.finished = Counter("amoe_requests_finished", "Requests ended, by reason", ["reason"], registry=r)
        self.ttft = Histogram(
            "amoe_request_ttft_seconds", "Time to first token, from arrival at the load balancer", buckets=TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "amoe_request_itl_seconds", "Time between two output tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "amoe_request_e2e_seconds", "Request latency, arrival at the load balancer to last token", buckets=E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "amoe_request_queue_seconds", "Time waiting for KV space before running", buckets=E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        for reason in REASONS:  # exported at 0 from the start, so rate() and the dashboards see every reason
            self.finished.labels(reason)
        if backend is not None:
            r.register(RuntimeCollector(backend, per_layer=per_layer))

    def clock(self) -> RequestClock:
        """Start timing a request that has just arrived."""
        return RequestClock(self)

    def reject(self, endpoint: str, reason: str = "rejected") -> None:
        """A request that never ran: invalid, overloaded, or its client left while it waited."""
        self.requests.labels(endpoint, "error").inc()
        self.finished.labels(reason).inc()

    def render(self) -> bytes:
        return text_format(self.registry)


_PLAIN_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TEXT_TYPES = frozenset(("counter", "gauge", "histogram"))  # the kinds amoe exports


def text_format(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format of `registry`, byte for byte what prometheus_client's `generate_latest` writes
    for the families amoe exports (plain names, no `_created` samples), in a fraction of its time.

    Why not `generate_latest`: it validates and escapes every metric and label name of every sample, for UTF-8
    names; at 6 runtimes that was most of a /metrics request. amoe's names are plain (metric names are checked
    here once per family, label names are fixed in this module); label values are still escaped.
    """
    out = []
    for metric in registry.collect():
        if metric.type not in _TEXT_TYPES or not _PLAIN_NAME.fullmatch(metric.name):
            raise ValueError(
                f"text_format writes plain-named counters, gauges and histograms, not {metric!r}"
            )
        name = f"{metric.name}_total" if metric.type == "counter" else metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        for sample in metric.samples:
            value = floatToGoString(sample.value)
            if sample.labels:
                labels = ",".join([f'{k}="{_escape_value(v)}"' for k, v in sorted(sample.labels.items())])
                out.append(f"{sample.name}{{{labels}}} {value}\n")
            else:
                out.append(f"{sample.name} {value}\n")
    return "".join(out).encode()


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        value = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class RequestClock:
    """One request's timestamps, turned into the latency histograms as its tokens arrive."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics
        self.arrival = self._last = time.monotonic()
        self._num_tokens = 0

    def admitted(self) -> None:
        self._metrics.queue.observe(time.monotonic() - self.arrival)

    def tokens(self, n: int) -> None:
        """`n` new output tokens just arrived (in one delta)."""
        if n <= 0:
            return
        now = time.monotonic()
        if self._num_tokens == 0:
            self._metrics.ttft.observe(now - self.arrival)  # tokens delivered with the first have no interval
        else:
            for _ in range(n):  # several tokens in one delta share its interval, as vLLM does per step
                self._metrics.itl.observe((now - self._last) / n)
        self._num_tokens += n
        self._last = now

    def finished(self, reason: str) -> None:
        self._metrics.e2e.observe(time.monotonic() - self.arrival)
        self._metrics.finished.labels(reason if reason in REASONS else "error").inc()


class CounterOffsets:
    """Keeps runtime counters monotonic across runtime restarts (a restart zeroes the runtime's counters).

    A restart is a new `incarnation` in the report or any counter lower than last time; then every series of the
    runtime adds its last value to its offset. Series of runtimes that stopped reporting keep their last value, so
    sums over runtimes (expert routing) never go backwards either.
    """

    def __init__(self) -> None:
        self._series: dict[int, dict[tuple, list[float]]] = {}  # runtime -> series key -> [last raw, offset]
        self._incarnation: dict[int, Any] = {}
        self.restarts: dict[int, int] = {}

    def apply(self, runtime: int, incarnation: Any, raw: dict[tuple, float]) -> dict[tuple, float]:
        """The monotonic value of each series of one report."""
        series = self._series.setdefault(runtime, {})
        known = self._incarnation.get(runtime)
        restarted = incarnation is not None and known is not None and incarnation != known
        restarted = restarted or any(value < series[key][0] for key, value in raw.items() if key in series)
        if incarnation is not None:
            self._incarnation[runtime] = incarnation
        if restarted:
            self.restarts[runtime] = self.restarts.get(runtime, 0) + 1
            for state in series.values():
                state[1] += state[0]
                state[0] = 0.0
        out = {}
        for key, value in raw.items():
            state = series.setdefault(key, [0.0, 0.0])
            state[0] = value
            out[key] = value + state[1]
        return out

    def totals(self, name: str) -> dict[tuple, float]:
        """Series `(name, *labels)` summed over every runtime ever seen, keyed by labels."""
        out: dict[tuple, float] = {}
        for series in self._series.values():
            for key, (last, offset) in series.items():
                if key[0] == name:
                    out[key[1:]] = out.get(key[1:], 0.0) + last + offset
        return out


class RuntimeCollector:
    """Builds the runtime metric families from `backend.runtime_stats()` at every scrape."""

    def __init__(self, backend: Any, *, per_layer: bool = True) -> None:
        self._backend = backend
        self._per_layer = per_layer
        self._offsets = CounterOffsets()
        self._lock = threading.Lock()  # collect() keeps offsets; two scrapes at once must not interleave

    def describe(self) -> Iterable[Metric]:
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        reports = _runtime_stats(self._backend)
        fam = _Families()
        with self._lock:
            for report in sorted(reports, key=lambda rep: int(rep.get("runtime", -1))):
                self._add_report(fam, report)
            local = _local_offload(self._backend)
            if local is not None:  # the local engine's store: one process, runtime 0
                value = self._offsets.apply(0, "local", self._offload_counters(local))
                self._add_offload(fam, ("0", "local"), local, value)
            for (block, expert), value in sorted(self._offsets.totals("routed").items()):
                fam.routed.add_metric([block, expert], value)
        for rank, kv in enumerate(_kv_usage(self._backend)):
            fam.kv_used.add_metric([str(rank)], kv.total_blocks - kv.free_blocks)
            fam.kv_total.add_metric([str(rank)], kv.total_blocks)
        fam.control_dropped.add_metric([], getattr(self._backend, "control_dropped", 0))
        fam.control_send_failures.add_metric([], getattr(self._backend, "control_send_failures", 0))
        fam.rejected_handshakes.add_metric([], getattr(self._backend, "rejected_handshakes", 0))
        self._add_placement(fam, _placement(self._backend))
        self._add_scaling(fam, _shape(self._backend))
        fam.readmitted.add_metric([], getattr(self._backend, "readmitted", 0))
        fam.moved.add_metric([], getattr(self._backend, "moved", 0))
        recoveries = list(getattr(self._backend, "recoveries", ()))
        bounds = [*(str(float(b)) for b in RECOVERY_BUCKETS), "+Inf"]
        counts = [sum(1 for r in recoveries if r <= b) for b in RECOVERY_BUCKETS] + [len(recoveries)]
        fam.recovery.add_metric([], list(zip(bounds, map(float, counts))), float(sum(recoveries)))
        return fam.all()

    def _add_report(self, fam: _Families, report: dict[str, Any]) -> None:
        runtime = int(report.get("runtime", -1))
        rt = (str(runtime), str(report.get("role", "")))
        counters = self._counters(report)
        value = self._offsets.apply(runtime, report.get("incarnation"), counters)
        fam.up.add_metric(rt, 1)
        fam.restarts.add_metric(rt, self._offsets.restarts.get(runtime, 0))
        for (_, key, _), metric in zip(RUNTIME_GAUGES, fam.runtime_gauges):
            metric.add_metric(rt, float(report.get(key, 0)))
        for (name, _, _), metric in zip(RUNTIME_COUNTERS, fam.runtime_counters):
            metric.add_metric(rt, value[(name,)])
        for reason in _dropped(report.get("dropped")):
            fam.dropped.add_metric([*rt, reason], value[("dropped", reason)])
        for labels, depth in self._layers(report.get("depth"), runtime).items():
            fam.depth.add_metric(labels, depth)
        for key, v in value.items():
            if key[0] == "batches":
                fam.batches.add_metric(key[1:], v)
            elif key[0] == "rows":
                fam.rows.add_metric(key[1:], v)
        self._add_histogram(fam, rt[0], report.get("batch_rows"), value)
        comm = report.get("comm")
        if isinstance(comm, dict):
            for (name, _, _), metric in zip(COMM_COUNTERS, fam.comm_counters):
                metric.add_metric(rt, value[(name,)])
            for reason in _dropped(comm.get("dropped"), COMM_DROP_REASONS):
                fam.comm_dropped.add_metric([*rt, reason], value[("comm_dropped", reason)])
            failed = comm.get("failed_peers", 0)
            fam.failed_peers.add_metric(rt, len(failed) if isinstance(failed, (list, tuple)) else failed)
        if isinstance(report.get("offload"), dict):
            self._add_offload(fam, rt, report["offload"], value)

    def _add_placement(self, fam: _Families, placement: dict[str, Any] | None) -> None:
        """The live expert map (docs/rebalancing.md): epoch, rebalances, bytes, joins and drains, replicas and
        balancedness per block (summed, or averaged, over blocks without per-layer metrics)."""
        if placement is None:
            return
        counters = placement["counters"]
        fam.placement_epoch.add_metric([], placement["epoch"])
        for outcome, n in counters.rebalances.items():
            fam.rebalances.add_metric([outcome], n)
        fam.moved_bytes.add_metric([], counters.moved_bytes)
        fam.freed_bytes.add_metric([], counters.freed_bytes)
        fam.joined_layers.add_metric([], counters.joins)
        fam.drained_layers.add_metric([], counters.drains)
        replicas, balance = placement["replicas"], placement["balancedness"]
        if self._per_layer:
            for block, row in enumerate(replicas):
                for expert, n in enumerate(row):
                    fam.replicas.add_metric([str(block), str(expert)], float(n))
            for block, b in enumerate(balance):
                fam.balancedness.add_metric([str(block)], b)
            return
        for expert, n in enumerate(replicas.sum(axis=0)):
            fam.replicas.add_metric(["", str(expert)], float(n))
        if balance:
            fam.balancedness.add_metric([""], sum(balance) / len(balance))

    @staticmethod
    def _add_scaling(fam: _Families, shape: dict[str, Any] | None) -> None:
        """Elastic runtimes (docs/rebalancing.md "Scaling"): the runtimes serving, joins, drains, failures."""
        if shape is None:
            return
        for role in ("attention", "expert"):
            fam.runtimes.add_metric([role], shape[f"{role}_runtimes"])
            fam.joins.add_metric([role], shape["joins"][role])
            fam.drains.add_metric([role], shape["drains"][role])
        for action, n in shape["failed"].items():
            fam.scale_failures.add_metric([action], n)

    @staticmethod
    def _offload_counters(offload: dict[str, Any]) -> dict[tuple, float]:
        return {(name,): float(offload.get(key, 0)) for name, key, _ in OFFLOAD_COUNTERS}

    @staticmethod
    def _add_offload(fam: _Families, rt: tuple, offload: dict[str, Any], value: dict[tuple, float]) -> None:
        for (name, _, _), metric in zip(OFFLOAD_COUNTERS, fam.offload_counters):
            metric.add_metric(rt, value[(name,)])
        for (_, key, _), metric in zip(OFFLOAD_GAUGES, fam.offload_gauges):
            metric.add_metric(rt, float(offload.get(key, 0)))

    def _counters(self, report: dict[str, Any]) -> dict[tuple, float]:
        """Every counter of one report, raw, keyed (name, *labels)."""
        runtime = int(report.get("runtime", -1))
        out: dict[tuple, float] = {(name,): float(report.get(key, 0)) for name, key, _ in RUNTIME_COUNTERS}
        for reason, n in _dropped(report.get("dropped")).items():
            out[("dropped", reason)] = float(n)
        for name in ("batches", "rows"):
            for labels, n in self._layers(report.get(name), runtime).items():
                out[(name, *labels)] = n
        comm = report.get("comm")
        if isinstance(comm, dict):
            out.update({(name,): float(comm.get(key, 0)) for name, key, _ in COMM_COUNTERS})
            for reason, n in _dropped(comm.get("dropped"), COMM_DROP_REASONS).items():
                out[("comm_dropped", reason)] = float(n)
        if isinstance(report.get("offload"), dict):
            out.update(self._offload_counters(report["offload"]))
        hist = report.get("batch_rows")
        if isinstance(hist, dict):
            for kind, counts in hist.get("counts", {}).items():
                for i, n in enumerate(counts):
                    out[("hist_bucket", kind, i)] = float(n)
                out[("hist_sum", kind)] = float(hist.get("sum", {}).get(kind, 0))
        for block, per_expert in enumerate(report.get("routed") or ()):
            for expert, n in enumerate(per_expert):  # not per layer: one series per expert, blocks summed
                key = ("routed", str(block) if self._per_layer else "", str(expert))
                out[key] = out.get(key, 0.0) + float(n)
        return out

    def _layers(self, layer_map: Any, runtime: int) -> dict[tuple, float]:
        """LayerID-keyed values by (runtime, block, expert, rank) labels, or summed per runtime."""
        out: dict[tuple, float] = {}
        for (kind, block, index), n in _layer_items(layer_map):
            if self._per_layer:
                labels = (
                    str(runtime),
                    str(block),
                    *((str(index), "") if kind == "expert" else ("", str(index))),
                )
            else:
                labels = (str(runtime), "", "", "")
            out[labels] = out.get(labels, 0.0) + float(n)
        return out

    @staticmethod
    def _add_histogram(fam: _Families, runtime: str, hist: Any, value: dict[tuple, float]) -> None:
        if not isinstance(hist, dict):
            return
        bounds = [*(str(float(b)) for b in hist.get("buckets", ())), "+Inf"]
        for kind in sorted(hist.get("counts", {})):
            cumulative, buckets = 0.0, []
            for i, bound in enumerate(bounds):
                cumulative += value.get(("hist_bucket", kind, i), 0.0)
                buckets.append((bound, cumulative))
            fam.batch_rows.add_metric([runtime, kind], buckets, value.get(("hist_sum", kind), 0.0))


class _Families:
    """The runtime metric families of one scrape."""

    def __init__(self) -> None:
        self._runtime_families()
        self._comm_families()
        self._cluster_families()
        self._placement_families()
        rt = ["runtime", "role"]
        self.offload_counters = [CounterMetricFamily(n, h, labels=rt) for n, _, h in OFFLOAD_COUNTERS]
        self.offload_gauges = [GaugeMetricFamily(n, h, labels=rt) for n, _, h in OFFLOAD_GAUGES]
        self.kv_used = GaugeMetricFamily("amoe_kv_used_blocks", "KV-cache blocks in use", labels=["rank"])
        self.kv_total = GaugeMetricFamily("amoe_kv_total_blocks", "KV-cache blocks", labels=["rank"])

    def _runtime_families(self) -> None:
        """What each runtime reports of itself: liveness, its counters and gauges, its queues and batches."""
        rt = ["runtime", "role"]
        self.up = GaugeMetricFamily("amoe_runtime_up", "1 for every runtime with a report", labels=rt)
        self.restarts = CounterMetricFamily(
            "amoe_runtime_restarts", "Restarts the coordinator saw in a runtime's reports", labels=rt
        )
        self.runtime_gauges = [GaugeMetricFamily(n, h, labels=rt) for n, _, h in RUNTIME_GAUGES]
        self.runtime_counters = [CounterMetricFamily(n, h, labels=rt) for n, _, h in RUNTIME_COUNTERS]
        self.dropped = CounterMetricFamily(
            "amoe_runtime_dropped_inputs", "Malformed or misrouted input the receptor dropped, by reason",
            labels=[*rt, "reason"],
        )  # fmt: skip
        self.depth = GaugeMetricFamily(
            "amoe_runtime_queue_depth_tokens", "Tokens waiting in a mu-queue", labels=LAYER_LABELS
        )
        self.batches = CounterMetricFamily(
            "amoe_runtime_executed_batches", "Batches the runtime executed, by layer", labels=LAYER_LABELS
        )
        self.rows = CounterMetricFamily(
            "amoe_runtime_executed_rows", "Rows (tokens) the runtime executed, by layer", labels=LAYER_LABELS
        )
        self.batch_rows = HistogramMetricFamily(
            "amoe_runtime_batch_size_rows",
            "Rows per executed batch, by layer kind",
            labels=["runtime", "kind"],
        )

    def _comm_families(self) -> None:
        """Each runtime's communicator, and the routers' tokens per (block, expert)."""
        rt = ["runtime", "role"]
        self.comm_counters = [CounterMetricFamily(n, h, labels=rt) for n, _, h in COMM_COUNTERS]
        self.comm_dropped = CounterMetricFamily(
            "amoe_comm_dropped_messages", "Inbound messages the communicator dropped, by reason",
            labels=[*rt, "reason"],
        )  # fmt: skip
        self.failed_peers = GaugeMetricFamily(
            "amoe_comm_failed_peers", "Peers this runtime's communicator marked failed", labels=rt
        )
        self.routed = CounterMetricFamily(
            "amoe_expert_routed_tokens",
            "Tokens the routers sent to each (block, expert)",
            labels=["block", "expert"],
        )

    def _cluster_families(self) -> None:
        """The coordinator's control plane and the cluster's recoveries."""
        self.control_dropped = CounterMetricFamily(
            "amoe_coordinator_control_dropped_messages",
            "Control-plane messages the coordinator dropped (malformed, out of range, or from the wrong socket)",
        )
        self.control_send_failures = CounterMetricFamily(
            "amoe_coordinator_control_send_failures",
            "Control-plane messages ZeroMQ could not take at once (no connection, a full queue); each is retried in order",
        )
        self.rejected_handshakes = CounterMetricFamily(
            "amoe_coordinator_rejected_handshakes",
            "Connections to the control plane's CURVE endpoint refused: no CURVE, or not the cluster's keys",
        )
        self.readmitted = CounterMetricFamily(
            "amoe_cluster_readmitted_requests",
            "Requests admitted again (prompt + tokens so far) after their attention runtime was lost",
        )
        self.moved = CounterMetricFamily(
            "amoe_cluster_moved_requests",
            "Of those, admitted on another attention rank: theirs was not serving within server.failover_after_s",
        )
        self.recovery = HistogramMetricFamily(
            "amoe_cluster_recovery_seconds", "Seconds from a runtime's loss to its replacement serving"
        )
        self.runtimes = GaugeMetricFamily(
            "amoe_cluster_runtimes",
            "Runtimes serving, by role (amoe scale adds and removes them)",
            labels=["role"],
        )
        self.joins = CounterMetricFamily(
            "amoe_cluster_runtime_joins",
            "Runtimes that joined while serving and took their replicas",
            labels=["role"],
        )
        self.drains = CounterMetricFamily(
            "amoe_cluster_runtime_drains", "Runtimes drained (every row answered) and stopped while serving",
            labels=["role"],
        )  # fmt: skip
        self.scale_failures = CounterMetricFamily(
            "amoe_cluster_scale_failures", "Joins and drains that failed (the cluster served on as it was)",
            labels=["action"],
        )  # fmt: skip

    def _placement_families(self) -> None:
        """The live expert map's (docs/rebalancing.md)."""
        self.placement_epoch = GaugeMetricFamily(
            "amoe_placement_epoch", "Epoch of the expert map the attention runtimes route by (+1 per change)"
        )
        self.rebalances = CounterMetricFamily(
            "amoe_placement_rebalances", "Rebalances by outcome: started, completed, failed (the old map serves "
            "on), unchanged (the map was already the best one)", labels=["outcome"],
        )  # fmt: skip
        self.moved_bytes = CounterMetricFamily(
            "amoe_placement_moved_bytes", "Expert weight bytes loaded by joins (new replicas)"
        )
        self.freed_bytes = CounterMetricFamily(
            "amoe_placement_freed_bytes", "Expert weight bytes freed by drains (retired replicas)"
        )
        self.joined_layers = CounterMetricFamily(
            "amoe_placement_joined_layers",
            "Replicas (block, expert) that joined: weights landed, rows follow",
        )
        self.drained_layers = CounterMetricFamily(
            "amoe_placement_drained_layers",
            "Replicas (block, expert) drained: every row answered, weights freed",
        )
        self.replicas = GaugeMetricFamily(
            "amoe_placement_replicas",
            "Replicas of each (block, expert) in the map",
            labels=["block", "expert"],
        )
        self.balancedness = GaugeMetricFamily(
            "amoe_placement_balancedness_ratio",
            "vLLM's balancedness per block: mean / max expert-runtime load over the last window_size steps (1: even)",
            labels=["block"],
        )

    def all(self) -> list[Metric]:
        return [
            self.up, self.restarts, *self.runtime_gauges, *self.runtime_counters, self.dropped, self.depth,
            self.batches, self.rows, self.batch_rows, *self.comm_counters, self.comm_dropped, self.failed_peers,
            self.routed, self.kv_used, self.kv_total, self.control_dropped, self.control_send_failures,
            self.rejected_handshakes,
            self.readmitted, self.moved, self.recovery, self.runtimes, self.joins, self.drains, self.scale_failures,
            *self.offload_counters, *self.offload_gauges,
            self.placement_epoch, self.rebalances, self.moved_bytes, self.freed_bytes, self.joined_layers,
            self.drained_layers, self.replicas, self.balancedness,
        ]  # fmt: skip


def _runtime_stats(backend: Any) -> list[dict[str, Any]]:
    """The latest report per runtime; a backend without runtimes (the local one) has none."""
    runtime_stats = getattr(backend, "runtime_stats", None)
    return list(runtime_stats()) if runtime_stats is not None else []


def _placement(backend: Any) -> dict[str, Any] | None:
    """The live placement's numbers (ClusterBackend.placement_metrics), where experts can move."""
    placement_metrics = getattr(backend, "placement_metrics", None)
    return placement_metrics() if placement_metrics is not None else None


def _shape(backend: Any) -> dict[str, Any] | None:
    """The runtimes serving and their joins and drains (ClusterBackend.shape), where runtimes can join."""
    shape = getattr(backend, "shape", None)
    return shape() if shape is not None else None


def _local_offload(backend: Any) -> dict[str, Any] | None:
    """The local backend's expert store counters, when it offloads."""
    offload_stats = getattr(backend, "offload_stats", None)
    return offload_stats() if offload_stats is not None else None


def _kv_usage(backend: Any) -> list[Any]:
    kv_usage = getattr(backend, "kv_usage", None)
    return list(kv_usage()) if kv_usage is not None else []


def _layer_items(layer_map: Any) -> Iterator[tuple[tuple[str, int, int], float]]:
    """(LayerID, value) pairs from Engine.stats()'s tuple keys or amoe.wire's flattened [kind, block, index, v]."""
    if isinstance(layer_map, dict):
        yield from ((tuple(layer), value) for layer, value in layer_map.items())
    elif isinstance(layer_map, (list, tuple)):
        yield from (((kind, block, index), value) for kind, block, index, value in layer_map)


def _dropped(dropped: Any, names: tuple[str, ...] = ()) -> dict[str, float]:
    """Drop counts by reason, from a dict or a list in the order of `names`."""
    if isinstance(dropped, dict):
        return {str(reason): float(n) for reason, n in dropped.items()}
    if isinstance(dropped, (list, tuple)):
        return {name: float(n) for name, n in zip(names, dropped)}
    return {}
