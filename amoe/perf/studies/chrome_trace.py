"""A Chrome trace (as the PyTorch profiler writes it) of a decode step: its GPU kernels summed by category per MoE
block, for `amoe bench frontier --breakdown --trace FILE` (amoe.perf.studies.frontier_trace)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

# A decode layer's parts, as SGLang's "Decode Time Breakdown" names them (launch: the gaps between kernels).
CATEGORIES = ("attention_core", "gemm", "moe", "other", "launch", "dispatch", "combine")

# First match wins, on the kernel's name (case-insensitive). FlashMLA's own split-KV combine kernel is attention,
# so attention is tried before DeepEP's combine ("flash" alone would take FlashInfer's norms); DeepGEMM's grouped
# (masked) GEMMs are the experts'. Guesses at names not seen here: the report lists each category's biggest kernels
# so a misfiled one shows.
KERNEL_CATEGORIES = (
    ("attention_core", r"mla|fmha|flash_fwd|flash_attn|attention|attn"),
    ("dispatch", r"dispatch"),
    ("combine", r"combine"),
    ("moe", r"grouped|moe|expert"),
    ("gemm", r"gemm|cublas|cutlass|nvjet|xmma|bmm|matmul"),
    ("other", r""),
)
_PATTERNS = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in KERNEL_CATEGORIES]


def kernel_category(name: str) -> str:
    return next(cat for cat, rx in _PATTERNS if rx.search(name))


def read_trace(path: str | Path) -> list[dict]:
    """The trace's events (a JSON object with traceEvents, or a bare list; .gz read as gzip)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--trace {path}: not a readable Chrome trace ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"--trace {path}: no traceEvents list")
    return events


def trace_breakdown(events: list[dict], micro_batches: int = 2, device=None) -> dict:
    """GPU kernels (complete events of category "kernel") of one device, summed by category per MoE block (a block
    of one step: `micro_batches` dispatches), with the step's wall and the busiest stream's idle time."""
    kernels = [
        e for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel" and "dur" in e
    ]  # fmt: skip
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (ph X, cat kernel)")
    devices = sorted({str(e.get("pid")) for e in kernels})
    pick = devices[0] if device is None else str(device)
    if pick not in devices:
        raise ValueError(f"device {device!r} not in the trace (devices: {', '.join(devices)})")
    kernels = [e for e in kernels if str(e.get("pid")) == pick]
    totals = dict.fromkeys(CATEGORIES, 0.0)
    streams: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        dur = float(e["dur"])
        totals[kernel_category(str(e.get("name", "")))] += dur
        by_name[str(e.get("name", ""))] = by_name.get(str(e.get("name", "")), 0.0) + dur
        streams[str(e.get("tid"))] = streams.get(str(e.get("tid")), 0.0) + dur
    dispatches = sum(1 for e in kernels if kernel_category(str(e.get("name", ""))) == "dispatch")
    blocks = dispatches / micro_batches
    if blocks <= 0:
        raise ValueError("the trace has no dispatch kernel: cannot count its MoE blocks")
    start = min(float(e["ts"]) for e in kernels)
    wall = max(float(e["ts"]) + float(e["dur"]) for e in kernels) - start
    busiest = max(streams, key=streams.get)
    return {
        "device": pick, "blocks": blocks, "kernels": len(kernels), "wall_us": wall,
        "per_block_us": {k: v / blocks for k, v in totals.items()},
        "top_kernels": {
            cat: sorted((n for n in by_name if kernel_category(n) == cat), key=by_name.get, reverse=True)[:3]
            for cat in CATEGORIES
        },
        "idle_per_block_us": (wall - streams[busiest]) / blocks,
    }  # fmt: skip
