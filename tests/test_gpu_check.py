"""The one-command GPU check (tools/gpu_check.py, `make gpu-check`) rehearsed on this CPU machine: every step reports
an outcome and its time in one JSON file, the steps that need CUDA say they were skipped and why, a step past its
time box is stopped and reported while the rest go on, wheels install without network and their requirements are
checked; and what prepares it: the wheel list covers amoe's dependencies (tools/gpu_wheels.py), the bench's server
layouts are configurations amoe accepts on any number of GPUs."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tools" / "gpu_check.py"
STEPS = ["probe", "wheels", "requirements", "build", "imports", "exactness", "gpu_suite", "bench"]
NEEDS_CUDA = {"exactness", "gpu_suite", "bench"}
WHEELS = ROOT / ".whl"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a rehearsal is the check on a host without CUDA"
)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out" / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        [sys.executable, str(CHECK), "--out", str(out), "--rehearse", *args],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.exists(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def _assert_shape(report: dict) -> None:
    assert report["check"] == "amoe GPU check" and report["rehearsal"] is True
    assert {"python", "machine", "cpus"} <= set(report["host"])
    assert [s["name"] for s in report["steps"]] == STEPS
    for step in report["steps"]:
        assert step["status"] in ("passed", "failed", "skipped"), step
        assert isinstance(step["seconds"], float) and step["seconds"] >= 0, step
        assert step["box_s"] > 0 and step["seconds"] <= step["box_s"] + 10, step
        assert step["needs_cuda"] == (step["name"] in NEEDS_CUDA)
        if step["status"] != "passed":
            assert step["reason"], step
    summary = report["summary"]
    assert sum(summary[s] for s in ("passed", "failed", "skipped")) == len(STEPS)
    assert summary["ok"] == (summary["failed"] == 0)
    assert report["budget_s"] == sum(s["box_s"] for s in report["steps"] if s.get("reason") != "--skip")


@pytest.mark.timeout(600)
def test_rehearsal_reports_every_step_and_skips_what_needs_cuda(tmp_path):
    done, report = run_check(tmp_path)
    _assert_shape(report)
    steps = {s["name"]: s for s in report["steps"]}
    assert done.returncode == 0 and report["summary"]["ok"], json.dumps(report["steps"], indent=1)[-3000:]
    assert report["cuda"]["available"] is False and report["cuda"]["reason"]
    for name in NEEDS_CUDA:
        assert steps[name]["status"] == "skipped" and "CUDA" in steps[name]["reason"], steps[name]
    # tests/gpu's pytest steps ran: each test of them was collected and skipped by its conftest, saying why.
    for name in ("exactness", "gpu_suite"):
        tests = steps[name]["numbers"]["tests"]
        assert tests and all(t["outcome"] == "skipped" and "no CUDA device" in t["reason"] for t in tests)
    assert any("every_family" in t["test"] for t in steps["exactness"]["numbers"]["tests"])
    assert steps["build"]["status"] == "skipped" and steps["build"]["reason"].startswith("rehearsal: ")
    assert steps["imports"]["status"] == "passed" and "amoe.core" in steps["imports"]["numbers"]
    if any(WHEELS.glob("*.whl")):  # `make gpu-wheels` ran here: two of its wheels are installed, offline
        assert steps["wheels"]["status"] == "passed" and steps["wheels"]["numbers"]["wheels"] == 2
        assert len(steps["wheels"]["numbers"]["installed"]) == 2
        assert steps["requirements"]["status"] == "passed"
    else:
        assert steps["wheels"]["status"] == "skipped" and "make gpu-wheels" in steps["wheels"]["reason"]
    assert "time boxes adding up to" in done.stdout and json.loads(done.stdout.splitlines()[-1])["ok"]
    ran = [s for s in report["steps"] if "returncode" in s]
    assert (tmp_path / "out" / "gpu_check.log").read_text().count("[gpu check] step ") == len(ran)


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel of one module, `name`, requiring `requires`."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }  # fmt: skip
    record = [f"{path},sha256={_digest(text)},{len(text.encode())}" for path, text in files.items()]
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def _digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


@pytest.mark.timeout(300)
def test_wheels_install_offline_and_an_unmet_requirement_fails_its_step(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "amoe_probe_ok", ["packaging"])
    _wheel(folder, "amoe_probe_needy", ["amoe-no-such-package>=1"])
    site = tmp_path / "site"
    skip = [
        arg for name in ("build", "imports", "exactness", "gpu_suite", "bench") for arg in ("--skip", name)
    ]
    done, report = run_check(tmp_path, "--wheels", str(folder), "--site", str(site), *skip)
    _assert_shape(report)
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["wheels"]["status"] == "passed", steps["wheels"]
    assert (site / "amoe_probe_ok.py").exists() and (site / "amoe_probe_needy.py").exists()
    assert steps["requirements"]["status"] == "failed" and done.returncode == 1
    assert steps["requirements"]["numbers"]["unmet"] == [
        "amoe_probe_needy needs amoe-no-such-package>=1: not installed"
    ]
    assert all(steps[n]["status"] == "skipped" and steps[n]["reason"] == "--skip" for n in STEPS[3:])


@pytest.mark.timeout(300)
def test_a_step_past_its_time_box_is_stopped_and_the_rest_go_on(tmp_path):
    # Importing torch, amoe and its server takes seconds on any machine: a 0.05 s box always stops it.
    done, report = run_check(tmp_path, "--box", "imports=0.05", "--skip", "exactness", "--skip", "gpu_suite")
    _assert_shape(report)
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["imports"]["status"] == "failed"
    assert steps["imports"]["reason"] == "timed out after 0.05 s (its time box)"
    assert steps["bench"]["status"] == "skipped" and "CUDA" in steps["bench"]["reason"]
    assert done.returncode == 1 and report["summary"]["ok"] is False


def test_bad_arguments_are_one_line_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    for args, says in (
        ([], "--out FILE is needed"),
        (["--out", "x.json", "--box", "nope=3"], "no step 'nope'"),
        (["--out", "x.json", "--box", "build=soon"], "expected STEP=SECONDS"),
    ):
        done = subprocess.run(
            [sys.executable, str(CHECK), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 2 and says in done.stderr.splitlines()[-1], done.stderr


def test_the_outcomes_plugin_records_each_test_as_it_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "def test_passes(record_property):\n    record_property('gpu_x', 0.5)\n\n"
        "def test_fails():\n    assert 1 == 2\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n"
    )
    outcomes = tmp_path / "outcomes.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "pytest_outcomes", "--outcomes", str(outcomes),
         "-p", "no:cacheprovider", "test_sample.py"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    records = {r["test"].split("::")[1]: r for r in map(json.loads, outcomes.read_text().splitlines())}
    assert set(records) == {"test_passes", "test_fails", "test_skipped"}
    assert records["test_passes"]["outcome"] == "passed" and records["test_passes"]["properties"] == {
        "gpu_x": 0.5
    }
    assert (
        records["test_fails"]["outcome"] == "failed" and "assert 1 == 2" in records["test_fails"]["message"]
    )
    assert records["test_skipped"] == {**records["test_skipped"], "outcome": "skipped", "reason": "not here"}


def test_the_wheel_list_covers_amoe_s_dependencies_and_checks_requirements(tmp_path):
    tomllib = pytest.importorskip("tomllib")  # tools/ run on Python 3.11 and later
    wheels = _load("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
    pins, image = (
        wheels.read_pins(ROOT / "tools" / "gpu_wheels.txt"),
        wheels.read_image(ROOT / "tools" / "gpu_image.txt"),
    )
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert wheels.unmet([Requirement(r) for r in project], pins, image, "amoe") == []
    assert {"pyzmq", "msgspec", "fastapi", "uvicorn", "setproctitle", "llguidance"} <= set(pins)
    carried_for_a_version = {"typing-extensions", "anyio", "idna", "h11"}
    assert set(pins) & image == carried_for_a_version
    # A wheel whose requirement neither a pin nor the image meets is named, as is a pin of the wrong version.
    _wheel(
        tmp_path,
        "needy",
        ["amoe-no-such-package", "fastapi<0.1", "torch", "cffi; implementation_name=='pypy'"],
    )
    problems = wheels.check_closure(tmp_path, {**pins, "needy": "1.0"}, image)
    assert problems[-2:] == [
        "needy-1.0-py3-none-any.whl needs amoe-no-such-package: neither a wheel nor in the image",
        f"needy-1.0-py3-none-any.whl needs fastapi<0.1, the wheel is {pins['fastapi']}",
    ]


@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
def test_the_bench_s_server_layouts_fit_the_gpus_and_amoe_accepts_them(gpus, monkeypatch):
    from amoe.config import AmoeConfig
    from amoe.placement import runtimes_on_node

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = _load("bench_gpu", ROOT / "bench" / "gpu.py")
    for mode in bench.MODES:
        sections, entry = bench.layout(mode, gpus, num_experts=8)
        config = (
            AmoeConfig().replace(device={"kind": "cuda"}, transport={"plane": "auto"}).replace(**sections)
        )
        assert config.parallel.mode == mode
        if mode == "local":
            continue
        runtimes, per_gpu = runtimes_on_node(config, 0), config.device.runtimes_per_gpu
        assert per_gpu == entry["runtimes_per_gpu"] and math.ceil(runtimes / per_gpu) <= gpus
        assert runtimes >= 2  # aep's two roles apart; ep's all-to-all between two devices at least
        assert config.tensor_plane == ("nccl" if per_gpu == 1 else "inline")
