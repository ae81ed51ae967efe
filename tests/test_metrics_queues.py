"""`amoe queues`: parsing a /metrics page, the frames it draws, refreshing, and one-line errors; and the
server.metrics_per_layer setting. (The live view of a real server is in test_metrics_prometheus.py.)"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from metrics_support import FakeBackend, attention_report

from amoe import queue_viewer as queues
from amoe.config import AmoeConfig, ServerSection, add_config_flags, config_from_args
from amoe.errors import ConfigError
from coordinator.metrics import CoordinatorMetrics


def page(per_layer: bool = True, busy: float = 0.5, uptime: float = 10.0) -> str:
    expert = attention_report(runtime=1, comm=False)
    expert.update(role="expert", routed=None, depth={("expert", 0, 3): 7, ("expert", 1, 3): 2}, busy_s=busy)
    expert["uptime_s"] = uptime
    attention = attention_report(runtime=0)
    return CoordinatorMetrics(FakeBackend([attention, expert]), per_layer=per_layer).render().decode()


def test_parse_reads_depths_per_runtime_and_per_queue():
    snap = queues.parse(page())
    assert {rt: (r.role, r.depth) for rt, r in snap.runtimes.items()} == {
        0: ("attention", 3),
        1: ("expert", 9),
    }
    assert snap.experts == {(0, 3): 7, (1, 3): 2}
    assert snap.attention == {(0, 0): 1, (1, 0): 1, (2, 0): 1}
    assert snap.runtimes[0].pool_parts == 3 and snap.runtimes[1].busy_s == 0.5


def test_frame_shows_table_bars_and_grids():
    frame = queues.render(queues.parse(page()), None, "http://h:1", 1.0, width=80)
    lines = frame.splitlines()
    expert_row = next(line for line in lines if line.split()[:2] == ["1", "expert"])
    assert expert_row.split()[2] == "9" and expert_row.endswith("#" * (80 - len(lines[2]) - 1))
    assert "expert mu-queues" in frame and "attention mu-queues" in frame
    grid = lines[lines.index("expert mu-queues, tokens (block x expert)") + 1 :][:3]
    assert (
        grid[0].split() == ["block", "e3"] and grid[1].split() == ["0", "7"] and grid[2].split() == ["1", "2"]
    )


def test_frame_without_per_layer_depths_and_without_runtimes():
    frame = queues.render(queues.parse(page(per_layer=False)), None, "http://h:1", 1.0)
    assert "metrics_per_layer=false" in frame and "block x expert" not in frame
    empty = queues.render(queues.parse(CoordinatorMetrics().render().decode()), None, "http://h:1", 1.0)
    assert "no runtime reports" in empty


def test_a_grid_too_wide_lists_the_deepest_queues():
    cells = {(b, e): float(b * 256 + e) for b in range(3) for e in range(256)}
    rows = queues._grid(cells, "e", width=100)
    assert len(rows) == 20 and rows[0].split() == ["block", "2", "e255", "767"]


def test_refreshing_frames_show_busy_and_stall_shares(monkeypatch, capsys):
    # The frames are --interval 3 s apart, the reports they show 2 s apart: the share is of the runtime's 2 s.
    pages = iter([page(busy=0.5, uptime=10.0), page(busy=1.0, uptime=12.0)])

    def fetch(url, api_key=None):
        return queues.parse(next(pages))

    def sleep(seconds):
        if sleep.calls:
            raise KeyboardInterrupt  # what Ctrl-C does after the second frame
        sleep.calls += 1

    sleep.calls = 0
    monkeypatch.setattr(queues, "fetch", fetch)
    monkeypatch.setattr(queues.time, "sleep", sleep)
    args = argparse.Namespace(url="http://h:1/", interval=3.0, once=False, api_key=None)
    with pytest.raises(KeyboardInterrupt):
        queues.run_queues(args)
    first, second = capsys.readouterr().out.split("amoe queues")[1:]
    row = next(line for line in second.splitlines() if line.split()[:2] == ["1", "expert"])
    assert row.split()[4] == "25%"  # 0.5 s more busy over the runtime's 2 s
    assert next(line for line in first.splitlines() if line.split()[:2] == ["1", "expert"]).split()[4] == "-"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--url", "http://127.0.0.1:1", "--once"], "cannot read http://127.0.0.1:1/metrics"),
        (["--url", "not-a-url", "--once"], "cannot read not-a-url/metrics"),
        (["--interval", "0", "--once"], "--interval must be positive"),
    ],
)
def test_mistakes_are_one_line_errors(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "amoe", "queues", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("amoe: error: ") and message in out.stderr and out.stderr.count("\n") == 1


def test_metrics_per_layer_setting():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert AmoeConfig().server.metrics_per_layer is True
    assert (
        config_from_args(parser.parse_args(["--server-metrics-per-layer", "false"])).server.metrics_per_layer
        is False
    )
    assert (
        config_from_args(parser.parse_args(["--server-metrics-per-layer", "yes"])).server.metrics_per_layer
        is True
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--server-metrics-per-layer", "maybe"])
    with pytest.raises(ConfigError, match="metrics_per_layer"):
        ServerSection(metrics_per_layer="no")
    assert AmoeConfig.from_dict({"server": {"metrics_per_layer": False}}).server.metrics_per_layer is False
