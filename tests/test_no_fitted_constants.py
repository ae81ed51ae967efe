"""The performance model's constants are frozen, not fitted: no number in the model or its tests is (within 1 %) a
throughput the emulated runtime measured and experiments/ records. A prediction checked against a measurement it
was tuned to reproduce says nothing (a test once pinned the simulation to "the runtime's two measurements'
mean"); the out-of-sample check (`amoe bench plan-check --preset sample`) is where predictions meet measurements."""

from __future__ import annotations

import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The model's arithmetic and its tests. The profiles (gpus.py, models.py, hosts.py) and routing.py are left out: their numbers are shapes,
# datasheets and seeds, each with its source beside it (a datasheet's 2,039 GB/s is not a fit because a
# throughput once came out near it).
MODEL_CODE = [
    REPO / n
    for n in (
        *(
            f"amoe/perf/plan/{m}.py"
            for m in ("bounds", "bound_pools", "bound_ep", "expert_steps", "prediction")
        ),
        *(f"amoe/perf/plan/simulate/{m}.py" for m in ("__init__", "events", "events_aep")),
        *(f"amoe/perf/plan/{m}.py" for m in ("deployment", "request", "search", "refine", "report")),
        "amoe/perf/model/cost_model.py",
        "amoe/perf/model/links.py",
        "amoe/runtime/emulated.py",
        "amoe/runtime/emulated_clock.py",
    )
]
MODEL_TESTS = [REPO / "tests" / n for n in ("test_simulate.py", "test_bounds.py", "test_plan_check.py")]


def measured_values() -> set[float]:
    """Every number recorded under a key that starts with "measured" in experiments/ (JSON and JSON lines)."""
    found: set[float] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if (
                    key.startswith("measured")
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    found.add(float(value))
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in (REPO / "experiments").rglob("*.json*"):
        text = path.read_text()
        docs = [text] if path.suffix == ".json" else [line for line in text.splitlines() if line.strip()]
        for doc in docs:
            try:
                walk(json.loads(doc))
            except json.JSONDecodeError:
                continue
    return {v for v in found if v >= 1000}  # throughputs (tokens/s), not ratios or milliseconds


def literals(path: Path) -> list[tuple[float, int]]:
    """Numeric literals of a source file with their lines, except round ones (multiples of 100, powers of two):
    those are settings, not fits."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            v = float(node.value)
            if v >= 1000 and v % 100 and not (v.is_integer() and int(v) & (int(v) - 1) == 0):
                out.append((v, node.lineno))
    return out


def test_no_model_constant_is_a_recorded_measurement():
    measured = sorted(measured_values())
    assert measured, "experiments/ records no measurements: the check would pass vacuously"
    fitted = [
        f"{path.relative_to(REPO)}:{line}: {value:g} is within 1 % of the measured {m:g}"
        for path in MODEL_CODE + MODEL_TESTS
        for value, line in literals(path)
        for m in measured
        if abs(value / m - 1) <= 0.01
    ]
    assert not fitted, "\n".join(fitted)


def test_the_check_catches_a_pinned_measurement(tmp_path):
    """The pattern it exists for: a test asserting the simulation equals a measurement's mean."""
    pinned = tmp_path / "test_pinned.py"
    pinned.write_text("assert planned == approx(21_830, rel=0.05)\n")
    measured = measured_values()
    assert any(abs(v / m - 1) <= 0.01 for v, _ in literals(pinned) for m in measured)
