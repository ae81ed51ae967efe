"""ClusterBackend: the coordinator's API over runtime processes (one per attention DP rank and per expert rank).

The coordinator never reads model code: what it needs of the model (max model length, vocabulary, KV blocks per
rank) arrives in each runtime's Hello.

A request bound to DP rank r is sent to attention runtime r as AddRequest; its tokens come back as TokenOut after
each head step and are fed to the request's stream. Everything runs on the API's event loop (the cluster manager's
socket is a zmq.asyncio one), so no locks here.

KV accounting: an attention runtime frees an aborted request's blocks only when its token next reaches the head
(its rows in flight would otherwise write into freed slots). Until the runtime confirms, the blocks are held back
from the total reported to the load balancer, so admission never over-commits a rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import EngineDeadError, RequestError, RequestFailed
from amoe.request_rules import SeedSource
from coordinator.backend import Backend, RankKV, TokenDelta
from coordinator.cluster import ClusterManager

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    rank: int
    num_kv_blocks: int  # what the load balancer reserved for it
    queue: asyncio.Queue


class ClusterBackend(Backend):
    """Attention DP ranks 0..A-1 are attention runtimes 0..A-1; experts live on runtimes A..A+M-1 (aep,
    pingpong) or beside attention on every runtime (ep)."""

    def __init__(self, config: AmoeConfig, model_dir: str | Path, *, control_bind: str = "ipc") -> None:
        self.config = config
        self.cluster = ClusterManager(
            config, model_dir, self._on_tokens, self._on_death, control_bind=control_bind
        )
        self._status = "created"
        self._streams: dict[int, _Stream] = {}  # request id → stream of a running request
        # request id → (rank, blocks, deadline): blocks held back until the rank frees them, or the deadline passes
        self._aborting: dict[int, tuple[int, int, float]] = {}
        # Unseeded sampled requests get seeds drawn like LocalEngine's, so the same arrivals give the same tokens.
        self._seeds = SeedSource(0)

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def max_model_len(self) -> int:
        """Tokens a request may reach on every attention rank (as the runtimes reported it)."""
        return min(r.max_model_len for r in self.cluster.attn_runtimes)

    @property
    def control_dropped(self) -> int:
        """Control-plane messages dropped so far (for /metrics)."""
        return self.cluster.num_dropped

    @property
    def vocab_size(self) -> int:
        return self.cluster.attn_runtimes[0].vocab_size

    async def start(self) -> None:
        self._status = "starting"
        try:
            await self.cluster.start()
        except BaseException:
            self._status = "dead"
            raise
        self._status = "ok" if self.cluster.failure is None else "dead"

    async def shutdown(self) -> None:
        if self._status == "ok":
            self._status = "stopping"
        for stream in self._streams.values():
            stream.queue.put_nowait(TokenDelta(finish_reason="abort"))
        self._streams.clear()
        await self.cluster.shutdown()
        if self._status != "dead":
            self._status = "stopped"

    # ---- requests

    async def generate(
        self, request_id: int, prompt_token_ids: list[int], sampling_params: Any, rank: int = 0
    ) -> AsyncIterator[TokenDelta]:
        self._check_alive()
        num_ranks = len(self.cluster.attn_runtimes)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"no attention rank {rank}; there are {num_ranks}")
        if request_id in self._streams or request_id in self._aborting:
            raise RequestError(f"request id {request_id} is already in use")
        blocks = -(-(len(prompt_token_ids) + sampling_params.max_tokens) // self.block_size)
        params = wire.to_wire_sampling(sampling_params, self._seeds.resolve(sampling_params))
        message = wire.AddRequest(request_id, list(prompt_token_ids), params)
        stream = _Stream(rank, blocks, asyncio.Queue())
        self._streams[request_id] = stream
        try:
            self.cluster.send(self.cluster.attn_runtimes[rank].id, message)
        except BaseException:  # nothing was sent: nothing to abort, and no stream entry may be left behind
            del self._streams[request_id]
            raise
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.is_finished
                yield item
        finally:
            if not finished:  # the consumer left early (client gone, stop string): free the KV now
                self.abort(request_id)

    def abort(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._abort_at_rank(request_id, stream)
        stream.queue.put_nowait(TokenDelta(finish_reason="abort"))

    def _abort_at_rank(self, request_id: int, stream: _Stream) -> None:
        """Abort at the request's attention rank and hold its blocks back until the rank confirms. The rank frees
        an unconfirmable abort's KV after server.abort_timeout_s (and confirms); the hold outlives that by as
        much again, in case the rank itself is gone."""
        deadline = time.monotonic() + 2 * self.config.server.abort_timeout_s
        self._aborting[request_id] = (stream.rank, stream.num_kv_blocks, deadline)
        self.cluster.send(self._runtime_of(stream), wire.Abort(request_id))

    def _on_tokens(self, msg: wire.TokenOut) -> None:
        for request_id, tokens, reason in zip(msg.request_ids, msg.token_ids, msg.finish_reasons):
            stream = self._streams.get(request_id)
            rank = stream.rank if stream is not None else self._aborting.get(request_id, (None,))[0]
            if rank is None:
                continue  # finished or aborted and confirmed: a late report changes nothing
            from_rank = msg.runtime == self.cluster.attn_runtimes[rank].id
            if not from_rank and reason != "error":  # only a request's own rank samples and ends it
                self.cluster.drop(
                    f"runtime {msg.runtime} reported tokens of request {request_id} of rank {rank}"
                )
                continue
            if reason is not None and from_rank:
                self._aborting.pop(request_id, None)  # its own attention rank ended it: the KV is free there
            if stream is None:
                continue  # aborted meanwhile
            if reason is not None:
                del self._streams[request_id]
            if reason == "rejected":  # the runtime found the request itself invalid
                stream.queue.put_nowait(RequestError(msg.error or "the runtime rejected the request"))
            elif reason == "error":  # a runtime failed while serving it: it fails alone
                if not from_rank:  # an expert runtime: its rank still holds it
                    self._abort_at_rank(request_id, stream)
                stream.queue.put_nowait(
                    RequestFailed(msg.error or "a runtime failed while serving the request")
                )
            else:
                stream.queue.put_nowait(TokenDelta(list(tokens), reason))

    def _runtime_of(self, stream: _Stream) -> int:
        return self.cluster.attn_runtimes[stream.rank].id

    def _on_death(self, reason: str) -> None:
        self._status = "dead"
        error = EngineDeadError(f"the cluster lost a runtime: {reason}")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()

    def _check_alive(self) -> None:
        if self._status == "dead":
            raise EngineDeadError(f"the cluster lost a runtime: {self.cluster.failure}")
        if self._status != "ok":
            raise EngineDeadError(f"the cluster is not serving (status: {self._status})")

    # ---- reports

    def kv_usage(self) -> list[RankKV]:
        self._expire_aborts()
        ranks = self.cluster.attn_runtimes
        held = [0] * len(ranks)
        for rank, blocks, _ in self._aborting.values():
            held[rank] += blocks
        return [
            RankKV(free_blocks=r.kv_free, total_blocks=r.num_kv_blocks - held[i]) for i, r in enumerate(ranks)
        ]

    def _expire_aborts(self) -> None:
        """An abort no runtime confirmed within server.abort_timeout_s stops holding its blocks back: the runtime
        frees an unconfirmed abort's KV after the same time (amoe/runtime/requests.py), and nothing waits forever."""
        now = time.monotonic()
        for request_id in [r for r, (_, _, deadline) in self._aborting.items() if now > deadline]:
            logger.warning("request %d: its abort was never confirmed; releasing its KV blocks", request_id)
            del self._aborting[request_id]

    def health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": self._status, "mode": self.config.parallel.mode}
        ex = self.config.executor
        if ex.kind == "emulated":  # so a benchmark can turn wall time into emulated time (÷ time_scale)
            report["executor"] = {
                "kind": ex.kind,
                "gpu": ex.gpu,
                "profile": ex.profile,
                "time_scale": ex.time_scale,
                "gpus_per_node": ex.gpus_per_node,
            }
        if self.cluster.failure is not None:
            report["error"] = self.cluster.failure
        report["runtimes"] = [r.describe() for r in self.cluster.runtimes]
        report["kv"] = [
            {"rank": rank, "free_blocks": r.kv_free, "total_blocks": r.num_kv_blocks}
            for rank, r in enumerate(self.cluster.attn_runtimes)
        ]
        return report

    def runtime_stats(self) -> list[dict]:
        """The latest report of each live runtime (docs/CONTRACTS.md "Runtime stats"), by runtime id."""
        # A dead runtime's last report would keep exporting it as up with frozen queues; leave it out.
        return [r.stats for r in self.cluster.runtimes if r.stats is not None and r.proc.poll() is None]
