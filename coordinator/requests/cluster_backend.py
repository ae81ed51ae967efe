"""ClusterBackend: the coordinator's API over runtime processes (one per attention DP rank and per expert rank).

The coordinator never reads model code: what it needs of the model (max model length, vocabulary, KV blocks per
rank) arrives in each runtime's Hello.

A request bound to DP rank r is sent to attention runtime r as AddRequest; its tokens come back as TokenOut after
each head step and are fed to the request's stream. Everything runs on the API's event loop (the cluster manager's
socket is a zmq.asyncio one), so no locks here.

KV accounting: an attention runtime frees an aborted request's blocks only when its token next reaches the head
(its rows in flight would otherwise write into freed slots). Until the runtime confirms, the blocks are held back
from the total reported to the load balancer, so admission never over-commits a rank.

Self-healing: the backend keeps each running request's prompt, sampling parameters and tokens so far. When its
attention runtime is lost, the request waits ("moving") and, once the replacement serves, is admitted there again
with prompt + tokens so far (recomputed, as vLLM's preemption does): its stream pauses instead of failing, and
greedy output is the same. If the replacement is not serving within server.failover_after_s, the request is admitted
that way on the serving rank with the most free KV instead (the load balancer moves its reservation), if one has
room; new requests avoid a rank being replaced while another can take them. A lost expert runtime needs nothing here: the attention runtimes ask its replacement
again for what it never answered. `/health` says "degraded" (HTTP 200, with the reason) while a runtime is being
replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import ConfigError, EngineDeadError, RequestError, RequestFailed
from amoe.expert_map import ExpertMap
from amoe.request_rules import SeedSource, sequence_seed
from amoe.sampling_params import SamplingParams
from coordinator.cluster.manager import ClusterManager
from coordinator.cluster.runtimes import RuntimeProc
from coordinator.requests.backend import Backend, RankKV, TokenDelta

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    rank: int
    num_kv_blocks: int  # what the load balancer reserved for it
    queue: asyncio.Queue
    prompt: list[int] = field(default_factory=list)
    params: wire.WireSampling | None = None  # as first sent: its seed is the one the request samples with
    moving: bool = False  # its attention runtime is being replaced: it is admitted there again once it serves
    # Its sequences' wire ids (n > 1: the request's own first; empty: one sequence, the request's id).
    seq_ids: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=lambda: [[]])  # tokens so far, per sequence
    running: set[int] = field(default_factory=lambda: {0})  # indices of the sequences not finished

    def seq_id(self, request_id: int, index: int) -> int:
        return self.seq_ids[index] if self.seq_ids else request_id

    @property
    def generated(self) -> list[int]:
        """A single-sequence request's tokens so far."""
        return self.outputs[0]


