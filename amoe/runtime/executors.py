"""Executors: run the layer a batch names. Experts are stateless. An attention rank is two parts composed: its
requests (amoe.runtime.requests.RankRequests: admission, KV blocks, stop rules, re-entry of sampled tokens) and its
compute — `TorchAttention` here (attention + head + sampler over a paged KV cache), or an emulated GPU's timed hold
(amoe.runtime.emulated.EmulatedAttention). Either compute offers:

    attend(batch, request_ids, requests) -> (residual, moe_input, topk_ids, topk_weights)   # blocks 0..B-1
    sample(batch, rows, seqs) -> HeadSample: a token per sequence (j from chunk rows[j]), log-probs if wanted
    copy_kv(copies)    # a request's sequences forked from its prefill (n > 1): (source, destination) slots
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Any

import torch

from amoe import core
from amoe.device import CPU, Device
from amoe.model.attention import AttnInput, AttnPlan
from amoe.model.config import ModelConfig
from amoe.model.kv_cache import kv_cache_for
from amoe.model.layers import AttentionRank, ExpertLayer
from amoe.model.logprobs import HeadSample, prompt_logprobs
from amoe.model.moe import GroupedExperts
from amoe.model.sampler import Sampler, sample_sequences
from amoe.runtime.requests import HeadOutput, RankRequest, RankRequests

logger = logging.getLogger(__name__)


class ExpertExecutor:
    """Runs the ExpertLayers (block, expert) of an expert batch, on the device that holds their weights. A batch of
    several experts' rows (an AEP grouped step, core.Batch.group_experts) runs each block's same-width experts as
    one grouped GEMM per projection where that is checked bitwise against one F.linear per expert
    (amoe.model.moe.GroupedExperts: float32 on the CPU), else expert by expert: the same floats either way."""

    def __init__(
        self, layers: dict[tuple[int, int], ExpertLayer], device: Device = CPU, offload=None
    ) -> None:
        self.layers = layers  # with offloading: only the shared experts; the routed ones are the store's
        self.device = device
        self.offload = offload  # amoe.offload.wiring.Offload with a store, or None
        # block -> [(GroupedExperts, its experts in stack order)], one per width of the block's hosted experts (a
        # shared expert of another width stays on its own).
        self.grouped: dict[int, list[tuple[GroupedExperts, list[int]]]] = {}
        self._stack(sorted({block for block, _ in layers}))

    def _stack(self, blocks: list[int]) -> None:
        """(Re)build these blocks' grouped stacks from their layers now (the old stacks' memory goes with them)."""
        sample = next(iter(self.layers.values()), None)
        if (
            self.offload is not None
            or sample is None
            or not GroupedExperts.supported(sample.mlp.gate_up.device, sample.mlp.gate_up.dtype)
        ):
            return
        by_width: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for block, expert in sorted(self.layers):
            if block in blocks:
                shape = tuple(self.layers[(block, expert)].mlp.gate_up.shape)
                by_width.setdefault((block, shape), []).append(expert)
        for block in blocks:
            self.grouped.pop(block, None)
        for (block, _), experts in by_width.items():
            if len(experts) < 2:  # alone now: its own copy, so no old stack stays alive through its views
                mlp = self.layers[(block, experts[0])].mlp
                if mlp.gate_up._base is not None:
                    mlp.gate_up, mlp.down = mlp.gate_up.clone(), mlp.down.clone()
                    mlp.gate, mlp.up = mlp.gate_up.chunk(2, dim=0)
                continue
            stack = GroupedExperts([self.layers[(block, e)] for e in experts])
            for i, e in enumerate(experts):  # the layers keep views of the stack: the weights are held once
                mlp = self.layers[(block, e)].mlp
                mlp.gate_up, mlp.down = stack.gate_up[i], stack.down[i]
                mlp.gate, mlp.up = mlp.gate_up.chunk(2, dim=0)
            self.grouped.setdefault(block, []).append((stack, experts))

    def add(self, layers: dict[tuple[int, int], ExpertLayer]) -> int:
        """Joined replicas' layers, on the loop thread between two batches (no batch holds the stacks); their
        blocks are stacked again with them. Returns their weight bytes."""
        self.layers.update(layers)
        self._stack(sorted({block for block, _ in layers}))
        return sum(_layer_bytes(layer) for layer in layers.values())

    def remove(self, keys: list[tuple[int, int]]) -> int:
        """Drained replicas' layers go, on the loop thread between two batches; their blocks are stacked again
        without them, so their weights are freed. Returns the bytes freed."""
        gone = [self.layers.pop(key) for key in keys if key in self.layers]
        self._stack(sorted({block for block, _ in keys}))
        return sum(_layer_bytes(layer) for layer in gone)

    @torch.inference_mode()
    def run(self, batch: core.Batch) -> torch.Tensor:
        put = self.device.put  # rows that came over a host plane (inline, gloo) go up to the device here
        groups = batch.group_experts
        if self.offload is not None:
            return self._run_offloaded(batch, put(batch.x), put(batch.weights))
        if groups is None or len(groups) == 1:
            expert = batch.index if groups is None else int(groups[0])
            return self.layers[(batch.block, expert)](put(batch.x), put(batch.weights))  # [N, H]
        return self._run_groups(
            batch.block, put(batch.x), put(batch.weights), groups.tolist(), batch.cu_rows.tolist()
        )

    def _run_groups(
        self, block: int, x: torch.Tensor, weights: torch.Tensor, experts: list[int], cu: list[int]
    ) -> torch.Tensor:
        """x [N, H] with expert experts[g]'s rows at cu[g]:cu[g + 1] → [N, H]."""
        rows = {e: (cu[g], cu[g + 1]) for g, e in enumerate(experts)}
        out = torch.empty_like(x)
        for stack, members in self.grouped.get(block, []):
            present = [e for e in members if e in rows]
            if len(present) < 2:
                continue
            spans = [rows.pop(e) for e in present]
            # The stack's experts without rows get empty groups: offsets over every member, in stack order.
            counts = {e: hi - lo for e, (lo, hi) in zip(present, spans)}
            offsets = torch.tensor(
                list(itertools.accumulate(counts.get(e, 0) for e in members)),
                dtype=torch.int32,
                device=x.device,
            )
            xs = torch.cat([x[lo:hi] for lo, hi in spans])  # [S, H] in stack order
            ws = torch.cat([weights[lo:hi] for lo, hi in spans])
            ys = stack(xs, offsets, ws)
            start = 0
            for lo, hi in spans:
                out[lo:hi] = ys[start : start + hi - lo]
                start += hi - lo
        for e, (lo, hi) in rows.items():  # experts not in a stack (or alone in theirs), one by one
            out[lo:hi] = self.layers[(block, e)](x[lo:hi], weights[lo:hi])
        return out

    def _run_offloaded(self, batch: core.Batch, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The batch's routed experts from the store (resident first, the others' copies overlapping them), the
        shared one from its resident layer; x [N, H] → [N, H]."""
        groups = batch.group_experts
        experts = [batch.index] if groups is None else groups.tolist()
        cu = [0, x.shape[0]] if groups is None else batch.cu_rows.tolist()
        num_routed = self.offload.num_experts
        seqs = batch.request_ids.tolist()
        self.offload.routed_on_expert_side(
            batch.block, [e for e in experts if e < num_routed],
            [seqs[cu[g] : cu[g + 1]] for g, e in enumerate(experts) if e < num_routed],
        )  # fmt: skip
        out = torch.empty_like(x)
        spans = {}
        for g, e in enumerate(experts):
            lo, hi = cu[g], cu[g + 1]
            if e < num_routed:
                spans[e] = (lo, hi)
            else:
                out[lo:hi] = self.layers[(batch.block, e)](x[lo:hi], weights[lo:hi])
        self.offload.run_spans(batch.block, x, weights, out, spans)
        self.offload.end_step()
        return out

    def stats(self) -> dict:
        """The expert store's counters (docs/metrics.md "offload"), when this runtime offloads."""
        offload = self.offload.stats() if self.offload is not None else None
        return {"offload": offload} if offload is not None else {}

    def run_grouped(self, batches: list) -> list[torch.Tensor]:
        """A device's experts of one block, each on its rows (EP's grouped step; torch runs them one by one)."""
        return [self.run(batch) for batch in batches]

    @torch.inference_mode()
    def run_experts(self, batches: list, kernel: str) -> list[torch.Tensor]:
        """A chunk of an EP expert pipeline (`--ep-kernel`): "grouped" runs the block's experts as one grouped GEMM
        per projection where GroupedExperts can (the floats of one GEMM per expert, checked bitwise), "dense" one
        GEMM per expert."""
        if kernel == "dense" or len(batches) < 2:
            return [self.run(batch) for batch in batches]
        put = self.device.put
        block = batches[0].block
        sizes = [b.num_rows for b in batches]
        cu = [0, *itertools.accumulate(sizes)]
        x = put(torch.cat([b.x for b in batches]))  # [S, H] expert by expert
        weights = put(torch.cat([b.weights for b in batches]))
        out = self._run_groups(block, x, weights, [b.index for b in batches], cu)
        return [out[lo:hi] for lo, hi in zip(cu, cu[1:])]


