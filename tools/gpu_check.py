"""The GPU check in one command (docs/gpu.md "The one-command GPU check"): on a machine that has torch with CUDA but
not amoe's other dependencies and no network, from a clean tree plus the wheel folder `make gpu-wheels` made:

  probe         what this Python's torch sees (GPUs, CUDA, NCCL)
  wheels        installs .whl/ without network into a target folder on PYTHONPATH
  requirements  every installed wheel's requirements met, with versions, by the wheels and the machine's packages
  build         the C++ extension built against this machine's torch (setup.py build_ext --inplace)
  imports       amoe, its extension, its server and every carried package import
  exactness     tests/gpu/test_gpu_exactness.py: greedy tokens against transformers on the same GPU, every family
  gpu_suite     the rest of tests/gpu: NCCL transfers, served clusters, healing (the ones the GPUs here allow)
  bench         bench/gpu.py: amoe's throughput against transformers' generate on the same GPU, one run

Each step runs in its own process group under a time box (`--box NAME=S` changes one); the boxes add up to the
budget printed first. One JSON file gets every step's outcome (passed / failed / skipped, with the reason), its
seconds, the tail of its output and its numbers, rewritten after each step; the whole output goes to a .log beside
it. Without CUDA the steps that need it are skipped, saying why, and the rest run: `--rehearse` is that run on a
CPU machine made fast (the built extension reused, two wheels installed).

    python3 tools/gpu_check.py --out $OUT/gpu_check.json          # on the GPU machine
    python3 tools/gpu_check.py --out /tmp/check.json --rehearse   # here

Only the standard library at the top: it starts on a bare machine. Exits 1 when a step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
TAIL_CHARS = 2500
KILL_GRACE_S = 5.0
REHEARSAL_WHEELS = 2
# Kept after the run: the extension built against pyzmq's bundled libzmq finds it there (its RPATH).
SITE = Path(tempfile.gettempdir()) / "amoe-gpu-site"
# Seconds per step, together 510: under a device call's 10 minutes with room to stop a step that overruns. The build
# took 5 CPU-minutes here, its longest file 50 s: about a minute on 16 cores, if ninja runs them side by side.
BOXES = {
    "probe": 20,
    "wheels": 30,
    "requirements": 15,
    "build": 150,
    "imports": 25,
    "exactness": 100,
    "gpu_suite": 70,  # on one GPU: the shared-GPU served tests; with more, raise it (--box gpu_suite=900)
    "bench": 100,
}
NEEDS_CUDA = ("exactness", "gpu_suite", "bench")
# What the carried wheels are for: each must import once installed (the extension and the server's modules too).
IMPORTS = [
    "torch", "zmq", "msgspec", "fastapi", "starlette", "pydantic", "uvicorn", "setproctitle", "llguidance", "openai",
    "amoe.core", "amoe.llm", "amoe.serve", "amoe.structured", "coordinator.api.app", "transformers",
]  # fmt: skip
BENCH_ARGS = ["--preset", "small", "--num-prompts", "32", "--new-tokens", "64", "--parallel", "local,aep,ep"]
BENCH_ARGS += ["--startup-timeout-s", "60"]

PROBE = r"""
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "available": torch.cuda.is_available()}
if info["available"]:
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        info["nccl"] = f"unavailable: {exc}"
elif torch.version.cuda is None:
    info["reason"] = f"this torch ({torch.__version__}) is a CPU build"
else:
    info["reason"] = "torch sees no CUDA device"
print(json.dumps(info))
"""

REQUIREMENTS = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
site, unmet, checked = sys.argv[1], [], 0
for dist in metadata.distributions(path=[site]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        checked += 1
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dist.metadata['Name']} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist.metadata['Name']} needs {req}: {have} is installed")
print(json.dumps({"checked": checked, "unmet": unmet}))
sys.exit(1 if unmet else 0)
"""


@dataclass
class GpuCheck:
    """One run of the check: where things are, what was found, and the JSON document being written."""

    out: Path
    log: Path
    site: Path
    wheels: Path
    rehearse: bool
    boxes: dict[str, float]
    skip: set[str]
    cuda: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)

    def env(self, *extra_path: Path) -> dict[str, str]:
        """The steps' environment: the tree and the installed wheels first on the path, output unbuffered."""
        # No network there: transformers must not try the hub (a checkpoint is always a local folder here).
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        path = [str(ROOT), str(self.site), *map(str, extra_path)]
        env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def write(self) -> None:
        steps = self.report["steps"]
        counts = {s: sum(1 for step in steps if step["status"] == s) for s in STATUSES}
        seconds = round(sum(step["seconds"] for step in steps), 1)
        self.report["summary"] = {**counts, "seconds": seconds, "ok": counts["failed"] == 0}
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        tmp.replace(self.out)