class ClusterBackend(Backend):
    """Attention DP ranks 0..A-1 are attention runtimes 0..A-1; experts live on runtimes A..A+M-1 (aep,
    pingpong) or beside attention on every runtime (ep)."""

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str | Path,
        *,
        control_bind: str = "ipc",
        on_dead: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock  # when unconfirmed aborts stop holding their blocks back
        self.cluster = ClusterManager(config, model_dir, self, control_bind=control_bind)
        self._on_dead = on_dead  # told when the cluster cannot recover (`amoe serve` then drains and exits)
        self.readmitted = 0  # requests admitted again after their attention runtime was lost
        self.moved = 0  # of those, admitted on another rank (server.failover_after_s)
        self._status = "created"
        self._streams: dict[int, _Stream] = {}  # request id → stream of a running request
        # request id → (rank, blocks, deadline): blocks held back until the rank frees them, or the deadline passes
        self._aborting: dict[int, tuple[int, int, float]] = {}
        # Unseeded sampled requests get seeds drawn like LocalEngine's, so the same arrivals give the same tokens.
        self._seeds = SeedSource(config.server.seed)
        # n > 1: wire ids of a request's other sequences, far above the API's request ids (counted from 1), and
        # which request and index each one is.
        self._extra_ids = itertools.count(2**62)
        self._sequence_of: dict[int, tuple[int, int]] = {}

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def max_model_len(self) -> int:
        """Tokens a request may reach on every attention rank (as the runtimes reported it)."""
        return min(r.max_model_len for r in self.cluster.attn_runtimes)

    @property
    def recoveries(self) -> list[float]:
        """Seconds from each runtime loss to its replacement serving (for /metrics)."""
        return self.cluster.recoveries

    @property
    def rejected_handshakes(self) -> int:
        """Connections to the CURVE control endpoint refused (multi-node; for /metrics)."""
        return self.cluster.rejected_handshakes

    @property
    def control_dropped(self) -> int:
        """Control-plane messages dropped so far (for /metrics)."""
        return self.cluster.num_dropped

    @property
    def control_send_failures(self) -> int:
        """Control-plane messages ZeroMQ could not take at once, each retried in order (for /metrics)."""
        return self.cluster.send_failures

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
        self, request_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams, rank: int = 0
    ) -> AsyncIterator[TokenDelta]:
        self._check_alive()
        num_ranks = len(self.cluster.attn_runtimes)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"no attention rank {rank}; there are {num_ranks}")
        if request_id in self._streams or request_id in self._aborting:
            raise RequestError(f"request id {request_id} is already in use")
        num_seqs = sampling_params.num_sequences
        blocks = num_seqs * -(-(len(prompt_token_ids) + sampling_params.max_tokens) // self.block_size)
        params = wire.to_wire_sampling(sampling_params, self._seeds.resolve(sampling_params))
        seq_ids = [request_id] + [next(self._extra_ids) for _ in range(num_seqs - 1)]
        stream = _Stream(
            rank, blocks, asyncio.Queue(), list(prompt_token_ids), params, seq_ids=seq_ids,
            outputs=[[] for _ in seq_ids], running=set(range(num_seqs)),
        )  # fmt: skip
        message = wire.AddRequest(
            request_id, stream.prompt, params, seq_ids=seq_ids[1:]
        )  # encodable, or raises
        wire.encode(message)
        self._streams[request_id] = stream
        for index, seq_id in enumerate(seq_ids):
            self._sequence_of[seq_id] = (request_id, index)
        if self.cluster.attn_runtimes[rank].lost is None:
            self.cluster.send(self.cluster.attn_runtimes[rank].id, message)
        else:  # its rank is being replaced: it starts there once the replacement serves
            stream.moving = True
        unread = set(range(num_seqs))  # sequences whose end this stream has not handed on yet
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.is_finished:
                    unread.discard(item.index)
                finished = not unread
                yield item
        finally:
            if not finished:  # the consumer left early (client gone, stop string): free the KV now
                self.abort(request_id)
            for seq_id in seq_ids:
                self._sequence_of.pop(seq_id, None)

    def abort(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        ended = sorted(stream.running)
        stream.running.clear()
        if not stream.moving:  # a moving request holds nothing anywhere
            self._abort_at_rank(request_id, stream, ended)
        for index in ended:
            stream.queue.put_nowait(TokenDelta(finish_reason="abort", index=index))

    def abort_sequence(self, request_id: int, index: int) -> None:
        stream = self._streams.get(request_id)
        if stream is None or index not in stream.running:
            return
        if len(stream.running) == 1:
            self.abort(request_id)
            return
        stream.running.discard(index)
        if not stream.moving:
            self._abort_at_rank(request_id, stream, [index])
        stream.queue.put_nowait(TokenDelta(finish_reason="abort", index=index))

    def _abort_at_rank(self, request_id: int, stream: _Stream, indices: list[int]) -> None:
        """Abort sequences at the request's attention rank and hold their blocks back until the rank confirms.
        The rank frees an unconfirmable abort's KV after server.abort_timeout_s (and confirms); the hold outlives
        that by as much again, in case the rank itself is gone."""
        deadline = self._clock() + 2 * self.config.server.abort_timeout_s
        per_seq = -(-stream.num_kv_blocks // len(stream.outputs))
        for index in indices:
            seq_id = stream.seq_id(request_id, index)
            self._aborting[seq_id] = (stream.rank, per_seq, deadline)
            self.cluster.send(self._runtime_of(stream), wire.Abort(seq_id))

    # ---- what the cluster tells us (ClusterEvents)

    def on_tokens(self, msg: wire.TokenOut) -> None:
        none = [None] * len(msg.request_ids)
        columns = (msg.logprobs or none, msg.prompt_logprobs or none)
        for seq_id, tokens, reason, logprobs, prompt in zip(
            msg.request_ids, msg.token_ids, msg.finish_reasons, *columns
        ):
            request_id, index = self._sequence_of.get(seq_id, (seq_id, 0))
            stream = self._streams.get(request_id)
            rank = stream.rank if stream is not None else self._aborting.get(seq_id, (None,))[0]
            if rank is None:
                continue  # finished or aborted and confirmed: a late report changes nothing
            from_rank = msg.runtime == self.cluster.attn_runtimes[rank].id
            if not from_rank and reason != "error":  # only a request's own rank samples and ends it
                self.cluster.drop(
                    f"runtime {msg.runtime} reported tokens of request {request_id} of rank {rank}"
                )
                continue
            if reason is not None and from_rank:
                self._aborting.pop(seq_id, None)  # its own attention rank ended it: the KV is free there
            if stream is None or stream.moving or index not in stream.running:
                continue  # aborted meanwhile, or a lost runtime's last words (its request starts over elsewhere)
            stream.outputs[index] += tokens
            if reason in ("rejected", "error"):  # the whole request fails
                del self._streams[request_id]
                if reason == "error" and not from_rank:  # an expert runtime: its rank still holds it
                    self._abort_at_rank(request_id, stream, sorted(stream.running))
                elif len(stream.running) > 1:  # its other sequences end at the rank too
                    self._abort_at_rank(request_id, stream, sorted(stream.running - {index}))
                stream.running.clear()
                stream.queue.put_nowait(
                    RequestError(msg.error or "the runtime rejected the request")
                    if reason == "rejected"  # the runtime found the request itself invalid
                    else RequestFailed(msg.error or "a runtime failed while serving the request")
                )
                continue
            if reason is not None:
                stream.running.discard(index)
                if not stream.running:
                    del self._streams[request_id]
            delta = TokenDelta(list(tokens), reason, index, logprobs=logprobs, prompt_logprobs=prompt)
            stream.queue.put_nowait(delta)

    def _runtime_of(self, stream: _Stream) -> int:
        return self.cluster.attn_runtimes[stream.rank].id

    def on_lost(self, runtime: RuntimeProc, reason: str) -> None:
        """A runtime is being replaced. An attention runtime's requests wait to move; its KV is gone."""
        if runtime.role != "attention":
            return
        rank = self.cluster.attn_runtimes.index(runtime)
        for stream in self._streams.values():
            if stream.rank == rank:
                stream.moving = True
        for request_id in [r for r, (held_rank, _, _) in self._aborting.items() if held_rank == rank]:
            del self._aborting[request_id]
        self._fail_over_later(runtime)

    def _fail_over_later(self, runtime: RuntimeProc) -> None:
        """In server.failover_after_s, move whatever still waits for this lost rank elsewhere."""
        asyncio.get_running_loop().call_later(
            self.config.server.failover_after_s, self._fail_over, runtime, runtime.lost_at
        )

    def _fail_over(self, runtime: RuntimeProc, lost_at: float) -> None:
        """The lost rank's replacement is not serving yet: its waiting requests are admitted again on the serving
        rank with the most room (prompt + tokens so far, as on the replacement). Those that fit nowhere keep
        waiting, and are tried again after as long."""
        if runtime.lost is None or runtime.lost_at != lost_at or self._status != "ok" or self.rebind is None:
            return  # back already (or lost again since, with its own timer), or nothing can move
        rank = self.cluster.attn_runtimes.index(runtime)
        waiting = [(r, s) for r, s in self._streams.items() if s.rank == rank and s.moving]
        for request_id, stream in waiting:
            target = self.rebind(request_id, rank)
            if target is None:
                continue
            stream.rank, stream.moving = target, False
            self.readmitted += 1
            self.moved += 1
            self._send_readmission(request_id, stream)
        moved = sum(1 for _, s in waiting if not s.moving)
        if waiting:
            logger.warning("%s is not serving after %g s: %d of its %d requests moved to other ranks",
                           runtime.name, self.config.server.failover_after_s, moved, len(waiting))  # fmt: skip
        if moved < len(waiting):
            self._fail_over_later(runtime)

    def on_rejoined(self, runtime: RuntimeProc) -> None:
        """Its replacement serves: the requests that waited start there again from their tokens so far."""
        if runtime.role != "attention":
            return
        rank = self.cluster.attn_runtimes.index(runtime)
        for request_id, stream in self._streams.items():
            if stream.rank == rank and stream.moving:
                stream.moving = False
                self.readmitted += 1
                self._send_readmission(request_id, stream)

    def _send_readmission(self, request_id: int, stream: _Stream) -> None:
        """Admit a moved request again on its (new) rank: anew if none of its sequences sampled yet, else each
        running sequence on its own, from its tokens so far (see _readmission)."""
        runtime = self._runtime_of(stream)
        if not any(stream.outputs):
            self.cluster.send(
                runtime, wire.AddRequest(request_id, stream.prompt, stream.params, seq_ids=stream.seq_ids[1:])
            )
            return
        for index in sorted(stream.running):
            self.cluster.send(runtime, self._readmission(request_id, stream, index))

    def _readmission(self, request_id: int, stream: _Stream, index: int) -> wire.AddRequest:
        """Prompt + a sequence's tokens so far, for what is left of max_tokens; a seeded sampler skips the draws
        taken (with the sequence's own seed, seed + index)."""
        output = stream.outputs[index]
        n, params = len(output), stream.params
        params = msgspec.structs.replace(
            params, max_tokens=params.max_tokens - n, min_tokens=max(0, params.min_tokens - n),
            seed=sequence_seed(params.seed, index),
        )  # fmt: skip
        return wire.AddRequest(
            stream.seq_id(request_id, index), stream.prompt + output, params, num_generated=n
        )

    def on_death(self, reason: str) -> None:
        self._status = "dead"
        error = EngineDeadError(f"the cluster cannot serve: {reason}")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        if self._on_dead is not None:
            self._on_dead(reason)

    def _check_alive(self) -> None:
        if self._status == "dead":
            raise EngineDeadError(f"the cluster cannot serve: {self.cluster.failure}")
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
            RankKV(
                r.kv_free, r.num_kv_blocks - held[i], self.config.cache.max_num_seqs, serving=r.lost is None
            )
            for i, r in enumerate(ranks)
        ]

    def _expire_aborts(self) -> None:
        """An abort no runtime confirmed within server.abort_timeout_s stops holding its blocks back: the runtime
        frees an unconfirmed abort's KV after the same time (amoe/runtime/requests.py), and nothing waits forever."""
        now = self._clock()
        for request_id in [r for r, (_, _, deadline) in self._aborting.items() if now > deadline]:
            logger.warning("request %d: its abort was never confirmed; releasing its KV blocks", request_id)
            del self._aborting[request_id]

    @property
    def status(self) -> str:
        if self._status == "ok" and self.cluster.replacing:
            return "degraded"
        return self._status

    def health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": self.status, "mode": self.config.parallel.mode}
        if self.status == "degraded":
            report["reason"] = "; ".join(f"replacing {r.name}: {r.lost}" for r in self.cluster.replacing)
        ex = self.config.emulation
        if self.config.executor.kind == "emulated":  # so a benchmark can turn wall time into emulated time
            report["executor"] = {
                "kind": "emulated",
                "gpu": ex.gpu,
                "profile": ex.profile,
                "time_scale": ex.time_scale,
                "gpus_per_node": ex.gpus_per_node,
            }
        if self.cluster.failure is not None:
            report["error"] = self.cluster.failure
        report["runtimes"] = self.cluster.describe()
        if self.cluster.scaler is not None:  # elastic runtimes: the shape, joins and drains
            report["scaling"] = self.cluster.scaler.shape()
        report["kv"] = [
            {"rank": rank, "free_blocks": r.kv_free, "total_blocks": r.num_kv_blocks}
            for rank, r in enumerate(self.cluster.attn_runtimes)
        ]
        return report

    def placement(self) -> dict[str, Any] | None:
        rebalancer = self.cluster.placement
        return None if rebalancer is None else rebalancer.report()

    def placement_metrics(self) -> dict[str, Any] | None:
        """What /metrics exports of the live placement (coordinator/metrics.py)."""
        rebalancer = self.cluster.placement
        if rebalancer is None or rebalancer.map is None:
            return None
        return {
            "epoch": rebalancer.epoch,
            "counters": rebalancer.counters,
            "replicas": rebalancer.map.counts(),
            "balancedness": rebalancer.balancedness(),
        }

    async def rebalance(self, replicas: list | None = None, wait: bool = False) -> dict[str, Any]:
        rebalancer = self.cluster.placement
        if rebalancer is None:
            return await super().rebalance(replicas, wait)
        self._check_alive()
        try:  # RebalanceBusy (another under way, a runtime being replaced) goes to the caller as it is
            target = await rebalancer.planned() if replicas is None else ExpertMap.of(replicas)
            epoch = rebalancer.start(target, "admin")
        except ConfigError as exc:  # a map this cluster cannot serve
            raise RequestError(str(exc), "replicas") from None
        outcome = "started" if rebalancer.move is not None and rebalancer.move.epoch == epoch else "unchanged"
        if wait and outcome == "started":
            outcome = await rebalancer.wait(epoch)
        return {"epoch": epoch, "outcome": outcome, **rebalancer.report()}

    def shape(self) -> dict[str, Any] | None:
        scaler = self.cluster.scaler
        return None if scaler is None else scaler.shape()

    async def scale(self, expert_runtimes: Any = None, attention_runtimes: Any = None, remove: list[int] | None = None,
                    wait: bool = False) -> dict[str, Any]:  # fmt: skip
        scaler = self.cluster.scaler
        if scaler is None:
            return await super().scale(expert_runtimes, attention_runtimes, remove, wait)
        self._check_alive()
        task = scaler.start(
            expert_runtimes, attention_runtimes, remove
        )  # ScaleBusy, RequestError: to the caller
        if wait:
            return await asyncio.shield(task)  # a client that goes away does not stop the scale halfway
        return {"outcome": "started", **scaler.shape()}

    def runtime_stats(self) -> list[dict]:
        """The latest report of each live runtime (docs/CONTRACTS.md "Runtime stats"), by runtime id."""
        # A dead runtime's last report would keep exporting it as up with frozen queues; leave it out.
        return [r.stats for r in self.cluster.runtimes if r.stats is not None and r.proc.poll() is None]
