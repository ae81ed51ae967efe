"""A pytest plugin that appends each test's outcome to a JSON-lines file as soon as it is known (`-p
pytest_outcomes --outcomes FILE`, with tools/ on the path): a run stopped at its time box still leaves the outcomes
of the tests it finished, which a report written at the end would lose."""

from __future__ import annotations

import json

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes", metavar="FILE", help="append one JSON line per test outcome to FILE")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--outcomes")
    if path:
        config.pluginmanager.register(_Recorder(path), "outcomes-recorder")


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test's outcome is its call's, unless setup skipped or failed it (then no call runs) or teardown failed.
        final = report.when == "call" or (report.when == "setup" and report.outcome != "passed")
        if not (final or (report.when == "teardown" and report.failed)):
            return
        record = {
            "test": report.nodeid,
            "outcome": report.outcome if report.when != "teardown" else "failed",
            "when": report.when,
            "seconds": round(report.duration, 3),
            "properties": {k: v for k, v in report.user_properties if isinstance(v, (int, float, str))},
        }
        if report.skipped and isinstance(report.longrepr, tuple):
            record["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            record["message"] = _last_lines(str(report.longrepr), 15)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])
