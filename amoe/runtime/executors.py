"""Executors: run the layer a batch names. Experts are stateless; the attention executor also owns its rank's
KV cache, block manager, sampler and the state of the requests bound to the rank."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from amoe import core
from amoe.model.attention import AttnInput
from amoe.model.config import ModelConfig
from amoe.model.kv_cache import BlockManager, PagedKVCache
from amoe.model.layers import AttentionRank, ExpertLayer
from amoe.model.sampler import Sampler
from amoe.sampling_params import SamplingParams


class ExpertExecutor:
    """Runs ExpertLayer (block, expert) on an expert batch."""

    def __init__(self, layers: dict[tuple[int, int], ExpertLayer]) -> None:
        self.layers = layers

    @torch.inference_mode()
    def run(self, batch: core.Batch) -> torch.Tensor:
        return self.layers[(batch.block, batch.index)](batch.x, batch.weights)  # [N, H]


@dataclass
class RankRequest:
    """A request bound to this attention rank."""

    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AttentionExecutor:
    """Attention of every block, the head and the sampler for the requests of one DP rank."""

    def __init__(
        self,
        engine: core.Engine,
        model: AttentionRank,
        cfg: ModelConfig,
        kv_blocks: int,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.engine = engine
        self.model = model
        self.cfg = cfg
        self.blocks = BlockManager(kv_blocks, block_size)
        self.kv = PagedKVCache(
            cfg.num_blocks, kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.head.lm_head.dtype
        )
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.requests: dict[int, RankRequest] = {}

    def add_request(self, request_id: int, prompt: list[int], params: SamplingParams) -> RankRequest:
        """Bind a request to this rank; its prompt enters ATTN (0, rank) as one chunk."""
        req = RankRequest(list(prompt), params)
        self.requests[request_id] = req
        n = len(prompt)
        self._add_tokens([request_id], prompt, [0] * n if n else [], n)
        return req

    @torch.inference_mode()
    def run(self, batch: core.Batch):
        inp = self._attn_input(batch)
        if batch.block < self.cfg.num_blocks:
            out = self.model.layers[batch.block](inp, self.kv)
            return out.residual, out.moe_input, out.topk_ids, out.topk_weights
        logits = self.model.head(inp.residual, inp.expert_out, inp.expert_ids, inp.cu_rows)  # [R, V]
        self._sample(batch, logits)
        return None

    def _attn_input(self, batch: core.Batch) -> AttnInput:
        cu = batch.cu_rows.tolist()
        rids = batch.request_ids[batch.cu_rows[:-1]].tolist()  # [R]
        if batch.block == 0:  # KV slots are allocated when a chunk enters block 0 (paper §3.2)
            for rid, lo, hi in zip(rids, cu, cu[1:]):
                key = str(rid)
                if self.blocks.has(key):
                    self.blocks.append(key, hi - lo)
                else:
                    self.blocks.allocate(key, hi - lo)
        tables = [self.blocks.block_table(str(rid)) for rid in rids]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [R, max_blocks]
        lens = batch.cu_rows[1:] - batch.cu_rows[:-1]  # [R]
        chunk_of_row = torch.repeat_interleave(torch.arange(len(rids)), lens)  # [N]
        bs = self.blocks.block_size
        pos = batch.positions
        slot_mapping = block_tables[chunk_of_row, pos // bs] * bs + pos % bs  # [N]
        return AttnInput(
            positions=pos,
            slot_mapping=slot_mapping,
            cu_rows=batch.cu_rows,
            context_lens=batch.context_lens,
            block_tables=block_tables,
            token_ids=batch.token_ids,
            residual=batch.residual,
            expert_out=batch.expert_out,
            expert_ids=batch.expert_ids,
        )

    def _sample(self, batch: core.Batch, logits: torch.Tensor) -> None:
        rids = batch.request_ids[batch.cu_rows[:-1]].tolist()
        reqs = [self.requests[r] for r in rids]
        tokens = self.sampler(logits, [r.params for r in reqs], [None] * len(reqs))
        go_on, go_tokens, go_pos = [], [], []
        for rid, req, token, ctx in zip(rids, reqs, tokens, batch.context_lens.tolist()):
            req.output.append(token)
            req.finish_reason = self._finish_reason(req, token, ctx + 1)
            if req.finish_reason is None:
                go_on.append(rid)
                go_tokens.append(token)
                go_pos.append(ctx)
            else:
                self.blocks.free(str(rid))
                del self.requests[rid]
                req.done.set()
        if go_on:
            self._add_tokens(go_on, go_tokens, go_pos, 1)

    def _finish_reason(self, req: RankRequest, token: int, num_tokens: int) -> str | None:
        if (
            not req.params.ignore_eos and token in self.cfg.stop_token_ids
        ) or token in req.params.stop_token_ids:
            return "stop"
        if len(req.output) >= req.params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _add_tokens(self, rids: list[int], tokens: list[int], starts: list[int], chunk_len: int) -> None:
        n = len(tokens)
        rows = torch.tensor(rids if chunk_len == 1 else rids * n)
        positions = torch.tensor(starts) + (torch.arange(n) if chunk_len > 1 else 0)
        self.engine.add_tokens(
            rows, torch.tensor(tokens), positions, torch.tensor(starts), torch.full((n,), chunk_len)
        )
