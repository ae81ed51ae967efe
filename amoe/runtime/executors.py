"""Executors: run the layer a batch names. Experts are stateless; the attention executor also owns its rank's
KV cache, block manager, sampler and the state of the requests bound to the rank."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amoe import core
from amoe.errors import RequestError
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
    generator: torch.Generator | None = None  # seeded sampling: the same draws whatever shares the batch
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False  # its tokens are still in flight; it ends (and frees its KV) at the head
    done: threading.Event = field(default_factory=threading.Event)


# (request id, new token ids, finish reason or None) per request of one head step
Outputs = list[tuple[int, list[int], str | None]]


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
        # add_request / abort come from a control thread while the loop thread samples: the lock keeps
        # `requests` and each request's aborted flag consistent. Blocks are touched by the loop thread only.
        self._lock = threading.Lock()
        self.requests: dict[int, RankRequest] = {}
        self.on_output: Callable[[Outputs], None] | None = None  # called on the loop thread after a head step
        # Tokens routed per (block, expert), for the runtime stats.
        self.routed = torch.zeros(cfg.num_blocks, cfg.num_experts, dtype=torch.int64)

    def add_request(self, request_id: int, prompt: list[int], params: SamplingParams) -> RankRequest:
        """Bind a request to this rank; its prompt enters ATTN (0, rank) as one chunk. Any thread."""
        req = self._bind(request_id, prompt, params)
        n = len(prompt)
        self._add_tokens([request_id], prompt, [0] * n if n else [], n)
        return req

    def _bind(self, request_id: int, prompt: list[int], params: SamplingParams) -> RankRequest:
        """Validate and register a request (no tokens enter yet)."""
        self._validate(request_id, prompt)
        req = RankRequest(list(prompt), params, generator=_generator(params))
        with self._lock:
            self.requests[request_id] = req
        return req

    def abort(self, request_id: int) -> bool:
        """Mark a request aborted; False if it is unknown or finished. Its KV is freed when its token next
        reaches the head (earlier, its rows in flight would write into freed, maybe reused, slots)."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            req.aborted = True
            return True

    @property
    def kv_used_blocks(self) -> int:
        return self.blocks.num_total_blocks - self.blocks.num_free_blocks

    @torch.inference_mode()
    def run(self, batch: core.Batch):
        inp = self._attn_input(batch)
        if batch.block < self.cfg.num_blocks:
            out = self.model.layers[batch.block](inp, self.kv)
            self.routed[batch.block] += torch.bincount(out.topk_ids.flatten(), minlength=self.cfg.num_experts)
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
        with self._lock:
            reqs = [self.requests[r] for r in rids]
        tokens = self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs])
        go_on, go_tokens, go_pos, outputs = [], [], [], []
        with self._lock:
            for rid, req, token, ctx in zip(rids, reqs, tokens, batch.context_lens.tolist()):
                new = [] if req.aborted else [token]
                req.output += new
                req.finish_reason = "abort" if req.aborted else self._finish_reason(req, token, ctx + 1)
                outputs.append((rid, new, req.finish_reason))
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
        if self.on_output is not None:
            self.on_output(outputs)

    def _validate(self, request_id: int, prompt: list[int]) -> None:
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) > self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the limit is {self.max_model_len}")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id} is already in use on this rank")

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


def _generator(params: SamplingParams) -> torch.Generator | None:
    if params.is_greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()  # nondeterministic, as asked
    else:
        generator.manual_seed(params.seed)
    return generator
