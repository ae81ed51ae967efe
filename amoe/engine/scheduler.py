"""Continuous batching for the local engine: decode rows of running requests plus whole prompts of new ones."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from amoe.engine.request import Request, RequestStatus
from amoe.model.kv_cache import BlockManager, KVCacheFullError

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    request: Request
    token_ids: list[int]  # the chunk's rows
    start_position: int
    slot_mapping: list[int]


class Scheduler:
    """FCFS admission under a KV, sequence and token budget; preempts (for recompute) the newest when KV runs out."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: every running request's decode row first, then as many new prompts as fit."""
        chunks = self._schedule_running()
        num_tokens = len(chunks)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            pending = request.pending_token_ids()
            over_budget = num_tokens + len(pending) > self.max_num_batched_tokens
            # A prompt larger than the budget still runs when it is alone, so it can never starve.
            if (over_budget and num_tokens) or not self.blocks.can_allocate(len(pending)):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(
                self._chunk(request, pending, self.blocks.allocate(request.request_id, len(pending)))
            )
            num_tokens += len(pending)
        return chunks

    def adopt(self, child: Request, parent: Request, num_new: int, kv) -> None:
        """A sequence forked from `parent` as its chunk of `num_new` tokens is sampled: it runs with a copy of the
        parent's KV (`kv`: the cache), or, with no blocks free, waits to prefill prompt + its output alone."""
        child.num_cached_tokens = parent.num_cached_tokens + num_new
        try:
            src, dst = self.blocks.fork(parent.request_id, child.request_id)
        except KVCacheFullError:
            child.num_cached_tokens = 0
            self.waiting.appendleft(child)
            return
        kv.copy(torch.tensor(src), torch.tensor(dst))
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request and free its KV blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        request.status = RequestStatus.FINISHED

    def _schedule_running(self) -> list[ScheduledChunk]:
        chunks = []
        scheduled = 0
        while scheduled < len(self.running):
            request = self.running[scheduled]
            pending = request.pending_token_ids()
            if not self.blocks.can_append(request.request_id, len(pending)):
                # The newest request gives way; it is never one already scheduled (those come before it).
                self._preempt(self.running[-1])
                continue
            chunks.append(self._chunk(request, pending, self.blocks.append(request.request_id, len(pending))))
            scheduled += 1
        return chunks

    def _preempt(self, request: Request) -> None:
        """Free a running request's KV; it waits at the front and recomputes prompt + outputs later."""
        logger.info("[engine] KV cache full: preempting request %s", request.request_id)
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    @staticmethod
    def _chunk(request: Request, pending: list[int], slots: list[int]) -> ScheduledChunk:
        return ScheduledChunk(request, pending, request.num_cached_tokens, slots)
