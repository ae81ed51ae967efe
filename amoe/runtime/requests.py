"""The requests of one attention DP rank: admission and validation, abort, KV blocks, stop rules, and the rows that
enter block 0 (a prompt, or each sampled token that goes on). No computation happens here: the rank's compute
(torch, or an emulated GPU) runs the layers, this object decides what the results mean for each request.

Threads: `add`, `abort`, `expire_aborts` and `collect_expired` come from a control thread; everything else runs on
the loop thread. The lock guards the request table, each request's abort state and the block manager between them
(slots are taken when a chunk enters block 0, AMoE §3.2). A request in the batch the loop thread is running keeps
its KV until the batch ends, so a batch never writes into slots freed under it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from amoe.errors import RequestError
from amoe.logprobs import Logprobs
from amoe.model.kv_cache import BlockManager, KVCacheFullError
from amoe.model.logprobs import HeadSample
from amoe.model.sampler import make_generator, sequence_seed
from amoe.request_rules import check_prompt, stop_reason
from amoe.runtime.faults import Faults
from amoe.sampling_params import SamplingParams
from amoe.structured import Grammars


@dataclass(frozen=True)
class Rows:
    """Token rows for ATTN (0, rank), one entry per row: a prompt chunk, or one decode token per request."""

    request_ids: list[int]
    token_ids: list[int]
    positions: list[int]
    chunk_starts: list[int]
    chunk_lens: list[int]

    @classmethod
    def chunk(cls, request_id: int, token_ids: list[int], start: int) -> Rows:
        """One request's chunk of consecutive tokens from position `start`."""
        n = len(token_ids)
        return cls([request_id] * n, list(token_ids), list(range(start, start + n)), [start] * n, [n] * n)

    @classmethod
    def decode(cls, request_ids: list[int], token_ids: list[int], positions: list[int]) -> Rows:
        """One token per request, each its own chunk."""
        return cls(request_ids, token_ids, positions, list(positions), [1] * len(positions))

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class RankRequest:
    """A request bound to this attention rank (or one of its sequences, n > 1: each has its own id)."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # seeded sampling: the same draws whatever shares the batch
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted_at: float | None = None  # monotonic time of the abort: its tokens in flight end it at the head
    expired: bool = False  # its abort was never confirmed in time: it ends at the next batch boundary
    done: threading.Event = field(default_factory=threading.Event)
    num_generated: int = 0  # the prompt's last tokens that are its own output before a move (readmission)
    seed: int | None = None
    grammar: Any = None  # amoe.structured.GrammarState
    forks: list[int] = field(default_factory=list)  # ids of its other sequences, forked at its first sample
    children: list[RankRequest] = field(default_factory=list)  # those sequences, once forked
    # Its prompt's log-probabilities are due with its first token: asked for, and not a request moved from a lost
    # rank (that one reported them there; its "prompt" now ends with its output so far).
    scores_prompt: bool = False

    @property
    def aborted(self) -> bool:
        return self.aborted_at is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt[: len(self.prompt) - self.num_generated]

    @property
    def output_ids(self) -> list[int]:
        """Its output so far, with what it generated before a move (the penalties and min_tokens count it)."""
        return (
            self.prompt[len(self.prompt) - self.num_generated :] + self.output
            if self.num_generated
            else self.output
        )


# (request id, new token ids, finish reason or None) per request of one head step
Outputs = list[tuple[int, list[int], str | None]]


@dataclass(frozen=True)
class HeadOutput:
    """What a head step hands on: the sampled tokens that go on re-enter block 0 (`next`), and what leaves the
    runtime for the coordinator (`tokens`), with the rank's free KV blocks after the finished ones let go.

    A batch whose layer failed ends the same way: no `next`, its requests finished with "error" and why.
    """

    next: Rows
    tokens: Outputs
    kv_free_blocks: int
    error: str | None = None
    # request id -> Logprobs of its new token / of its prompt, for the requests that wanted them (and got a token)
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)

    @classmethod
    def failed(cls, request_ids: list[int], error: str, kv_free_blocks: int = 0) -> HeadOutput:
        return cls(
            Rows.decode([], [], []), [(rid, [], "error") for rid in request_ids], kv_free_blocks, error
        )

    @property
    def finished(self) -> list[int]:
        return [rid for rid, _, reason in self.tokens if reason is not None]


class RankCapacity:
    """What the control plane reads of any runtime's attention rank (AEP or synchronous alike): KV blocks and the
    longest context. An expert-only runtime has no rank: no blocks, and the model's own limit. Mixed into both
    runtimes, which set `attention` (None without a rank) and `model_config`."""

    attention: Any
    model_config: Any

    @property
    def num_kv_blocks(self) -> int:
        return self.attention.requests.blocks.num_total_blocks if self.attention is not None else 0

    @property
    def kv_free_blocks(self) -> int:
        return self.attention.requests.kv_free_blocks if self.attention is not None else 0

    @property
    def max_model_len(self) -> int:
        if self.attention is not None:
            return self.attention.requests.max_model_len
        return self.model_config.max_position_embeddings


class RankRequests:
    """The state of the requests bound to one attention DP rank."""

    def __init__(
        self,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        skip_prefill: bool = False,
        grammars: Grammars | None = None,
        computes_logits: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.blocks = BlockManager(num_kv_blocks, block_size)
        # Emulated decode-only runs (AMoE §5): a prompt's KV counts as written, so only its last token enters,
        # as a decode row whose context is the whole prompt; its KV is reserved when that row reaches block 0.
        self.skip_prefill = skip_prefill
        self.grammars = grammars  # structured output (None: a request asking for it is rejected)
        self.computes_logits = (
            computes_logits  # False: an emulated GPU, which has no log-probabilities to give
        )
        self.faults = Faults.from_env()  # tests only (AMOE_FAULTS)
        self._lock = threading.Lock()  # see the module docstring
        self._requests: dict[int, RankRequest] = {}
        self._running: set[int] = set()  # the requests of the batch the loop thread runs now
        # Aborted and expired requests, so that the per-batch and per-heartbeat sweeps visit only those: a scan of
        # every request measured 1.6 ms a batch at 2,048 requests on a rank (0.2 ms at 512), on the loop thread.
        self._aborted: set[int] = set()
        self._expired: set[int] = set()

    @property
    def kv_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def kv_used_blocks(self) -> int:
        return self.blocks.num_total_blocks - self.blocks.num_free_blocks

    def add(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        num_generated: int = 0,
        seq_ids: Sequence[int] = (),
    ) -> tuple[RankRequest, Rows]:
        """Validate and register a request; returns it and the rows that enter ATTN (0, rank). Any thread.

        A request moved here from a lost rank brings its output so far at the end of its prompt
        (`num_generated` tokens, recomputed like the prompt): its seeded generator skips the draws they took, so
        it samples on exactly as it would have.
        """
        check_prompt(prompt, self.vocab_size, self.max_model_len)
        if not self.computes_logits:
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(params, name) is not None:
                    raise RequestError(f"{name}: the emulated executor computes no logits", name)
        if not 0 <= num_generated < len(prompt):
            raise RequestError(f"num_generated must be in [0, {len(prompt)}), got {num_generated}")
        # A moved request comes back one sequence at a time (its own seed): only a fresh one forks.
        expected = 0 if num_generated else params.num_sequences - 1
        if len(seq_ids) != expected:
            raise RequestError(f"{len(seq_ids)} sequence ids for {expected + 1} sequences")
        if self.faults is not None:
            self.faults.check("admit", [prompt])
        generator = make_generator(params, params.seed)
        if generator is not None and num_generated:
            torch.rand(
                num_generated, generator=generator
            )  # one draw per sampled token, as Sampler takes them
        grammar = None
        if params.grammar is not None:
            if self.grammars is None:
                raise RequestError("this rank serves no structured output", "structured_outputs")
            grammar = self.grammars.matcher(params.grammar)
            for token in prompt[len(prompt) - num_generated :]:  # a moved request's output so far
                grammar.accept(token)
        req = RankRequest(
            list(prompt), params, generator=generator, num_generated=num_generated, seed=params.seed,
            grammar=grammar, forks=list(seq_ids),
            scores_prompt=params.prompt_logprobs is not None and num_generated == 0,
        )  # fmt: skip
        with self._lock:
            if any(rid in self._requests for rid in (request_id, *seq_ids)):
                raise RequestError(f"request id {request_id} is already in use on this rank")
            self._requests[request_id] = req
        if self.skip_prefill:
            return req, Rows.chunk(request_id, prompt[-1:], len(prompt) - 1)
        return req, Rows.chunk(request_id, prompt, 0)

    def abort(self, request_id: int) -> bool:
        """Mark a request aborted; False if it is unknown or finished. Its KV is freed when its token next
        reaches the head (earlier, its rows in flight would write into freed, maybe reused, slots)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            if req.aborted_at is None:
                req.aborted_at = time.monotonic()
                self._aborted.add(request_id)
            return True

    def expire_aborts(self, timeout_s: float) -> list[int]:
        """Requests aborted more than `timeout_s` ago whose tokens never came back to the head (lost with a
        failed runtime or batch): marked expired. The caller makes the engine forget them (so none of their rows
        can enter a batch again), then `collect_expired` frees their KV. Any thread."""
        now = time.monotonic()
        with self._lock:
            due = [
                rid
                for rid in self._aborted
                if not self._requests[rid].expired and now - self._requests[rid].aborted_at > timeout_s
            ]
            for rid in due:
                self._requests[rid].expired = True
                self._expired.add(rid)
        return due

    def collect_expired(self) -> None:
        """Free the KV of expired requests, except those in the batch running now (it may still write their
        slots): those go when it ends. Any thread."""
        with self._lock:
            for rid in [r for r in self._expired if r not in self._running]:
                self._end(rid, "abort")

    def begin_batch(self, request_ids: list[int]) -> None:
        """The loop thread starts a batch of these requests: their KV stays put until `end_batch`."""
        with self._lock:
            self._running = set(request_ids)

    def end_batch(self) -> None:
        with self._lock:
            self._running = set()
        self.collect_expired()

    def fail(self, request_ids: list[int], error: str) -> HeadOutput:
        """End requests whose batch failed (every row of each was in it): free their KV. Loop thread."""
        with self._lock:
            ended = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
            for rid in ended:
                self._end(rid, "error")
        return HeadOutput.failed(ended, error, self.blocks.num_free_blocks)

    def enter(self, request_ids: list[int], chunk_ends: list[int], chunk_lens: list[int]) -> None:
        """KV slots for chunks entering block 0: a new request takes blocks for everything up to its chunk's end
        (with skip_prefill, the prompt it did not compute), a running one grows by its chunk. Loop thread."""
        with self._lock:
            for rid, end, n in zip(request_ids, chunk_ends, chunk_lens):
                if self.blocks.has(rid):
                    self.blocks.append(rid, n)
                else:
                    self.blocks.allocate(rid, end)

    def block_table(self, request_id: int) -> list[int]:
        with self._lock:
            return self.blocks.block_table(request_id)

    def of(self, request_ids: list[int]) -> list[RankRequest]:
        """The requests behind a head batch's chunks, in order."""
        with self._lock:
            return [self._requests[r] for r in request_ids]

    def fork(
        self, request_ids: list[int]
    ) -> tuple[list[int], list[int], list[tuple[list[int], list[int]]], list[int]]:
        """The sequences a head step samples for its chunks (one per chunk, or n for a request just prefilled):
        their ids and each one's chunk; and the KV slots the compute must copy (source, destination) for the
        sequences forked now, each in blocks of its own (copied, not shared: the block manager has no reference
        counts, the copy is one pass over the prompt's K/V, and the coordinator reserved n × (prompt + max_tokens)
        for the request). Also the ids of forks that found no free blocks: they end at once, with "error".
        Loop thread."""
        seq_ids, rows, copies, failed = [], [], [], []
        with self._lock:
            for row, rid in enumerate(request_ids):
                seq_ids.append(rid)
                rows.append(row)
                parent = self._requests[rid]
                if not parent.forks or parent.aborted:
                    continue
                for index, child_id in enumerate(parent.forks, start=1):
                    seed = sequence_seed(parent.seed, index)
                    child = RankRequest(
                        parent.prompt, parent.params, generator=make_generator(parent.params, seed), seed=seed,
                        grammar=parent.grammar.fork() if parent.grammar is not None else None,
                    )  # fmt: skip
                    try:
                        copies.append(self.blocks.fork(rid, child_id))
                    except KVCacheFullError:
                        failed.append(child_id)
                        continue
                    self._requests[child_id] = child
                    parent.children.append(child)
                    seq_ids.append(child_id)
                    rows.append(row)
                parent.forks = []
        return seq_ids, rows, copies, failed

    def advance(
        self,
        request_ids: list[int],
        tokens: list[int],
        context_lens: list[int],
        sample: HeadSample | None = None,
    ) -> HeadOutput:
        """Record one sampled token per request (whose context held `context_lens` tokens): stop rules decide
        who finishes (freeing their KV); the others' tokens go on to block 0. The log-probabilities `sample`
        computed go out with the tokens. Loop thread."""
        go_on, go_tokens, go_pos, outputs = [], [], [], []
        logprobs, prompts = {}, {}
        with self._lock:
            for i, (rid, token, ctx) in enumerate(zip(request_ids, tokens, context_lens)):
                req = self._requests[rid]
                new = [] if req.aborted else [token]
                if new and sample is not None:
                    if sample.logprobs is not None and sample.logprobs[i] is not None:
                        logprobs[rid] = sample.logprobs[i]
                    if i in sample.prompt_logprobs:
                        prompts[rid] = sample.prompt_logprobs[i]
                        req.scores_prompt = False
                req.output += new
                if new and req.grammar is not None:
                    req.grammar.accept(token)
                req.finish_reason = "abort" if req.aborted else self._stop_reason(req, token, ctx + 1)
                outputs.append((rid, new, req.finish_reason))
                if req.finish_reason is None:
                    go_on.append(rid)
                    go_tokens.append(token)
                    go_pos.append(ctx)
                else:
                    self._end(rid, req.finish_reason)
        return HeadOutput(
            Rows.decode(go_on, go_tokens, go_pos),
            outputs,
            self.blocks.num_free_blocks,
            logprobs=logprobs,
            prompt_logprobs=prompts,
        )

    def _end(self, request_id: int, reason: str) -> None:
        """Under the lock: free a request's KV and drop it."""
        req = self._requests.pop(request_id)
        self._aborted.discard(request_id)
        self._expired.discard(request_id)
        req.finish_reason = req.finish_reason or reason
        self.blocks.free(request_id)
        req.done.set()

    def _stop_reason(self, req: RankRequest, token: int, num_tokens: int) -> str | None:
        reason = stop_reason(
            req.params,
            token,
            num_output=len(req.output),
            num_tokens=num_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
        )
        if reason is None and req.grammar is not None and req.grammar.is_done:
            return "stop"  # the output is complete: only its end could follow (vLLM stops here too)
        return reason
