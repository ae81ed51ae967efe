"""LocalEngine: the single-process reference engine (continuous batching, every layer in this process).

A step reads: schedule → run the model block by block → sample → stop checks. Token-level stops (eos unless
ignore_eos, stop_token_ids, max_tokens, the model length) are decided here; stop *strings* need detokenised text
and are checked by the caller that owns the tokenizer (amoe.llm.LLM, later the coordinator), which aborts the
request once one appears.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from amoe import device as devices
from amoe.engine.config import EngineConfig
from amoe.engine.model_runner import HeadRows, ModelRunner
from amoe.engine.request import EngineOutput, Request
from amoe.engine.scheduler import ScheduledChunk, Scheduler
from amoe.errors import RequestError
from amoe.logprobs import Logprobs
from amoe.model.config import ModelConfig, load_model_config
from amoe.model.kv_cache import BlockManager
from amoe.model.logprobs import prompt_logprobs, sample
from amoe.model.sampler import Sampler, make_generator
from amoe.request_rules import SeedSource, check_prompt, stop_reason
from amoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LocalEngine:
    """Serves requests of one model in this process; the exactness reference for the distributed runtimes."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.device = devices.runtime_device(self.config.device)
        dtype = devices.model_dtype(self.config.dtype or "auto", self.model_config.dtype, self.device)
        self.runner = ModelRunner(model_dir, self.model_config, self.config.block_size, dtype, self.device)
        num_kv_blocks = self.config.num_kv_blocks or self._kv_blocks(dtype)
        self.runner.allocate_kv(num_kv_blocks)
        self.blocks = BlockManager(num_kv_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.sampler = Sampler()
        # A request must fit the cache alone, so the cache size also bounds its length.
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_kv_blocks * self.config.block_size,
        )
        self._requests: dict[int, Request] = {}
        self._seeds = SeedSource(self.config.seed)
        logger.info("[engine] local engine ready: %s, max_model_len %d", model_dir, self.max_model_len)

    def _kv_blocks(self, dtype) -> int:
        """What memory_utilization of the device leaves for KV after the weights (amoe.device.kv_budget)."""
        cfg, bs = self.model_config, self.config.block_size
        limit = min(self.config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        per_request = devices.blocks_for(limit, bs)
        budget = devices.kv_budget(
            self.device,
            block_bytes=devices.kv_block_bytes(cfg.num_layers, bs, cfg.kv_elements_per_token, dtype),
            utilization=self.config.memory_utilization,
            share=1,
            activation_bytes=4
            * self.config.max_num_batched_tokens
            * (cfg.vocab_size + 8 * cfg.hidden_size)
            * 4,
            max_blocks=self.config.max_num_seqs * per_request,
            blocks_per_request=per_request,
        )
        logger.info(budget.describe(bs, limit))
        return budget.num_blocks

    def add_request(
        self, request_id: int, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request; it prefills in the next step that has room for its whole prompt."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestError(f"request id {request_id} is already in use")
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        generator = make_generator(params, self._seeds.resolve(params))
        request = Request(request_id, list(prompt_token_ids), params, generator=generator)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def step(self) -> list[EngineOutput]:
        """Run one batch (decode rows plus new prompts) through the model; report each scheduled request."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        tables = [self.blocks.block_table(c.request.request_id) for c in chunks]
        scored = [i for i, c in enumerate(chunks) if _scores_prompt(c)]
        head = self.runner.forward(chunks, tables, scored)
        logits = head.logits()  # [R, V]
        requests = [c.request for c in chunks]
        tokens, sampled = sample(
            self.sampler, logits, [r.params for r in requests], [r.generator for r in requests]
        )
        prompts = {i: self._prompt_logprobs(head, i, requests[i]) for i in scored}
        return [
            self._postprocess(chunk, token, sampled[i], prompts.get(i))
            for i, (chunk, token) in enumerate(zip(chunks, tokens))
        ]

    @staticmethod
    def _prompt_logprobs(head: HeadRows, chunk: int, request: Request) -> Logprobs:
        """The prompt's tokens scored by the rows before them (its chunk starts at position 0)."""
        first, n = head.first[chunk], len(request.prompt_token_ids) - 1
        rows = torch.arange(first, first + n, device=head.residual.device)
        return prompt_logprobs(head.logits_at, rows, request.prompt_token_ids, request.params.prompt_logprobs)

    def abort(self, request_id: int) -> EngineOutput | None:
        """Stop a request now and free its KV; unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        return EngineOutput(request_id, [], finished=True, finish_reason="abort")

    def abort_all(self) -> list[int]:
        """Abort every request (e.g. after a step failed midway); their ids."""
        ids = list(self._requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _postprocess(
        self,
        chunk: ScheduledChunk,
        token: int,
        logprobs: Logprobs | None = None,
        prompt: Logprobs | None = None,
    ) -> EngineOutput:
        request = chunk.request
        request.num_cached_tokens += len(chunk.token_ids)
        request.output_token_ids.append(token)
        reason = self._finish_reason(request, token)
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.finish(request)
            del self._requests[request.request_id]
        return EngineOutput(
            request.request_id,
            [token],
            finished=reason is not None,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_logprobs=prompt,
        )

    def _finish_reason(self, request: Request, token: int) -> str | None:
        return stop_reason(
            request.params,
            token,
            num_output=len(request.output_token_ids),
            num_tokens=request.num_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.stop_token_ids,
        )


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    """Its prompt's log-probabilities are due: asked for, and this is the first prefill (a preempted request's
    recomputation, which starts over with tokens already sent, reported them before)."""
    request = chunk.request
    return (
        request.params.prompt_logprobs is not None
        and chunk.start_position == 0
        and not request.output_token_ids
    )
