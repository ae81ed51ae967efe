"""cpp/zmq_api.h: the libzmq declarations a build without libzmq's headers uses (linking the libzmq pyzmq's wheel
bundles, setup.py). Its numbers must be libzmq's, and its declarations must work against the real library."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "cpp" / "zmq_api.h"
CHECK = Path(__file__).resolve().parent / "native" / "zmq_api_check.cpp"


def own_constants() -> dict[str, int]:
    """The #defines of the header's own-declarations branch (after its #else)."""
    own = HEADER.read_text().split("#else", 1)[1]
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define ZMQ_(\w+) (-?\d+)$", own, re.M)}


def test_every_number_is_libzmqs():
    constants = own_constants()
    assert len(constants) >= 19  # the parse found the table
    wrong = {
        name: (value, int(getattr(zmq, name)))
        for name, value in constants.items()
        if getattr(zmq, name) != value
    }
    assert not wrong, f"cpp/zmq_api.h differs from libzmq (ours, pyzmq's): {wrong}"


def test_every_libzmq_name_the_communicator_uses_is_declared():
    used = set()
    for source in (REPO / "cpp").glob("*.cpp"):
        used |= set(re.findall(r"\bZMQ_([A-Z_0-9]+)\b", source.read_text()))
    assert used - set(own_constants()) == set()


def test_the_declarations_work_against_pyzmqs_libzmq(tmp_path):
    """Built the way a user without libzmq's headers builds (setup.py's fallback) and run: every call round-trips."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    libs = Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs"
    bundled = sorted(glob.glob(str(libs / "libzmq*.so*")))
    if compiler is None or not bundled:
        pytest.skip("needs a C++ compiler and a pyzmq wheel that bundles libzmq")
    exe = tmp_path / "zmq_api_check"
    build = subprocess.run(
        [compiler, "-std=c++17", "-Wall", "-Werror", "-DAMOE_ZMQ_OWN_DECLARATIONS", f"-I{REPO / 'cpp'}", str(CHECK),
         "-o", str(exe), f"-L{libs}", f"-l:{Path(bundled[0]).name}", f"-Wl,-rpath,{libs}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
