"""LocalEngine: the single-process reference engine (continuous batching, every layer in this process).

A step reads: schedule → run the model block by block → sample → stop checks. Token-level stops (eos unless
ignore_eos, stop_token_ids, max_tokens, the model length) are decided here; stop *strings* need detokenised text
and are checked by the caller that owns the tokenizer (amoe.llm.LLM, later the coordinator), which aborts the
request once one appears.
"""

from __future__ import annotations

import itertools
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
from amoe.model.logprobs import prompt_logprobs
from amoe.model.sampler import Sampler, make_generator, sample_sequences, sequence_seed
from amoe.offload.store import format_size
from amoe.request_rules import SeedSource, check_prompt, stop_reason
from amoe.sampling_params import SamplingParams
from amoe.structured import Grammars

logger = logging.getLogger(__name__)


class LocalEngine:
    """Serves requests of one model in this process; the exactness reference for the distributed runtimes."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.device = devices.runtime_device(self.config.device)
        dtype = devices.model_dtype(self.config.dtype or "auto", self.model_config.dtype, self.device)
        self.runner = ModelRunner(
            model_dir,
            self.model_config,
            self.config.block_size,
            dtype,
            self.device,
            offload=self.config.offload,
        )
        num_kv_blocks = self.config.num_kv_blocks or self._kv_blocks(dtype)
        self.runner.allocate_kv(num_kv_blocks)
        if self.runner.offload.store is not None:
            logger.info(
                "[offload] this process: beside --offload-budget, the KV cache of %d blocks (%s, resident as "
                "requests write it) and the engine's working memory (docs/offload.md, 'Resident memory')",
                num_kv_blocks, format_size(self.runner.kv_bytes()),
            )  # fmt: skip
        self.blocks = BlockManager(num_kv_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.sampler = Sampler()
        # A request must fit the cache alone, so the cache size also bounds its length.
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_kv_blocks * self.config.block_size,
        )
        self._requests: dict[int, Request] = {}  # by engine id: every live sequence
        self._families: dict[int, list[Request]] = {}  # by the caller's request id: its live sequences
        self._extra_ids = itertools.count(-1, -1)  # engine ids of extra sequences: never a caller's id
        self._seeds = SeedSource(self.config.seed)
        self.grammars = Grammars.for_model(
            model_dir, self.model_config.vocab_size, self.model_config.stop_token_ids
        )
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
            unfilled_bytes=self.runner.offload.unfilled_bytes(),
        )
        logger.info(budget.describe(bs, limit))
        return budget.num_blocks

    def add_request(
        self, request_id: int, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request; it prefills in the next step that has room for its whole prompt."""
        params = params or SamplingParams()
        if request_id in self._families:
            raise RequestError(f"request id {request_id} is already in use")
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        seed = self._seeds.resolve(params)
        request = Request(
            request_id, list(prompt_token_ids), params, generator=make_generator(params, seed),
            num_forks=params.num_sequences - 1, seed=seed, grammar=grammar,
        )  # fmt: skip
        self._requests[request_id] = request
        self._families[request_id] = [request]
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
        rows, seqs, new_tokens = [], [], []
        for row, chunk in enumerate(chunks):
            family = [chunk.request, *self._fork(chunk)]
            rows += [row] * len(family)
            seqs += family
            new_tokens += [len(chunk.token_ids)] + [0] * (len(family) - 1)  # forks hold their KV already
        eos = self.model_config.stop_token_ids
        tokens, logprobs = sample_sequences(self.sampler, logits, rows, seqs, eos)
        prompts = {row: self._prompt_logprobs(head, row, chunks[row].request) for row in scored}
        return [
            # A prompt's log-probabilities go out once, with its chunk's own request (the first of its family).
            self._postprocess(seq, token, n, logprobs[i], prompts.pop(row, None))
            for i, (seq, row, token, n) in enumerate(zip(seqs, rows, tokens, new_tokens))
        ]

    @staticmethod
    def _prompt_logprobs(head: HeadRows, chunk: int, request: Request) -> Logprobs:
        """The prompt's tokens scored by the rows before them (its chunk starts at position 0)."""
        first, n = head.first[chunk], len(request.prompt_token_ids) - 1
        rows = torch.arange(first, first + n, device=head.residual.device)
        return prompt_logprobs(head.logits_at, rows, request.prompt_token_ids, request.params.prompt_logprobs)

    def _fork(self, chunk: ScheduledChunk) -> list[Request]:
        """At a request's first sample, its other sequences (n > 1): each a copy of its prompt's KV in blocks of
        its own, sampling from the same logits row with its own seed and grammar state from here on. Copied, not
        shared: the cache has no reference counts, and a copy costs one pass over the prompt's K/V against the
        prefill's pass over every weight. A fork that finds no free blocks waits and prefills alone (preemption's
        recompute: the same tokens, only slower)."""
        parent = chunk.request
        if not parent.num_forks:
            return []
        forks = []
        for index in range(1, parent.num_forks + 1):
            child = Request(
                next(self._extra_ids), parent.prompt_token_ids, parent.params,
                generator=make_generator(parent.params, sequence_seed(parent.seed, index)),
                client_id=parent.request_id, index=index, seed=sequence_seed(parent.seed, index),
                grammar=parent.grammar.fork() if parent.grammar is not None else None,
            )  # fmt: skip
            self._requests[child.request_id] = child
            self._families[parent.request_id].append(child)
            self.scheduler.adopt(child, parent, len(chunk.token_ids), self.runner.kv)
            forks.append(child)
        parent.num_forks = 0
        return forks

    def abort(self, request_id: int, index: int | None = None) -> EngineOutput | None:
        """Stop a request now (or only its sequence `index`) and free its KV; unknown or finished ids are
        ignored. The output reports the request's end, or the sequence's."""
        family = self._families.get(request_id, [])
        ended = [r for r in family if index is None or r.index == index]
        if not ended:
            return None
        for request in ended:
            self.runner.offload.end(request.request_id)
            del self._requests[request.request_id]
            family.remove(request)
            self.scheduler.finish(request)
            request.finish_reason = "abort"
        if not family:
            del self._families[request_id]
        return EngineOutput(request_id, [], finished=True, finish_reason="abort", index=index or 0)

    def sequences(self, request_id: int) -> list[int]:
        """The indices of a request's sequences still running (or yet to fork)."""
        family = self._families.get(request_id, [])
        pending = [i for r in family for i in range(r.index + 1, r.index + 1 + r.num_forks)]
        return [r.index for r in family] + pending

    def abort_all(self) -> list[int]:
        """Abort every request (e.g. after a step failed midway); their ids."""
        ids = list(self._families)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def offload_stats(self) -> dict | None:
        """The expert store's counters (docs/metrics.md), or None when every expert is resident."""
        return self.runner.offload.stats()

    def close(self) -> None:
        """Stop the expert store's I/O thread and close the routing record; idempotent."""
        self.runner.offload.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _postprocess(
        self,
        request: Request,
        token: int,
        num_new: int,
        logprobs: Logprobs | None = None,
        prompt: Logprobs | None = None,
    ) -> EngineOutput:
        request.num_cached_tokens += num_new
        request.output_token_ids.append(token)
        if request.grammar is not None:
            request.grammar.accept(token)
        reason = self._finish_reason(request, token)
        if reason is not None:
            request.finish_reason = reason
            self.runner.offload.end(request.request_id)
            self.scheduler.finish(request)
            del self._requests[request.request_id]
            family = self._families[request.client_id]
            family.remove(request)
            if not family:
                del self._families[request.client_id]
        return EngineOutput(
            request.client_id, [token], finished=reason is not None, finish_reason=reason, index=request.index,
            logprobs=logprobs, prompt_logprobs=prompt,
        )  # fmt: skip

    def _finish_reason(self, request: Request, token: int) -> str | None:
        reason = stop_reason(
            request.params,
            token,
            num_output=len(request.output_token_ids),
            num_tokens=request.num_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.stop_token_ids,
        )
        if reason is None and request.grammar is not None and request.grammar.is_done:
            return "stop"  # the output is complete: only its end could follow (vLLM stops here too)
        return reason


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    """Its prompt's log-probabilities are due: asked for, and this is the first prefill of the request itself (a
    preempted request's recomputation, which starts over with tokens already sent, reported them before; a fork
    that waited for blocks and prefills alone shares its parent's)."""
    request = chunk.request
    return (
        request.params.prompt_logprobs is not None
        and chunk.start_position == 0
        and not request.output_token_ids
        and request.index == 0
    )
