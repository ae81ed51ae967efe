"""Prepares the wheel folder the GPU check carries (`make gpu-wheels`): downloads the pinned wheels of
tools/gpu_wheels.txt for CPython 3.12 on x86-64 Linux into .whl/, one version of each, and checks that

* amoe's own requirements (pyproject.toml) and every wheel's requirements are met by a wheel or by the GPU
  machine's image (tools/gpu_image.txt), for that Python and platform;
* the folder fits its limit, and with the working tree (tracked and untracked-not-ignored files: what travels with
  a device call) the whole fits what a call may carry.

    python3 tools/gpu_wheels.py [--dest .whl] [--wheel-limit-mib 48] [--total-limit-mib 64]

Prints a table and a final JSON line; exits 1, saying why, when a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MIB = 2**20
# pip matches a manylinux tag exactly: every glibc the GPU machine's (2.39) can load.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 26, 27, 28, 31, 34, 35, 39)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
# The GPU machine's interpreter, for evaluating requirement markers.
TARGET = {
    **default_environment(),
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
        if not match:
            raise SystemExit(f"{path}: expected name==version, got {line!r}")
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def read_image(path: Path) -> set[str]:
    text = "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
    return {canonicalize_name(name) for name in text.split()}


def wheels_in(dest: Path) -> dict[str, list[Path]]:
    """The wheel files of `dest` by canonical name."""
    found: dict[str, list[Path]] = {}
    for wheel in sorted(dest.glob("*.whl")):
        name, _, _, _ = parse_wheel_filename(wheel.name)
        found.setdefault(canonicalize_name(name), []).append(wheel)
    return found


def prune(dest: Path, pins: dict[str, str]) -> list[str]:
    """Removes wheels of packages or versions not pinned: a stale second version would stop the install."""
    removed = []
    for wheel in dest.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if pins.get(canonicalize_name(name)) != str(version):
            wheel.unlink()
            removed.append(wheel.name)
    return removed


def download(dest: Path, pins: dict[str, str]) -> None:
    missing = [f"{n}=={v}" for n, v in pins.items() if n not in wheels_in(dest)]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--platform", "any"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    done = subprocess.run([*cmd, "-d", str(dest), *missing], capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
        raise SystemExit(f"pip download failed: {' / '.join(errors) or done.stderr[-500:]}")


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [
        Requirement(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]


def unmet(requirements: list[Requirement], pins: dict[str, str], image: set[str], who: str) -> list[str]:
    """Each requirement that applies on the GPU machine and that neither a pinned wheel nor the image meets."""
    problems = []
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate(TARGET):
            continue
        name = canonicalize_name(req.name)
        if name in pins:
            if not req.specifier.contains(pins[name], prereleases=True):
                problems.append(f"{who} needs {req}, the wheel is {pins[name]}")
        elif name not in image:
            problems.append(f"{who} needs {req}: neither a wheel nor in the image")
    return problems


def check_closure(dest: Path, pins: dict[str, str], image: set[str]) -> list[str]:
    found = wheels_in(dest)
    problems = [
        f"{n}: {len(found.get(n, []))} wheels, expected 1" for n in pins if len(found.get(n, [])) != 1
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    problems += unmet([Requirement(r) for r in project], pins, image, "amoe")
    for files in found.values():
        if len(files) == 1:
            problems += unmet(wheel_requirements(files[0]), pins, image, files[0].name)
    return problems


def tree_bytes() -> int:
    """Bytes of what a device call carries besides the carried folders: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    paths = {ROOT / p for p in listed.split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--requirements", type=Path, default=HERE / "gpu_wheels.txt")
    parser.add_argument("--image", type=Path, default=HERE / "gpu_image.txt")
    parser.add_argument("--wheel-limit-mib", type=float, default=48.0, help="the wheel folder's own limit")
    parser.add_argument("--total-limit-mib", type=float, default=64.0, help="what one device call may carry")
    args = parser.parse_args()

    pins, image = read_pins(args.requirements), read_image(args.image)
    args.dest.mkdir(parents=True, exist_ok=True)
    removed = prune(args.dest, pins)
    download(args.dest, pins)
    problems = check_closure(args.dest, pins, image)
    wheels = sorted(args.dest.glob("*.whl"))
    wheel_bytes, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    if wheel_bytes > args.wheel_limit_mib * MIB:
        problems.append(
            f"the wheels take {wheel_bytes / MIB:.1f} MiB, over their {args.wheel_limit_mib:g} MiB"
        )
    if wheel_bytes + tree > args.total_limit_mib * MIB:
        problems.append(
            f"wheels and tree take {(wheel_bytes + tree) / MIB:.1f} MiB, over the {args.total_limit_mib:g} MiB a "
            "device call carries"
        )

    for wheel in wheels:
        print(f"{wheel.stat().st_size / MIB:>7.2f} MiB  {wheel.name}")
    if removed:
        print(f"removed (not pinned): {', '.join(removed)}")
    print(
        f"{len(wheels)} wheels: {wheel_bytes / MIB:.2f} MiB (limit {args.wheel_limit_mib:g}); tree "
        f"{tree / MIB:.2f} MiB; together {(wheel_bytes + tree) / MIB:.2f} MiB of {args.total_limit_mib:g}"
    )
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print(
        json.dumps(
            {
                "wheels": len(wheels),
                "wheel_mib": round(wheel_bytes / MIB, 2),
                "tree_mib": round(tree / MIB, 2),
                "total_mib": round((wheel_bytes + tree) / MIB, 2),
                "wheel_limit_mib": args.wheel_limit_mib,
                "total_limit_mib": args.total_limit_mib,
                "ok": not problems,
            }
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
