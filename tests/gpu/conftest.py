"""The GPU suite (`make test-gpu`): every test here needs CUDA and is skipped, with the reason, on a host without it.

Tests that need more than one GPU carry `@pytest.mark.gpus(n)` and are skipped when fewer are visible. Both skips
happen at collection, so no module fixture (a Hugging Face reference, a served cluster) starts on a host that cannot
run the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "no CUDA device (CI has no GPU): run `make test-gpu` on a GPU host"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees every collected item, not only this directory's: touch only ours.
    ours = [item for item in items if HERE in item.path.parents]
    if not ours:
        return
    if not torch.cuda.is_available():
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
        return
    visible = torch.cuda.device_count()
    for item in ours:
        marker = item.get_closest_marker("gpus")
        if marker is not None and visible < marker.args[0]:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {marker.args[0]} CUDA devices, {visible} visible")
            )


def pytest_terminal_summary(terminalreporter) -> None:
    """Measurements GPU tests record with `record_property("gpu_...", value)`, shown at the end of the run (the
    bfloat16 agreement is a number to read, not only a pass/fail)."""
    lines = [
        f"{report.nodeid}: {name} = {value}"
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        for name, value in getattr(report, "user_properties", [])
        if name.startswith("gpu_")
    ]
    if lines:
        terminalreporter.section("GPU measurements")
        for line in lines:
            terminalreporter.write_line(line)
