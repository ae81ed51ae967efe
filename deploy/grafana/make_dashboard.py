"""Generates the Grafana dashboard of amoe (dashboards/amoe.json) from the metrics of docs/metrics.md.

    python deploy/grafana/make_dashboard.py          # rewrite dashboards/amoe.json
    python deploy/grafana/make_dashboard.py --check  # exit 1 if the JSON is not what this script makes

Every panel target is a PromQL expression over the Prometheus data source chosen by `$datasource`; `$runtime`
filters per-runtime panels (a regex: "All" is `.*`). tests/test_metrics_prometheus.py runs every expression
against a real Prometheus scraping a live server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "amoe.json"
UID = "amoe-serving"
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
RT = 'runtime=~"$runtime"'


def rate(metric: str, by: str, selector: str = RT) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def quantiles(metric: str, by: str = "", selector: str = "") -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram, optionally per label `by`."""
    group = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"{legend}p{p}",
        )
        for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))
    ]


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._x = self._y = 0
        self._row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": self._pos(24, 1)}
        )
        self._y += 1

    def add(self, panel: dict[str, Any], w: int = 12, h: int = 8) -> None:
        if self._x + w > 24:
            self._newline()
        panel["gridPos"] = self._pos(w, h)
        self._x += w
        self._row_h = max(self._row_h, h)
        self.panels.append(panel)

    def _pos(self, w: int, h: int) -> dict[str, int]:
        return {"x": self._x, "y": self._y, "w": w, "h": h}

    def _newline(self) -> None:
        self._y += self._row_h
        self._x = self._row_h = 0


def panel(
    kind: str, title: str, targets: list[tuple[str, str]], *, unit: str = "short", desc: str = "", **extra
):
    out = {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }
    out.update(extra)
    return out


def heatmap(title: str, expr: str, legend: str, desc: str) -> dict[str, Any]:
    """Series as rows (one per block × expert), time as columns, value as colour (Grafana >= 9.1)."""
    return panel(
        "heatmap", title, [(expr, legend)], desc=desc,
        options={
            "calculate": False,
            "yAxis": {"axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "cellGap": 1,
            "tooltip": {"show": True, "yHistogram": False},
            "legend": {"show": True},
        },
    )  # fmt: skip


def requests(lay: Layout) -> None:
    lay.row("Requests")
    lay.add(panel("timeseries", "Requests running / waiting", [
        ("sum(amoe_requests_running)", "running"), ("sum(amoe_requests_waiting)", "waiting for KV"),
    ], desc="vLLM's num_requests_running / num_requests_waiting"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Token throughput", [
        ("sum(rate(amoe_coordinator_generation_tokens_total[$__rate_interval]))", "generated tokens/s"),
        ("sum(rate(amoe_coordinator_prompt_tokens_total[$__rate_interval]))", "prompt tokens/s"),
    ], unit="short", desc="Tokens per second through the API"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Requests finished by reason", [
        ("sum by (reason) (rate(amoe_requests_finished_total[$__rate_interval]))", "{{reason}}"),
    ], unit="reqps", desc="stop / length / abort / error / rejected (invalid or overloaded)"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Time to first token", quantiles("amoe_request_ttft_seconds"), unit="s"), w=6)
    lay.add(panel("timeseries", "Inter-token latency", quantiles("amoe_request_itl_seconds"), unit="s"), w=6)
    lay.add(panel("timeseries", "End-to-end latency", quantiles("amoe_request_e2e_seconds"), unit="s"), w=6)
    lay.add(
        panel("timeseries", "Queue time (waiting for KV)", quantiles("amoe_request_queue_seconds"), unit="s"),
        w=6,
    )


def kv_and_errors(lay: Layout) -> None:
    lay.row("KV cache and errors")
    lay.add(panel("timeseries", "KV-cache usage per DP rank", [
        ("sum by (rank) (amoe_kv_used_blocks) / sum by (rank) (amoe_kv_total_blocks)", "rank {{rank}}"),
    ], unit="percentunit", desc="Used / total KV blocks of each attention rank"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Request errors", [
        ('sum by (reason) (rate(amoe_requests_finished_total{reason=~"error|rejected|abort"}[$__rate_interval]))',
         "{{reason}}"),
    ], unit="reqps"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Runtime errors, drops and restarts", [
        (f"sum by (runtime) (increase(amoe_runtime_engine_errors_total{{{RT}}}[{RATE}]))", "engine errors rt {{runtime}}"),
        (f"sum by (runtime, reason) (increase(amoe_runtime_dropped_inputs_total{{{RT}}}[{RATE}]))",
         "dropped {{reason}} rt {{runtime}}"),
        (f"sum by (runtime) (increase(amoe_runtime_restarts_total{{{RT}}}[{RATE}]))", "restarts rt {{runtime}}"),
    ], desc="Exceptions on engine threads, malformed or misrouted input, runtime restarts"), w=8)  # fmt: skip


