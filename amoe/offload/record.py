"""Routing as a sequence saw it, for `--offload-record FILE` (and the activation policy's hook).

The file is JSON Lines (format "amoe-routing/1", read by `amoe offload build-eamc` and the trace replay):

    {"format": "amoe-routing/1", "num_blocks": L, "num_experts": E, "model": NAME}
    {"seq": ID, "steps": [[[expert, tokens], ...] for each MoE block] for each forward step of that sequence}

one line per finished sequence, written when it finishes. A step is one pass of the sequence through the model
(its prefill chunk, or one decode token); `tokens` counts its rows routed to `expert` in that block.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch

from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

FORMAT = "amoe-routing/1"


def chunk_routing(
    topk_ids: torch.Tensor, cu_rows: torch.Tensor, num_experts: int
) -> list[tuple[list[int], list[int]]]:
    """topk_ids [N, K] of R chunks (rows cu_rows[r]:cu_rows[r+1]) → per chunk (experts, tokens each), routed
    experts only (a shared expert id >= num_experts is everyone's and says nothing)."""
    ids = topk_ids.to("cpu", torch.int64)
    lens = (cu_rows[1:] - cu_rows[:-1]).to(torch.int64)  # [R]
    num_chunks = lens.shape[0]
    chunk = torch.repeat_interleave(torch.arange(num_chunks), lens)[:, None].expand_as(ids)  # [N, K]
    routed = ids < num_experts
    flat = (chunk[routed] * num_experts + ids[routed]).flatten()
    counts = torch.bincount(flat, minlength=num_chunks * num_experts).view(num_chunks, num_experts)  # [R, E]
    out = []
    for row in counts:
        experts = row.nonzero().flatten()
        out.append((experts.tolist(), row[experts].tolist()))
    return out


class RoutingRecorder:
    """Collects each live sequence's steps and writes a line when it finishes. Thread-safe: an attention rank's
    loop adds steps while its control thread may end sequences."""

    def __init__(self, path: str | Path, num_blocks: int, num_experts: int, model: str) -> None:
        try:
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the server's life
        except OSError as exc:
            raise ConfigError(f"--offload-record {path}: cannot write ({exc.strerror})") from None
        self.path = Path(path)
        self.num_blocks = num_blocks
        header = {"format": FORMAT, "num_blocks": num_blocks, "num_experts": num_experts, "model": model}
        self._write(header)
        self._steps: dict[int, list[list[list[list[int]]]]] = {}
        self._lock = threading.Lock()  # the loop thread adds, another thread may end or close
        self.written = 0

    def add(self, block: int, seqs: list[int], routing: list[tuple[list[int], list[int]]]) -> None:
        """Block `block`'s routing of one batch: seqs[r]'s chunk went to routing[r]. Block 0 opens a step."""
        with self._lock:
            for seq, (experts, counts) in zip(seqs, routing):
                steps = self._steps.setdefault(seq, [])
                if block == 0 or not steps:
                    steps.append([[] for _ in range(self.num_blocks)])
                steps[-1][block] = [[e, n] for e, n in zip(experts, counts)]

    def end(self, seq: int) -> None:
        """`seq` finished: its line goes out (a sequence that never ran a step has none)."""
        with self._lock:
            steps = self._steps.pop(seq, None)
            if steps and self._file is not None:
                self._write({"seq": seq, "steps": steps})
                self.written += 1

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._file.flush()  # a reader (or a crash) sees whole lines of finished sequences

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