def _layer_bytes(layer: ExpertLayer) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.mlp.gate_up, layer.mlp.down))


class AttentionExecutor:
    """An attention DP rank as the runtime loop runs it: its requests, and the compute that runs their layers.

    run(batch) returns what core.submit hands on: for blocks 0..B-1 the attention outputs, for the head a
    HeadOutput (the tokens that go on re-enter block 0; the sampled tokens leave the runtime).
    """

    def __init__(self, requests: RankRequests, compute: Any, cfg: ModelConfig, offload=None) -> None:
        self.requests = requests
        self.compute = compute
        self.num_blocks = cfg.num_blocks
        self.offload = (
            offload  # amoe.offload.wiring.Offload recording the routing (--offload-record), or None
        )
        # Tokens routed per (block, expert), for the runtime stats; only ever grows, so a racing read is safe.
        self.routed = torch.zeros(cfg.num_blocks, cfg.num_expert_ids, dtype=torch.int64)

    @torch.inference_mode()
    def run(self, batch: core.Batch):
        rids = batch.request_ids[batch.cu_rows[:-1]].tolist()  # [R] one per chunk
        self.requests.begin_batch(rids)
        try:
            return self._run(batch, rids)
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its own requests, never the runtime
            logger.exception("attention(%d) failed for requests %s", batch.block, rids)
            return self.requests.fail(rids, f"{type(exc).__name__}: {exc}")
        finally:
            self.requests.end_batch()

    def _run(self, batch: core.Batch, rids: list[int]):
        if self.requests.faults is not None:  # tests only (AMOE_FAULTS)
            prompts = [r.prompt for r in self.requests.of(rids)]
            self.requests.faults.check("attend", prompts)
            self.requests.faults.check("wedge", prompts)
        if batch.block == self.num_blocks:
            return self._head(batch, rids)
        if batch.block == 0:  # KV slots are taken when a chunk enters block 0 (paper §3.2)
            lens = (batch.cu_rows[1:] - batch.cu_rows[:-1]).tolist()
            self.requests.enter(rids, batch.context_lens.tolist(), lens)
        out = self.compute.attend(batch, rids, self.requests)
        self.routed[batch.block] += torch.bincount(out[2].flatten(), minlength=self.routed.shape[1])
        if self.offload is not None:
            self.offload.routed(batch.block, rids, out[2], batch.cu_rows)
        return out

    def _head(self, batch: core.Batch, rids: list[int]) -> HeadOutput:
        """Sample every sequence of the batch's chunks (forking those of a request just prefilled), then let the
        requests decide who goes on."""
        seq_ids, rows, copies, failed = self.requests.fork(rids)
        if copies:
            self.compute.copy_kv(copies)
        sample = self.compute.sample(batch, rows, self.requests.of(seq_ids))
        context_lens = batch.context_lens.tolist()
        out = self.requests.advance(seq_ids, sample.tokens, [context_lens[r] for r in rows], sample)
        if self.offload is not None:
            for rid in out.finished:
                self.offload.end(rid)
        if not failed:
            return out
        logger.error("no KV blocks to fork sequences %s: they fail", failed)
        ended = [(rid, [], "error") for rid in failed]
        return dataclasses.replace(out, tokens=out.tokens + ended, error="no KV blocks for a sequence")

    def stats(self) -> dict:
        """The compute's own counters (an emulated GPU's clock), if it keeps any."""
        return self.compute.stats() if hasattr(self.compute, "stats") else {}


