"""The two-phase plane over a pair of groups, one per direction (what GPU runtimes use, docs/gpu.md), run on the CPU
with gloo: the script of tests/gpu/test_gpu_nccl.py, every size and dtype it sends, both ways at once."""

from __future__ import annotations

import pytest
from gpu.test_gpu_nccl import _check, run


@pytest.mark.timeout(300)
def test_a_group_per_direction_carries_variable_sizes_both_ways_at_once(tmp_path):
    for report in run(tmp_path, "both", plane="gloo"):
        _check(report, receives=True, plane="gloo")