def queues(lay: Layout) -> None:
    lay.row("mu-queues")
    lay.add(panel("timeseries", "Queue depth per runtime", [
        (f"sum by (runtime) (amoe_runtime_queue_depth_tokens{{{RT}}})", "runtime {{runtime}}"),
    ], desc="Tokens waiting in the mu-queues of each runtime"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Token pool", [
        (f"sum by (runtime) (amoe_runtime_pool_parts{{{RT}}})", "parts rt {{runtime}}"),
        (f"sum by (runtime) (amoe_runtime_pool_entries{{{RT}}})", "chunks rt {{runtime}}"),
        (f"sum by (runtime) (amoe_runtime_dispatch_pending_jobs{{{RT}}})", "dispatch jobs rt {{runtime}}"),
    ], desc="Parts waiting for the rest of their token; outputs waiting for the dispatcher"), w=12)  # fmt: skip
    lay.add(heatmap(
        "Expert queue depth, block x expert",
        'sum by (block, expert) (amoe_runtime_queue_depth_tokens{expert!=""})', "b{{block}} e{{expert}}",
        "Tokens waiting per (block, expert) mu-queue; needs server.metrics_per_layer (the default)",
    ), w=12, h=10)  # fmt: skip
    lay.add(heatmap(
        "Attention queue depth, block x rank",
        'sum by (block, rank) (amoe_runtime_queue_depth_tokens{rank!=""})', "b{{block}} r{{rank}}",
        "Tokens waiting per (block, attention rank); block = number of blocks is the head",
    ), w=12, h=10)  # fmt: skip


def execution(lay: Layout) -> None:
    lay.row("Execution")
    lay.add(panel("timeseries", "Rows per batch", [
        *quantiles("amoe_runtime_batch_size_rows", by="kind", selector=RT),
        (f"sum by (kind) (rate(amoe_runtime_batch_size_rows_sum{{{RT}}}[{RATE}])) / "
         f"sum by (kind) (rate(amoe_runtime_batch_size_rows_count{{{RT}}}[{RATE}]))", "{{kind}} mean"),
    ], desc="Batch sizes by layer kind (attn, head, expert)"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Executed rows per runtime", [
        (rate("amoe_runtime_executed_rows_total", "runtime"), "runtime {{runtime}}"),
    ], unit="short", desc="Rows (tokens) per second through each runtime's layers"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Stall fraction per runtime", [
        (rate("amoe_runtime_idle_seconds_total", "runtime"), "runtime {{runtime}}"),
    ], unit="percentunit", desc="Share of wall time the runtime loop waited for work"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Busy fraction per runtime", [
        (rate("amoe_runtime_busy_seconds_total", "runtime"), "runtime {{runtime}}"),
    ], unit="percentunit", desc="Share of wall time the executor ran layers"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Executed batches per runtime", [
        (rate("amoe_runtime_executed_batches_total", "runtime"), "runtime {{runtime}}"),
    ], unit="short"), w=12)  # fmt: skip


def experts(lay: Layout) -> None:
    lay.row("Expert load")
    per_expert = f"sum by (expert) (rate(amoe_expert_routed_tokens_total[{RATE}]))"
    lay.add(panel("timeseries", "Tokens routed per expert", [(per_expert, "expert {{expert}}")],
                  desc="Router choices per second, all blocks"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Expert load skew (max / mean)", [
        (f"max({per_expert}) / avg({per_expert})", "all blocks"),
        (f"max by (block) (rate(amoe_expert_routed_tokens_total[{RATE}])) / "
         f"avg by (block) (rate(amoe_expert_routed_tokens_total[{RATE}]))", "block {{block}}"),
    ], desc="1 = perfectly balanced; k = the hottest expert gets k times the mean"), w=8)  # fmt: skip
    lay.add(heatmap(
        "Routed tokens, block x expert",
        f"sum by (block, expert) (rate(amoe_expert_routed_tokens_total[{RATE}]))", "b{{block}} e{{expert}}",
        "Router choices per second per (block, expert)",
    ), w=8)  # fmt: skip


