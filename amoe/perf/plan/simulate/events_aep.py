"""AEP event by event (amoe.perf.plan.simulate.events' docstring, "AEP"): each attention rank's and expert GPU's
queues under the C++ scheduler the runtime runs, every message on both ends' links, each token's k parts."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from amoe.config import SchedulerSection
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import LinkProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.plan.bound_pools import pool_link
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.events import Steps, router_of
from amoe.perf.plan.simulate.result import Simulated


class AepEvents:
    def __init__(
        self, model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
        sched: SchedulerSection, seed: int, steps: Steps, stagger_ranks: bool = False, rank_barrier: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.dep, self.host, self.ctx = model, dep, host, int(round(ctx))
        self.steps = steps
        self.ga, self.ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
        self.router = router_of(model, routing, seed)
        self.blocks, self.k = model.num_blocks, model.experts_per_token
        self.group_experts = sched.group_experts
        self.placed = placed = dep.experts_on(model.num_expert_ids)
        self.gpu_of = np.empty(model.num_expert_ids, dtype=np.int64)
        self.col_of = np.empty(model.num_expert_ids, dtype=np.int64)
        for g, experts in enumerate(placed):
            for c, e in enumerate(experts):
                self.gpu_of[e], self.col_of[e] = g, c
        A, E = dep.num_attn, dep.num_expert
        per_rank = [concurrency // A + (r < concurrency % A) for r in range(A)]
        self.concurrency = sum(per_rank)
        self.rank_of = np.repeat(np.arange(A), per_rank)  # token id -> its attention rank
        self.position = np.zeros(self.concurrency, dtype=np.int64)
        self.pending = np.zeros(self.concurrency, dtype=np.int64)  # expert parts of a token still out
        cols = self._attention_schedulers(sched, per_rank)
        self._expert_schedulers(sched, max(cols), rank_barrier)
        # Queues hold arrays of token ids (attention) or of (token, expert) parts (experts), oldest first.
        self.attn_q = [
            [[deque() for _ in range(max(1, cols[r]))] for _ in range(self.blocks + 1)] for r in range(A)
        ]
        self.exp_q = [
            [[deque() for _ in range(len(p) * self.groups)] for _ in range(self.blocks)] for p in placed
        ]
        self.busy = {("a", r): False for r in range(A)} | {("e", g): False for g in range(E)}
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.link = pool_link(self.ga, dep)
        self.link_e = pool_link(self.ge, dep)
        self.row_bytes = model.hidden_size * model.bytes_per_activation
        # When each GPU's link in is next free: it takes one message at a time (the incast).
        self.in_free_a, self.in_free_e = np.zeros(A), np.zeros(E)
        self._start_requests(seed, per_rank, stagger_ranks)
        self.stats = {"attn_rows": 0, "attn_steps": 0, "exp_rows": 0, "exp_steps": 0,
                      "attn_busy": 0.0, "exp_busy": 0.0}  # fmt: skip
        self.window = (0.0, 0.0)

    def _attention_schedulers(self, sched: SchedulerSection, per_rank: list[int]) -> list[int]:
        """Each attention rank's scheduler, and its columns: under waves (docs/scheduler.md "Wave size") rank r
        keeps W = ceil(its requests / attention cap) waves, one column each; a request's wave is its rank's state
        (`wave`), joined densely as the runtime admits them."""
        from amoe import core

        dep = self.dep
        waves = sched.policy == "waves"
        cols = [-(-n // dep.attn_cap) if waves else 1 for n in per_rank]
        self.attn_sched = [
            core.Scheduler(self.blocks + 1, max(1, cols[r]), sched.policy, sched.lookahead, sched.decay)
            for r in range(dep.num_attn)
        ]
        self.wave = np.zeros(self.concurrency, dtype=np.int64)  # token id -> its column on its rank's grid
        if waves:
            for r in range(dep.num_attn):
                self.attn_sched[r].wave_cols = True
                for t in np.flatnonzero(self.rank_of == r):
                    self.wave[t] = self.attn_sched[r].admit(dep.attn_cap)
        return cols

    def _expert_schedulers(self, sched: SchedulerSection, W: int, rank_barrier: bool) -> None:
        """Each expert GPU's scheduler. With group cells: its columns are (wave group, hosted expert), as the
        engine's are, when the expert side gathers by wave group; one group otherwise."""
        from amoe import core

        waves = sched.policy == "waves"
        self.wave_group = sched.wave_group if waves and rank_barrier else 0
        self.groups = -(-W // self.wave_group) if self.wave_group else 1
        self.exp_sched = [
            core.Scheduler(
                self.blocks, max(1, len(p)) * self.groups, sched.policy, sched.lookahead, sched.decay
            )
            for p in self.placed
        ]
        # waves, the straggler wait: an expert GPU's block waits for the ranks on their way to it, as the
        # engine's does; the meeting block: block 0 for waves up to ceil(blocks / W) back. Group cells: per
        # (rank, wave), a (block, group) cell for its group's waves, block 0 for them wherever they are.
        if waves and rank_barrier:
            for es, p in zip(self.exp_sched, self.placed):
                es.set_rank_barrier(self.dep.num_attn, core.MAX_WAVE_HOLD_S, -(-self.blocks // W))
                if self.wave_group:
                    es.set_wave_groups(W, self.wave_group, len(p))

    def _start_requests(self, seed: int, per_rank: list[int], stagger_ranks: bool) -> None:
        """Each request starts at a random layer of its iteration (block 0..B-1 or the head), as in a deployment
        whose requests arrived at different times. All at block 0 would move in waves that small batches never
        break up, and the planner's short window would count a wave's crest: 17 % over the runtime's measured
        throughput at 32 requests per block (experiments/2026-11-25-plan-check-depth).

        stagger_ranks: the runtime's ranks fill their waves from arrivals at their own times, so their waves are
        out of phase; here rank r starts at a time drawn uniformly over one of its attention-bound iterations
        (every block and the head, once per wave), independently of the other ranks."""
        dep, A = self.dep, self.dep.num_attn
        layer = np.random.default_rng(seed).integers(0, self.blocks + 1, self.concurrency)
        start = np.zeros(A)
        if stagger_ranks:
            u = np.random.default_rng([seed, 1]).random(A)
            for r in range(A):
                rows = max(1, min(dep.attn_cap, per_rank[r]))
                step = cm.decode_attention_time(self.model, self.ga, rows, self.ctx, self.host)
                start[r] = u[r] * (self.blocks + 1) * -(-per_rank[r] // rows) * step
        for r in range(A):
            mine = np.flatnonzero(self.rank_of == r)
            for first in range(self.blocks + 1):
                if start[r] > 0:
                    self._at(start[r], self._enqueue_attn, r, first, mine[layer[mine] == first])
                else:
                    self._enqueue_attn(r, first, mine[layer[mine] == first])

    # ---- queues

    def _enqueue_attn(self, r: int, layer: int, tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        waves = self.wave[tokens]
        for col in np.unique(waves):
            mine = tokens[waves == col]
            self.attn_q[r][layer][col].append(mine)
            self.attn_sched[r].add(layer, int(col), len(mine))
        self._wake(("a", r))

    def _enqueue_exp(self, g: int, block: int, cols: list, rank: int) -> None:
        """One message: an attention step's rows for expert GPU g, a (column, parts) per hosted expert routed; the
        step's one wave (waves) names their group's columns (group cells)."""
        wave = int(self.wave[cols[0][1][0]])
        shift = wave // self.wave_group * len(self.placed[g]) if self.wave_group else 0
        for col, parts in cols:
            self.exp_q[g][block][shift + col].append(parts)
            self.exp_sched[g].add(block, shift + col, len(parts))
        if self.exp_sched[g].barrier_ranks:
            self.exp_sched[g].arrived(block, rank, self.now, wave)
        self._wake(("e", g))

    @staticmethod
    def _take(q: deque, n: int) -> np.ndarray:
        out, left = [], n
        while left and q:
            head = q[0]
            if len(head) <= left:
                out.append(q.popleft())
                left -= len(head)
            else:
                out.append(head[:left])
                q[0] = head[left:]
                left = 0
        return np.concatenate(out)

    # ---- events

    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def _wake(self, dev: tuple[str, int]) -> None:
        if not self.busy[dev]:
            self.busy[dev] = True
            self._at(self.now, self._start, dev)

    def _start(self, dev: tuple[str, int]) -> None:
        kind, i = dev
        sched = self.attn_sched[i] if kind == "a" else self.exp_sched[i]
        picked = sched.pick(now=self.now)
        if picked is None:
            self.busy[dev] = False
            # An expert GPU holding for ranks on their way (the straggler wait) runs again when the first wait
            # ends, if nothing arrives before.
            if kind == "e" and sched.holding and self.now < sched.release_at < float("inf"):
                self._at(sched.release_at, self._wake, dev)
            return
        block, col = picked
        if kind == "a":
            rows = self._take(self.attn_q[i][block][col], min(self.dep.attn_cap, sched.depth(block, col)))
            sched.add(block, col, -len(rows))
            n = len(rows)
            if block == self.blocks:
                t = cm.head_time(self.model, self.ga, n, n, self.host)
            else:
                t = cm.decode_attention_time(self.model, self.ga, n, self.ctx, self.host)
            t = self.steps.time(i, t)
            self._count("attn", n, t)
            self._at(self.now + t, self._attn_done, i, block, rows)
        else:
            # Grouped (the runtime's default): every hosted expert's queue of the block in one step, as the
            # engine drains it (cpp/queues.cpp LayerQueues::drain); else the picked queue alone.
            per = len(self.placed[i])
            first = col // per * per  # the picked column's wave group (group cells; group 0 without groups)
            cols = range(first, first + per) if self.group_experts else (col,)
            taken = []
            for c in cols:
                if n := min(self.dep.expert_cap, sched.depth(block, c)):
                    taken.append((c, self._take(self.exp_q[i][block][c], n)))
                    sched.add(block, c, -n)
            experts = [self.placed[i][c % per] for c, _ in taken]
            t = cm.grouped_expert_time(self.model, self.ge, [len(p) for _, p in taken], self.host, experts)
            t = self.steps.time(self.dep.num_attn + i, t)
            parts = np.concatenate([p for _, p in taken])
            # the ranks (waves) served here are on their way to the next block (straggler wait, group cells)
            if sched.barrier_ranks:
                if self.wave_group:
                    for r, w in set(zip(self.rank_of[parts].tolist(), self.wave[parts].tolist())):
                        sched.served(block, r, self.now, w)
                else:
                    for r in np.unique(self.rank_of[parts]):
                        sched.served(block, int(r), self.now)
            self._count("exp", len(parts), t)
            self._at(self.now + t, self._exp_done, i, block, parts)

    def _count(self, side: str, rows: int, t: float) -> None:
        lo, hi = self.window
        if lo <= self.now < hi:
            self.stats[f"{side}_rows"] += rows
            self.stats[f"{side}_steps"] += 1
            self.stats[f"{side}_busy"] += min(t, hi - self.now)

    def _move(self, rows: int) -> float:
        return self.link.latency + rows * self.row_bytes / self.link.usable_bandwidth

    def _arrival(self, free: np.ndarray, dev: int, rows: int, link: LinkProfile) -> float:
        """When a message of `rows` rows sent now is in GPU `dev`: its time on the sender's link, as each message
        was priced alone, unless the receiver's link (`free`: when each is next idle) is still taking earlier
        messages, one at a time. Many attention GPUs sending to one expert GPU queue there (the incast)."""
        free[dev] = max(self.now, free[dev]) + rows * self.row_bytes / link.usable_bandwidth
        return max(self.now + self._move(rows), free[dev] + link.latency)

    def _attn_done(self, r: int, block: int, tokens: np.ndarray) -> None:
        self._at(self.now, self._start, ("a", r))
        if block == self.blocks:  # the head: the request's next token starts
            self.position[tokens] += 1
            self._enqueue_attn(r, 0, tokens)
            return
        ids, _ = self.router.route(
            block, len(tokens), request_ids=tokens, positions=self.position[tokens], now_s=self.now
        )
        self.pending[tokens] = self.k
        # The parts out that return to block + 1, as the engine counts its expected expert outputs (waves holds a
        # wave while any are out; a step's tokens are of one wave).
        self.attn_sched[r].add_pending(block + 1, len(tokens) * self.k, int(self.wave[tokens[0]]))
        flat = ids.reshape(-1)
        owner = np.repeat(tokens, self.k)
        # One message per expert GPU, as the engine's send_grouped sends one per destination runtime: its
        # rows arrive together (a message per hosted expert ended the straggler wait at its first and split
        # the wave over two steps).
        gpu, col = self.gpu_of[flat], self.col_of[flat]
        for g in np.unique(gpu):
            mask = gpu == g
            cols = [(int(c), owner[mask & (col == c)]) for c in np.unique(col[mask])]
            t = self._arrival(self.in_free_e, int(g), int(mask.sum()), self.link_e)
            self._at(t, self._enqueue_exp, int(g), block, cols, r)

    def _exp_done(self, g: int, block: int, parts: np.ndarray) -> None:
        self._at(self.now, self._start, ("e", g))
        for r in np.unique(self.rank_of[parts]):
            back = parts[self.rank_of[parts] == r]
            self._at(
                self._arrival(self.in_free_a, int(r), len(back), self.link),
                self._returned,
                int(r),
                block,
                back,
            )

    def _returned(self, r: int, block: int, parts: np.ndarray) -> None:
        cols, counts = np.unique(self.wave[parts], return_counts=True)
        for col, n in zip(cols, counts):
            self.attn_sched[r].add_pending(block + 1, -int(n), int(col))
        np.subtract.at(self.pending, parts, 1)
        done = np.unique(parts[self.pending[parts] == 0])
        self._enqueue_attn(r, block + 1, done)

    def run(self, warmup_s: float, duration_s: float) -> Simulated:
        self.window = (warmup_s, warmup_s + duration_s)
        end = warmup_s + duration_s
        while self.events and self.events[0][0] < end:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        s, A, E = self.stats, self.dep.num_attn, self.dep.num_expert
        # Progress, not whole tokens: every token takes blocks + 1 attention-rank steps, and counting those rows
        # does not quantise the estimate to whole inter-token latencies the way counting the head's tokens does.
        tps = s["attn_rows"] / (self.blocks + 1) / duration_s
        return Simulated(
            tokens_per_s=tps, itl_s=self.concurrency / tps if tps else float("inf"), concurrency=self.concurrency,
            attention_rows_per_step=s["attn_rows"] / max(1, s["attn_steps"]),
            expert_rows_per_step=s["exp_rows"] / max(1, s["exp_steps"]),
            attention_busy=s["attn_busy"] / (A * duration_s), expert_busy=s["exp_busy"] / (E * duration_s),
        )  # fmt: skip