STATUSES = ("passed", "failed", "skipped")


def run(check: GpuCheck, name: str, cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Runs `cmd` from the tree's root in a process group of its own under step `name`'s time box; on timeout the
    whole group (a server and its runtimes too) is stopped. The step's record: status, seconds, box, tail."""
    box = check.boxes[name]
    with open(check.log, "a") as log:
        log.write(f"\n{_marker(name)} {_shown(cmd)} (box {box:g} s)\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or check.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code, timed_out = proc.wait(timeout=box), False
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            code, timed_out = proc.returncode, True
        seconds = time.monotonic() - start
    record = {"status": "passed" if code == 0 and not timed_out else "failed", "seconds": round(seconds, 2)}
    record |= {"box_s": box, "returncode": code, "tail": _tail(check.log, _marker(name))}
    if timed_out:
        record["reason"] = f"timed out after {box:g} s (its time box)"
    elif code != 0:
        record["reason"] = f"exited {code}"
    return record


def _marker(name: str) -> str:
    """The log line that starts a step's output (its tail is read from there)."""
    return f"[gpu check] step {name}:"


def _shown(cmd: list[str]) -> str:
    """The command on one line, an inline program (python -c) named rather than spelled out."""
    return " ".join("<program>" if "\n" in arg else arg for arg in cmd)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (a server drains and stops its runtimes), a grace, then SIGKILL to
    whatever of the group is left, so the next step finds the GPU free."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE_S)


def _tail(log: Path, marker: str) -> str:
    text = log.read_text(errors="replace")
    section = text[text.rfind(marker) :]
    section = section.split("\n", 1)[1] if "\n" in section else ""
    return section[-TAIL_CHARS:]


def skipped(check: GpuCheck, name: str, reason: str) -> dict:
    return {"status": "skipped", "seconds": 0.0, "box_s": check.boxes[name], "reason": reason}


def last_json(tail: str) -> dict | None:
    """The last line of `tail` that is a JSON object (a benchmark's or a snippet's result)."""
    for line in reversed(tail.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ---- the steps: each returns its record (run's, or skipped's) with its numbers


def step_probe(check: GpuCheck) -> dict:
    record = run(check, "probe", [sys.executable, "-c", PROBE])
    found = last_json(record["tail"]) if record["status"] == "passed" else None
    check.cuda = found or {"available": False, "reason": f"the probe failed: {record.get('reason')}"}
    record["numbers"] = check.cuda
    return record


def wheel_files(check: GpuCheck) -> list[Path]:
    files = sorted(check.wheels.glob("*.whl")) if check.wheels.is_dir() else []
    return files[:REHEARSAL_WHEELS] if check.rehearse else files


def step_wheels(check: GpuCheck) -> dict:
    files = wheel_files(check)
    if not files:
        return skipped(check, "wheels", f"no wheels in {check.wheels} (make gpu-wheels prepares them)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(check.site)]
    if os.geteuid() == 0:
        cmd.append("--root-user-action=ignore")
    record = run(check, "wheels", [*cmd, *map(str, files)])
    installed = sorted(p.name for p in check.site.glob("*.dist-info"))
    record["numbers"] = {"wheels": len(files), "installed": installed, "site": str(check.site)}
    if check.rehearse:
        record["numbers"]["rehearsal"] = f"{len(files)} of the folder's wheels installed"
    return record


def step_requirements(check: GpuCheck) -> dict:
    if not any(check.site.glob("*.dist-info")):
        return skipped(check, "requirements", "no wheels installed")
    record = run(check, "requirements", [sys.executable, "-c", REQUIREMENTS, str(check.site)])
    record["numbers"] = last_json(record["tail"])
    return record


def built_extension() -> Path | None:
    found = ROOT / "amoe" / f"_core{sysconfig.get_config_var('EXT_SUFFIX')}"
    return found if found.exists() else None


def step_build(check: GpuCheck) -> dict:
    if check.rehearse:  # a build takes minutes here: the rehearsal uses the one `make install` built
        ext = built_extension()
        if ext:
            return skipped(check, "build", f"rehearsal: {ext.name} is present and reused, not rebuilt")
        return skipped(check, "build", "rehearsal: no extension built (python setup.py build_ext --inplace)")
    env = check.env()
    env["MAX_JOBS"] = str(os.cpu_count() or 1)  # ninja's parallelism in torch's extension builder
    record = run(check, "build", [sys.executable, "setup.py", "build_ext", "--inplace"], env)
    ext = built_extension()
    record["numbers"] = {"extension": ext.name if ext else None, "jobs": int(env["MAX_JOBS"])}
    return record


def step_imports(check: GpuCheck) -> dict:
    code = (
        "import importlib, json, sys\nfrom importlib import metadata\nout = {}\n"
        f"for name in {IMPORTS!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    out[name] = getattr(module, '__version__', None) or 'ok'\n"
        "print(json.dumps(out))\n"
    )
    record = run(check, "imports", [sys.executable, "-c", code])
    record["numbers"] = last_json(record["tail"])
    return record


def pytest_step(check: GpuCheck, name: str, targets: list[str]) -> dict:
    """pytest on `targets`, each test's outcome recorded as it ends (tools/pytest_outcomes.py). Without CUDA it
    runs too: tests/gpu's conftest skips every test at collection, saying why, so the step is skipped."""
    outcomes = check.out.parent / f".{name}.outcomes.jsonl"
    outcomes.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_outcomes"]
    record = run(check, name, [*cmd, "--outcomes", str(outcomes), *targets], check.env(TOOLS))
    tests = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    outcomes.unlink(missing_ok=True)
    counts = {s: sum(1 for t in tests if t["outcome"] == s) for s in STATUSES}
    record["numbers"] = {**counts, "tests": tests}
    if record["status"] == "passed" and tests and counts["skipped"] == len(tests):
        reasons = sorted({t.get("reason", "") for t in tests})
        record |= {"status": "skipped", "reason": f"every test skipped: {'; '.join(reasons)}"}
    return record


def step_exactness(check: GpuCheck) -> dict:
    return pytest_step(check, "exactness", ["tests/gpu/test_gpu_exactness.py"])


def step_gpu_suite(check: GpuCheck) -> dict:
    return pytest_step(check, "gpu_suite", ["tests/gpu", "--ignore=tests/gpu/test_gpu_exactness.py"])


def step_bench(check: GpuCheck) -> dict:
    if not check.cuda.get("available"):
        return skipped(check, "bench", f"needs CUDA: {check.cuda.get('reason')}")
    record = run(check, "bench", [sys.executable, "bench/gpu.py", *BENCH_ARGS])
    record["numbers"] = last_json(record["tail"])
    return record


STEPS = {
    "probe": step_probe,
    "wheels": step_wheels,
    "requirements": step_requirements,
    "build": step_build,
    "imports": step_imports,
    "exactness": step_exactness,
    "gpu_suite": step_gpu_suite,
    "bench": step_bench,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None
    parser.add_argument(
        "--out", type=Path, default=default_out, help="the JSON file (default $OUT/gpu_check.json)"
    )
    parser.add_argument(
        "--wheels", type=Path, default=ROOT / ".whl", help="the wheel folder (make gpu-wheels)"
    )
    parser.add_argument(
        "--site", type=Path, help=f"where the wheels go (default {SITE}; a rehearsal's own temporary folder)"
    )
    parser.add_argument("--rehearse", action="store_true", help="the fast run on a CPU machine")
    parser.add_argument("--box", action="append", default=[], metavar="STEP=S", help="a step's time box")
    parser.add_argument("--skip", action="append", default=[], choices=list(STEPS), help="leave a step out")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out FILE is needed (or OUT set: $OUT/gpu_check.json)")
    args.boxes = dict(BOXES)
    for item in args.box:
        name, _, seconds = item.partition("=")
        if name not in BOXES:
            parser.error(f"--box {item}: no step {name!r} (steps: {', '.join(BOXES)})")
        try:
            args.boxes[name] = float(seconds)
        except ValueError:
            parser.error(f"--box {item}: expected STEP=SECONDS")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    own_site = args.site is None and args.rehearse
    site = Path(tempfile.mkdtemp(prefix="amoe-gpu-site-")) if own_site else args.site or SITE
    site.mkdir(parents=True, exist_ok=True)
    check = GpuCheck(
        args.out, args.out.with_suffix(".log"), site, args.wheels, args.rehearse, args.boxes, set(args.skip)
    )
    check.log.write_text("")
    check.report = {
        "check": "amoe GPU check",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rehearsal": args.rehearse,
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "budget_s": sum(args.boxes[n] for n in STEPS if n not in check.skip),
        "steps": [],
    }
    print(
        f"gpu check: {len(STEPS)} steps, time boxes adding up to {check.report['budget_s']:g} s", flush=True
    )
    try:
        for name, step in STEPS.items():
            record = skipped(check, name, "--skip") if name in check.skip else step(check)
            check.report["steps"].append({"name": name, "needs_cuda": name in NEEDS_CUDA, **record})
            check.report["cuda"] = check.cuda
            check.write()
            why = f" ({record['reason']})" if record.get("reason") else ""
            print(f"{name:<13} {record['status']:<8} {record['seconds']:>7.1f} s{why}", flush=True)
    finally:
        if own_site:
            shutil.rmtree(site, ignore_errors=True)
    summary = check.report["summary"]
    print(json.dumps({"out": str(args.out), **summary}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
