"""A real Prometheus (Debian's `prometheus`, on loopback, scraping every second) scrapes a live `amoe serve` with
6 runtimes under a steady load: every PromQL expression of every dashboard panel returns series, the dashboard
names only exported metrics, counters only grow, /metrics stays bounded; `amoe queues` shows the queues.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from metrics_support import REPO, Load, series_bound, serve_model
from prometheus_client.parser import text_string_to_metric_families

from amoe.model.make import make_model
from amoe.testing.servers import ServerProcess

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "amoe.json"
SHAPE = (4, 8, 2, 4)  # tiny preset: blocks, experts; 2 attention + 4 expert runtimes
# Grafana's variables, as the test substitutes them: all runtimes; a window of ~15 scrapes.
VARIABLES = {
    "$__rate_interval": "15s",
    "$__interval": "5s",
    "$__range": "5m",
    "${runtime}": ".*",
    "$runtime": ".*",
}
METRIC = re.compile(r"\bamoe_[a-z0-9_]+")


def dashboard_targets(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def unknown_metrics(targets: list[tuple[str, str]], exported: set[str]) -> list[str]:
    """Metric names a query uses that the server does not export (histograms: _bucket/_sum/_count of a family)."""
    known = exported | {f"{n}{s}" for n in exported for s in ("_bucket", "_sum", "_count")}
    return sorted(
        {f"{title}: {m}" for title, expr in targets for m in METRIC.findall(expr) if m not in known}
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server of our own on a free loopback port, scraping `target` every second."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: amoe\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = workdir / "prometheus.log"
        for _ in range(5):  # the port found free may be taken before Prometheus binds it: try another
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    [
                        PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                    ],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            if self._wait_ready(30):
                return
            if "address already in use" not in self.log.read_text():
                self.stop()
                raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")
            self.stop()
        raise AssertionError("no free port for prometheus after 5 tries")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return False

    def query(self, expr: str) -> list[dict]:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert reply["status"] == "success", f"{expr}: {reply.get('error')}"
        return reply["data"]["result"]

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    def label_values(self, label: str, match: str) -> list[str]:
        reply = httpx.get(
            f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}, timeout=10
        ).json()
        return reply["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Live:
    """The server, Prometheus and the load, as the module's tests see them."""

    def __init__(self, server: ServerProcess, prom: Prometheus, load: Load) -> None:
        self.server, self.prom, self.load = server, prom, load

    def metrics(self) -> str:
        return httpx.get(f"{self.server.url}/metrics", timeout=5).text


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if PROMETHEUS is None:
        message = "the prometheus binary is missing (Debian package `prometheus`; `make install` installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    model = make_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)
    server = serve_model(model, "--attn-ranks", "2", "--expert-ranks", "4", "--server-drain-timeout-s", "1")
    prom = None
    try:
        url = server.wait_for_url()
        prom = Prometheus(url.removeprefix("http://"), tmp_path_factory.mktemp("prometheus"))
        with Load(url, "tiny", clients=4) as load:
            live = Live(server, prom, load)
            _wait_for_scrapes(live, scrapes=6)
            yield live
        assert not load.errors, load.errors[:3]
    finally:
        if prom is not None:
            prom.stop()
        server.stop()


def _wait_for_scrapes(live: Live, scrapes: int, timeout: float = 60) -> None:
    """Until Prometheus holds `scrapes` samples taken under load, with requests finished among them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = live.prom.scalar("count_over_time(amoe_requests_running[1m])")
        finished = live.prom.scalar('sum(amoe_requests_finished_total{reason="length"})')
        if samples >= scrapes and finished > 0 and live.load.completed > 0:
            return
        time.sleep(0.5)
    raise AssertionError(
        f"not enough scrapes under load; server log:\n{chr(10).join(live.server.lines[-20:])}"
    )


@pytest.mark.timeout(180)
def test_every_dashboard_query_returns_series(live):
    assert live.prom.scalar('up{job="amoe"}') == 1
    targets = dashboard_targets()
    assert len(targets) >= 25
    empty = [f"{title}: {expr}" for title, expr in targets if not live.prom.query(substitute(expr))]
    assert not empty, "dashboard queries without a series:\n" + "\n".join(empty)
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["query"]).groups()
            assert sorted(live.prom.label_values(label, metric), key=int) == [str(r) for r in range(6)]


def test_the_dashboard_names_only_exported_metrics(live):
    exported = {f.name for f in text_string_to_metric_families(live.metrics())}
    exported |= {f"{name}_total" for name in exported}  # the parser names counter families without _total
    assert not unknown_metrics(dashboard_targets(), exported)
    bogus = [("Typo", "sum(rate(amoe_runtime_busy_second_total[1m]))")]
    assert unknown_metrics(bogus, exported) == ["Typo: amoe_runtime_busy_second_total"]


def test_the_dashboard_json_is_what_the_generator_makes():
    spec = importlib.util.spec_from_file_location("make_dashboard", REPO / "deploy/grafana/make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == DASHBOARD.read_text(), "run python deploy/grafana/make_dashboard.py"


def test_the_shipped_scrape_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package `prometheus`) is missing")
    check = subprocess.run(
        [promtool, "check", "config", str(REPO / "deploy/prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_counters_only_increase(live):
    def counters(text: str) -> dict:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            if f.type in ("counter", "histogram")
            for s in f.samples
        }

    before = counters(live.metrics())
    time.sleep(1.0)
    after = counters(live.metrics())
    went_down = [(k, v, after[k]) for k, v in before.items() if k in after and after[k] < v]
    assert not went_down
    assert any(after[k] > v for k, v in before.items() if k in after)
    # Prometheus saw no counter reset in any amoe counter series during the whole run.
    names = {name for name, _ in after if name.startswith("amoe_")}
    assert {name: live.prom.scalar(f"sum(resets({name}[5m]))") for name in sorted(names)} == dict.fromkeys(
        sorted(names), 0.0
    )


def test_metrics_endpoint_is_bounded(live):
    # Its speed under this load is a target of bench/metrics_endpoint.py, not of a timed test on a shared machine.
    text = httpx.get(f"{live.server.url}/metrics", timeout=10).text
    num_series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    assert num_series <= series_bound(*SHAPE, per_layer=True)
    assert live.prom.scalar('scrape_samples_scraped{job="amoe"}') <= series_bound(*SHAPE, per_layer=True)


def test_amoe_queues_once_shows_every_runtime(live):
    out = subprocess.run(
        [sys.executable, "-m", "amoe", "queues", "--url", live.server.url, "--once"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # not a terminal: no screen clearing
    rows = [
        line.split() for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+(attention|expert)\s", line)
    ]
    assert [int(r[0]) for r in rows] == list(range(6))
    assert "expert mu-queues" in out.stdout and "e7" in out.stdout
