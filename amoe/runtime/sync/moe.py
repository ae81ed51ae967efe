"""The MoE all-to-all of the synchronous modes: split routed rows by expert device (dispatch), run the hosted
experts on everything received, send each source its rows back in the order it sent them (combine), and put the
results where the next attention layer's merge expects them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from amoe import core
from amoe.runtime.sync.batch import LayerBatch
from amoe.runtime.sync.exchange import COMBINE, Exchanger, Parcel, Tag, frame
from amoe.runtime.sync.stats import SyncStats

logger = logging.getLogger(__name__)


@dataclass
class Routed:
    """An attention step's rows on their way to the experts."""

    moe_input: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, K]
    topk_weights: torch.Tensor  # [N, K]
    request_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]

    @classmethod
    def empty(cls, hidden: int, top_k: int, dtype: torch.dtype = torch.float32) -> Routed:
        """What a device with no rows this iteration sends: nothing, but to every peer (the barrier needs it)."""
        none = torch.zeros(0, dtype=torch.int64)
        return cls(
            torch.zeros(0, hidden, dtype=dtype),
            torch.zeros(0, top_k, dtype=torch.int64),
            torch.zeros(0, top_k),
            none,
            none,
        )


def send_dispatch(ex: Exchanger, tag: Tag, routed: Routed, plan: DispatchPlan) -> None:
    """Dispatch half of the all-to-all: one message (maybe zero rows) to every expert device."""
    for dest in plan.sizes:
        body, meta = plan.rows_for(
            dest, tag.block, routed.moe_input, routed.topk_weights, routed.request_ids, routed.positions
        )
        ex.send(dest, tag, rows=meta, framed=body)


FAILED = 1  # a combine message's flag: the expert layer raised, its rows carry no outputs


def serve_experts(
    ex: Exchanger, tag: Tag, sources: Sequence[int], executor, hidden: int, stats: SyncStats
) -> None:
    """An expert device's part of one all-to-all: wait for every source (the barrier), run, send back. If an
    expert layer raises, every source still gets its reply (the barrier must complete), flagged FAILED, so the
    sources end the requests concerned instead of reading outputs that were never computed."""
    with stats.waiting():
        parcels = ex.gather(tag, sources)
    flags = 0
    try:
        outputs = run_experts(executor, tag.block, parcels, hidden, stats)
    except Exception:  # noqa: BLE001 - one bad batch fails its own requests, never the group
        logger.exception("[sync] experts of block %d failed %s", tag.block, tag)
        outputs, flags = (
            {src: frame(p.num_rows, torch.zeros(0, hidden)).zero_() for src, p in parcels.items()},
            FAILED,
        )
    back = Tag(tag.iteration, tag.block, COMBINE, tag.micro)
    for src, body in outputs.items():
        ex.send(src, back, framed=body, flags=flags)


def receive_combine(
    ex: Exchanger, tag: Tag, plan: DispatchPlan, like: torch.Tensor, stats: SyncStats
) -> torch.Tensor | None:
    """Combine half: wait for every expert device (the barrier) → expert_out [N, K, H]; None if an expert device
    failed on these rows."""
    with stats.waiting():
        parcels = ex.gather(tag, plan.sizes)
    if any(p.flags & FAILED for p in parcels.values()):
        return None
    return plan.combine(parcels, like)