class TorchAttention:
    """Attention of every block, the head and the sampler of one rank, in torch, over the rank's paged KV cache.

    Everything runs on `device`, where the weights and the KV cache are. The host works out the batch's indices
    (slots, masks) from its metadata and sends them up once per batch; what comes back down is only the routing
    (top-k ids and weights, which the engine dispatches on) and the sampled token ids.
    """

    def __init__(
        self,
        model: AttentionRank,
        cfg: ModelConfig,
        num_kv_blocks: int,
        block_size: int,
        device: Device = CPU,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        dtype = model.head.lm_head.dtype
        self.kv = kv_cache_for(cfg, num_kv_blocks, block_size, dtype, device.torch)
        self.sampler = Sampler()
        self.eos_token_ids = cfg.stop_token_ids

    def attend(self, batch: core.Batch, request_ids: list[int], requests: RankRequests):
        out = self.model.layers[batch.block](self._input(batch, request_ids, requests), self.kv)
        host = self.device.host
        return out.residual, out.moe_input, host(out.topk_ids), host(out.topk_weights)

    def sample(self, batch: core.Batch, rows: list[int], seqs: list[RankRequest]) -> HeadSample:
        """Sequence j samples from the logits of chunk rows[j]; the rank's logits processors run here, with it."""
        put, head = self.device.put, self.model.head
        residual, expert_out, expert_ids = put(batch.residual), put(batch.expert_out), put(batch.expert_ids)
        logits = head(residual, expert_out, expert_ids, batch.cu_rows)  # [R, V]
        tokens, logprobs = sample_sequences(self.sampler, logits, rows, seqs, self.eos_token_ids)
        if not any(seq.scores_prompt for seq in seqs):
            return HeadSample(tokens, logprobs)
        prompts = {}
        starts = batch.cu_rows[:-1].tolist()
        for j, (c, seq) in enumerate(zip(rows, seqs)):
            # The prompt's first prefill is the chunk that starts at position 0 (every row of it is here); only
            # the chunk's own request scores it (its forks, sampled from the same chunk, do not).
            if seq.scores_prompt and int(batch.positions[starts[c]]) == 0:
                at = torch.arange(starts[c], starts[c] + len(seq.prompt) - 1, device=residual.device)
                logits_at = functools.partial(head.logits_at, residual, expert_out, expert_ids)
                prompts[j] = prompt_logprobs(logits_at, at, seq.prompt, seq.params.prompt_logprobs)
        return HeadSample(tokens, logprobs, prompts)

    def copy_kv(self, copies: list[tuple[list[int], list[int]]]) -> None:
        put = self.device.put
        for src, dst in copies:
            self.kv.copy(put(torch.tensor(src)), put(torch.tensor(dst)))

    def _input(self, batch: core.Batch, request_ids: list[int], requests: RankRequests) -> AttnInput:
        tables = [requests.block_table(rid) for rid in request_ids]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [R, max_blocks]
        lens = batch.cu_rows[1:] - batch.cu_rows[:-1]  # [R]
        chunk_of_row = torch.repeat_interleave(torch.arange(len(request_ids)), lens)  # [N]
        bs, pos = self.block_size, batch.positions
        slot_mapping = block_tables[chunk_of_row, pos // bs] * bs + pos % bs  # [N]
        plan = AttnPlan.build(
            pos, batch.cu_rows, batch.context_lens, block_tables, bs, self.cfg.sliding_window
        )  # on the host, from host metadata: no device sync
        put = self.device.put
        return AttnInput(
            positions=put(pos),
            slot_mapping=put(slot_mapping),
            cu_rows=batch.cu_rows,
            context_lens=batch.context_lens,
            block_tables=block_tables,
            token_ids=put(batch.token_ids),
            residual=put(batch.residual),
            expert_out=put(batch.expert_out),
            expert_ids=put(batch.expert_ids),
            plan=plan.to(self.device.torch),
        )