def placement(lay: Layout) -> None:
    lay.row("Placement (redundant experts, rebalancing)")
    lay.add(panel("timeseries", "Balancedness per block", [
        ("amoe_placement_balancedness_ratio", "block {{block}}"),
        ("avg(amoe_placement_balancedness_ratio)", "mean"),
    ], unit="percentunit", desc="vLLM's balancedness: mean / max expert-runtime load over the last window_size steps "
                                "(1 = even); rebalancing raises it"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Rebalances", [
        (f"sum by (outcome) (increase(amoe_placement_rebalances_total[{RATE}]))", "{{outcome}}"),
        ("max(amoe_placement_epoch)", "map epoch"),
    ], desc="Started, completed, failed (the old map served on), unchanged (already the best map)"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Weights moved", [
        (f"sum(rate(amoe_placement_moved_bytes_total[{RATE}]))", "loaded by joins"),
        (f"sum(rate(amoe_placement_freed_bytes_total[{RATE}]))", "freed by drains"),
    ], unit="Bps", desc="Expert weight bytes per second that joins loaded and drains freed"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Joins and drains", [
        (f"sum(increase(amoe_placement_joined_layers_total[{RATE}]))", "replicas joined"),
        (f"sum(increase(amoe_placement_drained_layers_total[{RATE}]))", "replicas drained"),
    ], desc="(block, expert) replicas whose weights landed / whose rows were all answered and weights freed"),
            w=8)  # fmt: skip
    lay.add(heatmap(
        "Replicas, block x expert", "sum by (block, expert) (amoe_placement_replicas)", "b{{block}} e{{expert}}",
        "Replicas of each (block, expert) in the live expert map",
    ), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Rows served by each replica (top 10)", [
        (f'topk(10, sum by (runtime, block, expert) (rate(amoe_runtime_executed_rows_total{{expert!="",{RT}}}'
         f"[{RATE}])))", "rt {{runtime}} b{{block}} e{{expert}}"),
    ], desc="A replica is a (runtime, block, expert) queue: the rows each executed per second"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Runtimes: serving, joins, drains", [
        ("sum by (role) (amoe_cluster_runtimes)", "{{role}} runtimes"),
        (f"sum by (role) (increase(amoe_cluster_runtime_joins_total[{RATE}]))", "{{role}} joined"),
        (f"sum by (role) (increase(amoe_cluster_runtime_drains_total[{RATE}]))", "{{role}} drained"),
        (f"sum by (action) (increase(amoe_cluster_scale_failures_total[{RATE}]))", "{{action}} failed"),
    ], desc="Elastic runtimes (amoe scale): runtimes serving by role, runtimes that joined (took replicas) or were "
            "drained and stopped, and joins or drains that failed (the cluster served on as it was)"),
            w=8)  # fmt: skip


def transfers(lay: Layout) -> None:
    lay.row("Transfers")
    lay.add(panel("timeseries", "Bytes per second", [
        (rate("amoe_comm_sent_bytes_total", "runtime"), "sent rt {{runtime}}"),
        (rate("amoe_comm_received_bytes_total", "runtime"), "received rt {{runtime}}"),
    ], unit="Bps", desc="Communicator traffic between runtimes"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Messages per second", [
        (rate("amoe_comm_sent_messages_total", "runtime"), "sent rt {{runtime}}"),
        (rate("amoe_comm_received_messages_total", "runtime"), "received rt {{runtime}}"),
        (rate("amoe_runtime_sent_tokens_total", "runtime"), "tokens sent rt {{runtime}}"),
    ], unit="short"), w=8)  # fmt: skip
    lay.add(panel("timeseries", "Dropped / garbled messages, timeouts, failed peers", [
        (f"sum by (runtime, reason) (increase(amoe_comm_dropped_messages_total{{{RT}}}[{RATE}]))",
         "{{reason}} rt {{runtime}}"),
        (f"sum by (runtime) (increase(amoe_comm_timeouts_total{{{RT}}}[{RATE}]))", "timeouts rt {{runtime}}"),
        (f"sum by (runtime) (amoe_comm_failed_peers{{{RT}}})", "failed peers rt {{runtime}}"),
    ]), w=8)  # fmt: skip


def variables() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        {"name": "runtime", "label": "Runtime", "type": "query", "datasource": DS,
         "query": "label_values(amoe_runtime_up, runtime)", "definition": "label_values(amoe_runtime_up, runtime)",
         "multi": True, "includeAll": True, "allValue": ".*", "refresh": 2, "sort": 3,
         "current": {"text": "All", "value": "$__all"}, "hide": 0},
    ]  # fmt: skip


def healing(lay: Layout) -> None:
    lay.row("Self-healing")
    lay.add(panel("timeseries", "Replacements and what they took", [
        (f"sum by (runtime) (increase(amoe_runtime_restarts_total{{{RT}}}[{RATE}]))", "restarts rt {{runtime}}"),
        (f"sum(increase(amoe_cluster_readmitted_requests_total[{RATE}]))", "requests re-admitted"),
        (f"sum by (runtime) (increase(amoe_runtime_resent_rows_total{{{RT}}}[{RATE}]))", "rows re-sent by rt {{runtime}}"),
    ], desc="Runtimes replaced, requests moved to a replaced attention runtime (re-prefilled), rows sent again to a "
            "replaced expert runtime"), w=12)  # fmt: skip
    lay.add(panel("timeseries", "Recovery time (loss to replacement serving)",
                  quantiles("amoe_cluster_recovery_seconds"), unit="s"), w=12)  # fmt: skip


def build() -> dict[str, Any]:
    """The dashboard as a dict (Grafana's JSON model)."""
    lay = Layout()
    for section in (requests, kv_and_errors, queues, execution, experts, placement, transfers, healing):
        section(lay)
    for i, p in enumerate(lay.panels, start=1):
        p["id"] = i
    return {
        "uid": UID,
        "title": "amoe serving",
        "description": "amoe: requests, KV cache, mu-queues, batches, stalls, expert load, placement, transfers",
        "tags": ["amoe"],
        "timezone": "",
        "schemaVersion": 38,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if dashboards/amoe.json is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