class DispatchPlan:
    """Where each of a batch's N × K routed rows goes; combine() undoes the permutation."""

    def __init__(self, topk_ids: torch.Tensor, expert_device: Sequence[int], devices: Sequence[int]) -> None:
        """topk_ids [N, K]; expert_device[e]: the device hosting expert e; devices: every expert device."""
        self.shape = tuple(topk_ids.shape)  # (N, K)
        self.experts = topk_ids.reshape(-1)  # [N * K] flat = row * K + k
        where = torch.tensor(expert_device, dtype=torch.int64)[self.experts]  # [N * K] device per copy
        self.order = torch.argsort(where, stable=True)  # copies grouped by device, row order kept within
        counts = torch.bincount(where, minlength=max(devices) + 1)
        self.sizes = {d: int(counts[d]) for d in devices}
        self.offsets, start = {}, 0
        for d in sorted(devices):  # argsort groups by ascending device id
            self.offsets[d] = start
            start += self.sizes[d]

    def rows_for(
        self, dest: int, block: int, moe_input, topk_weights, request_ids, positions
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The message body for device `dest` (exchange.frame: [1 + n, H], inputs in rows 1..) and per-row
        metadata (expert, weight, slot, who)."""
        lo = self.offsets[dest]
        flat = self.order[lo : lo + self.sizes[dest]]  # [n]
        row, k = flat // self.shape[1], flat % self.shape[1]
        experts = self.experts[flat]
        meta = {
            "request_id": request_ids[row],
            "position": positions[row],
            "kind": torch.full_like(row, core.EXPERT),
            "block": torch.full_like(row, block),
            "index": experts,
            "expert_id": experts,
            "slot": k + 1,
            "weight": topk_weights.reshape(-1)[flat],
        }
        body = frame(row.numel(), moe_input)
        torch.index_select(moe_input, 0, row, out=body[1:])
        return body, meta

    def combine(self, parcels: dict[int, Parcel], like: torch.Tensor) -> torch.Tensor:
        """Each device's outputs (in the order sent) → expert_out [N, K, H] in router order."""
        n, k = self.shape
        hidden = like.shape[1]
        out = like.new_empty(n * k, hidden)
        for d, lo in self.offsets.items():
            got = parcels[d].data
            if got.shape[0] != self.sizes[d]:
                raise ValueError(f"device {d} returned {got.shape[0]} rows for {self.sizes[d]} sent")
            out[self.order[lo : lo + self.sizes[d]]] = got.to(out.dtype)
        return out.view(n, k, hidden)


def run_experts(
    executor, block: int, parcels: dict[int, Parcel], hidden: int, stats: SyncStats
) -> dict[int, torch.Tensor]:
    """Every hosted expert once on all rows received for it (from all sources) → per source, its message body
    (exchange.frame: [1 + n, H]) with the outputs in the order the source sent its rows."""
    srcs = sorted(parcels)
    sizes = [parcels[s].num_rows for s in srcs]
    x = torch.cat([parcels[s].data for s in srcs]) if srcs else torch.zeros(0, hidden)  # [M, H]
    fields = ("expert_id", "weight", "request_id", "position")
    meta = {k: torch.cat([parcels[s].meta[k] for s in srcs]) for k in fields}
    # One buffer holds every source's body back to back: source i's rows land one row (its tag row) after the
    # rows of sources before it, so each expert's output is written once, straight into the message it leaves in.
    body = x.new_empty(x.shape[0] + len(srcs), hidden)
    shift = torch.repeat_interleave(torch.arange(1, len(srcs) + 1), torch.tensor(sizes, dtype=torch.int64))
    experts = meta["expert_id"]
    present = torch.unique(experts).tolist()  # ascending expert id; experts without rows do not run
    whole = len(present) == 1  # one expert got every row (EP's usual case): its input needs no gather
    rows = [torch.arange(x.shape[0]) if whole else (experts == e).nonzero().flatten() for e in present]
    batches = [
        LayerBatch(
            kind="expert", block=block, index=e, request_ids=meta["request_id"][idx],
            positions=meta["position"][idx], x=x if whole else x[idx], weights=meta["weight"][idx].float(),
        )
        for e, idx in zip(present, rows)
    ]  # fmt: skip
    with stats.busy():
        outs = executor.run_grouped(batches)  # every hosted expert of the block in one grouped step
    for e, idx, out in zip(present, rows, outs):
        body.index_copy_(0, idx + shift[idx], out.to(body.device, body.dtype))  # host frames (docs/gpu.md)
        stats.count_expert_rows(block, e, idx.numel())
    bodies, start = {}, 0
    for src, n in zip(srcs, sizes):
        bodies[src] = body[start : start + 1 + n]
        bodies[src][0] = 0
        start += 1 + n
    return bodies
