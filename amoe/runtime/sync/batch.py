"""Batches of the synchronous modes: the inbox where new prompts and sampled tokens wait for the next iteration,
admission at the iteration boundary, and the batch objects the executors run.

The executors of amoe/runtime/executors.py (torch or emulated compute) are reused unchanged: `TokenInbox` takes
the rows the C++ engine would take at block 0 (prompts, and the tokens a head step hands on), and `LayerBatch`
carries the attributes of `core.Batch` that `run(batch)` reads.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from amoe.model.kv_cache import BlockManager
from amoe.runtime.requests import Rows


@dataclass
class Chunk:
    """The rows of one request entering block 0 together: a prompt, or one decode token."""

    request_id: int
    token_ids: list[int]
    start: int  # position of the first row

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)


class TokenInbox:
    """Chunks waiting for the next iteration."""

    def __init__(self) -> None:
        # add_request runs on control threads, the loop thread re-enters sampled tokens and admits: one lock.
        self._lock = threading.Condition()
        self._chunks: list[Chunk] = []

    def add(self, rows: Rows) -> None:
        """Rows for block 0, grouped back into their chunks."""
        chunks, i = [], 0
        while i < len(rows):
            n = rows.chunk_lens[i]
            chunks.append(Chunk(rows.request_ids[i], rows.token_ids[i : i + n], rows.chunk_starts[i]))
            i += n
        if not chunks:
            return
        with self._lock:
            self._chunks += chunks
            self._lock.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to timeout seconds for a chunk; True if one is waiting."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._chunks), timeout)

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

    def admit(self, blocks: BlockManager, max_rows: int | None = None) -> list[Chunk]:
        """The chunks joining this iteration: decode steps first (their requests hold KV already), then new
        prompts in arrival order, while KV blocks and the row budget last. The rest wait for a later iteration."""
        with self._lock:
            waiting = sorted(self._chunks, key=lambda c: not blocks.has(c.request_id))  # stable
            taken, kept = _fit(waiting, blocks, max_rows)
            self._chunks = kept
        return taken


def _fit(chunks: list[Chunk], blocks: BlockManager, max_rows: int | None) -> tuple[list[Chunk], list[Chunk]]:
    free, rows = blocks.num_free_blocks, 0
    taken, kept = [], []
    for c in chunks:
        held = blocks.num_tokens(c.request_id) if blocks.has(c.request_id) else 0
        need = blocks.blocks_needed(held, c.num_rows)
        fits = need <= free and (max_rows is None or rows + c.num_rows <= max_rows or not taken)
        if fits:
            free -= need
            rows += c.num_rows
            taken.append(c)
        else:
            kept.append(c)
    return taken, kept


@dataclass
class LayerBatch:
    """What an executor's run(batch) reads of a core.Batch (docs/engine.md "Batch assembly")."""

    kind: str  # "attn" | "expert"
    block: int
    index: int  # attention DP rank or expert id
    request_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    cu_rows: torch.Tensor | None = None  # [R + 1]
    context_lens: torch.Tensor | None = None  # [R]
    token_ids: torch.Tensor | None = None  # [N] block 0
    residual: torch.Tensor | None = None  # [N, H]
    expert_out: torch.Tensor | None = None  # [N, K, H]
    expert_ids: torch.Tensor | None = None  # [N, K]
    x: torch.Tensor | None = None  # [N, H] expert input
    weights: torch.Tensor | None = None  # [N] top-k weight
    group_experts: torch.Tensor | None = (
        None  # [G] expert of each group of rows (cu_rows [G + 1]); None: index
    )

    @property
    def num_rows(self) -> int:
        return int(self.request_ids.shape[0])

    def at_block(self, block: int, residual, expert_out, expert_ids) -> LayerBatch:
        """The same chunks entering attention(block) (or the head) with the previous block's MoE results."""
        return dataclasses.replace(
            self, block=block, token_ids=None, residual=residual, expert_out=expert_out, expert_ids=expert_ids
        )


def attention_batch(chunks: list[Chunk], rank: int) -> LayerBatch:
    """Block 0's batch of an attention rank: the chunks' rows, contiguous and in position order."""
    lens = torch.tensor([c.num_rows for c in chunks], dtype=torch.int64)  # [R]
    starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    cu_rows = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu_rows[1:])
    chunk_of_row = torch.repeat_interleave(torch.arange(len(chunks)), lens)  # [N]
    rids = torch.tensor([c.request_id for c in chunks], dtype=torch.int64)
    return LayerBatch(
        kind="attn",
        block=0,
        index=rank,
        request_ids=rids[chunk_of_row],
        positions=starts[chunk_of_row] + torch.arange(int(cu_rows[-1])) - cu_rows[chunk_of_row],
        cu_rows=cu_rows,
        context_lens=starts + lens,
        token_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64),
    )


def split_micro_batches(chunks: list[Chunk], m: int) -> list[list[Chunk]]:
    """m contiguous groups of whole chunks with about equal rows (some may be empty when chunks are few)."""
    total = sum(c.num_rows for c in chunks)
    groups: list[list[Chunk]] = [[] for _ in range(m)]
    done = 0
    for c in chunks:
        # The group whose share of the rows this chunk's middle falls in.
        i = min(m - 1, int((done + c.num_rows / 2) * m / total)) if total else 0
        groups[i].append(c)
        done += c.num_rows
    return groups
