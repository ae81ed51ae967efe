"""Which device a deployment runs on, decided once before anything starts, without loading torch (the coordinator
never does): `--device auto` becomes cpu or cuda, and `--device cuda` on a host without CUDA fails in one line.

A host with no NVIDIA driver (no /dev/nvidiactl) has no CUDA: that answer costs nothing. Otherwise a child
`python -m amoe.device` asks torch (about a second), which also catches a CPU-only torch on a GPU host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from amoe.config import AmoeConfig
from amoe.errors import ConfigError

_DRIVER_NODE = "/dev/nvidiactl"  # every NVIDIA driver install has it; containers get it with the GPUs


def probe(timeout_s: float = 120.0) -> dict:
    """{"cuda": bool, "count": int, "names": [...], "reason": why not}: what this host's torch sees."""
    if not os.path.exists(_DRIVER_NODE):
        return {
            "cuda": False,
            "count": 0,
            "names": [],
            "reason": f"no NVIDIA driver on this host ({_DRIVER_NODE})",
        }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "amoe.device"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        return {"cuda": False, "count": 0, "names": [], "reason": f"cannot ask torch about CUDA: {exc}"}


def resolve(config: AmoeConfig, runtimes_here: int = 1) -> AmoeConfig:
    """`config` with device.kind cpu or cuda. Emulated GPUs and the CPU keep what they had; `--device cuda` (or
    auto on a GPU host) needs a visible GPU for every `device.runtimes_per_gpu` of the `runtimes_here` this node
    starts."""
    kind = config.device.kind
    if config.executor.kind == "emulated" or kind == "cpu":
        return config.replace(device={"kind": "cpu"})
    found = probe()
    if not found["cuda"]:
        if kind == "cuda":
            raise ConfigError(f"--device cuda: {found['reason']}")
        return config.replace(device={"kind": "cpu"})
    per_gpu = config.device.runtimes_per_gpu
    if found["count"] < -(-runtimes_here // per_gpu):
        each = "one GPU each" if per_gpu == 1 else f"{per_gpu} per GPU"
        raise ConfigError(
            f"--device {kind}: this node starts {runtimes_here} runtimes, {each}, but {found['count']} "
            f"GPU(s) are visible ({', '.join(found['names'])}); lower the runtimes per node, share GPUs "
            "(--runtimes-per-gpu) or use --device cpu"
        )
    return config.replace(device={"kind": "cuda"})
