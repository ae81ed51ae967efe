"""AEP at scale with each attention GPU on its own phase (the rule: docs/simulation.md "Simulation at scale",
amoe.perf.plan.simulate.scale's docstring).

Events are committed in conservative time windows, vectorised over GPUs. A GPU's next step can only be changed by
messages still to be decided: an attention GPU's by a reply (no reply still to be decided comes before the earliest
expert step still to be decided ends), an expert GPU's by a dispatch (none comes before the earliest attention step
still to be decided ends). Each round commits, together, every attention GPU whose wave to run cannot change and
every expert GPU whose queue at its next start cannot change; the GPU with the earliest event always can, so the
rounds progress, and each round's numpy work is over arrays of GPUs and waves, not a Python event each. There are
about as many rounds as one expert GPU runs steps (~1 ms each): where steps split that is many more than the one
timeline's events (docs/simulation.md "Simulation at scale").
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from amoe.config import SchedulerSection
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.traces import RequestTrace
from amoe.perf.model.variance import OFF, StepVariance
from amoe.perf.plan.bound_pools import pool_links
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.batch_means import batch_means_halfwidth
from amoe.perf.plan.simulate.rank_steps import head_times, kv_blocks
from amoe.perf.plan.simulate.result import Simulated
from amoe.perf.plan.simulate.trace_loads import TraceLoads

# The most (block, group) cells a block that the simulation at scale runs as `waves`' group cells. Each cell is a
# step of its own at every expert GPU, so a plan of many small cells (no ITL objective: a copy of 64 attention GPUs
# at ~7,700 requests a rank makes 15) advanced 0.2 emulated seconds per CPU second — `amoe plan` on 256 GPUs ran
# past 30 minutes here — where defrag's pick, one step a block, answers in about two (experiments/
# 2026-11-29-plan-256-timing). Every cell of the trace table under 50 and 100 ms made at most 4.
MAX_GROUP_CELLS = 4


class RowCounts(Protocol):
    """What this simulation draws its rows from (scale.Counts)."""

    def draw_many(self, blocks: np.ndarray, tokens: int | np.ndarray, now_s: float) -> np.ndarray: ...


class StepCosts(Protocol):
    """The grouped step costs it prices its expert steps with (counts.GroupedSteps): [expert ids] rows → [expert
    GPUs] seconds, the same over rows already per hosted copy (`over`), and the model, GPU and host they are of."""

    model: ModelProfile
    gpu: GpuProfile
    host: HostOverhead

    def __call__(self, rows: np.ndarray) -> np.ndarray: ...

    def over(self, copy: np.ndarray, inter: np.ndarray) -> np.ndarray: ...


def _fifo(start: np.ndarray, work: np.ndarray, free: np.ndarray) -> np.ndarray:
    """A link per column serving message sets first sent first through: [sets, links] times each set is through.
    `start` [sets, links] (sorted along sets; −inf where a set does not use that link), `work` [sets, links] its
    seconds there, `free` [links] when each link is free now. e_k = max(start_k, e_{k−1}) + work_k, closed form:
    e_k = C_k + max(free, max_{j≤k} (start_j − C_{j−1})), C the running sum of work."""
    c = np.cumsum(work, axis=0)
    lead = np.maximum.accumulate(start - (c - work), axis=0)
    return c + np.maximum(free[None, :], lead)


class AepAtScale:
    """One copy of an AEP deployment in counts, each attention GPU on its own timeline (`run` returns Simulated).

    Rows are kept as [waves, hosted experts, expert GPUs] (each id on one expert GPU: AEP places no copies; GPUs
    hosting fewer experts padded with an id that never gets rows), so per-GPU sums and maxima are reductions over
    the middle axis (contiguous over GPUs: numpy's fast case) and a GPU's queue mask broadcasts over its experts."""

    def __init__(
        self, model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead,
        concurrency: int, seed: int, *, counts: RowCounts, steps: StepCosts, same_phase: bool = False,
        variance: StepVariance = OFF, trace: RequestTrace | None = None, scheduler: SchedulerSection | None = None,
    ) -> None:  # fmt: skip
        # counts (scale.Counts) and steps (scale.GroupedSteps over dep's placement) come from the
        # caller (scale.aep_at_scale), so this module does not import the one that imports it.
        ga = gpu_profile(dep.attn_gpu)
        self.A, self.L = A, L = dep.num_attn, model.num_blocks
        per_rank = max(1, concurrency // A)
        w = max(1, min(dep.attn_cap, per_rank))
        self.W = W = max(1, math.ceil(per_rank / w))
        self.w = w = math.ceil(per_rank / W)  # even waves
        self.cap = dep.expert_cap
        placed = dep.experts_on(model.num_expert_ids)
        self.steps, self.counts = steps, counts
        hosted = self._host_experts(model, placed)
        E, nh = self.E, self.ids.shape[0]
        sched = (
            scheduler or SchedulerSection()
        )  # the plan's policy, else the serving default; K and δ the config's
        self.decay = sched.decay ** np.arange(1, sched.lookahead + 1)
        self.lk = pool_links(model, dep)
        self.copies = w * model.experts_per_token
        self.attn = cm.decode_attention_time(model, ga, w, int(round(ctx)), host)
        self.head = cm.head_time(model, ga, w, host=host)
        self._trace(trace, model, ga, host, seed)
        # The least an expert GPU's step can take (one row of its cheapest hosted expert): how far ahead a reply
        # still to be decided cannot come.
        one = np.zeros(model.num_expert_ids)
        for experts in hosted:
            one[min(experts, key=model.intermediate_of)] = 1.0
        self.step_min = self.steps(one)[self.gpus]
        self._vary(variance, dep.num_expert)
        self._wave_steps(np.arange(A * W))
        # Each wave starts at a block drawn from the seed (as the one timeline's waves were): per attention GPU, or
        # one draw for all of them (same_phase: the old one timeline).
        rng = np.random.default_rng([seed, 36])
        start = np.tile(rng.integers(0, L + 1, W), (A, 1)) if same_phase else rng.integers(0, L + 1, (A, W))
        S = A * W  # slot s = a · W + i: attention GPU a's wave i
        self.layer = start.reshape(S).astype(np.int64)  # its next block (L: its head)
        self.ready = np.zeros(S)  # when it is ready for that block's attention step (inf: out at the experts)
        self.owner = np.repeat(np.arange(A), W)
        self.a_free, self.a_out, self.a_in = np.zeros(A), np.zeros(A), np.zeros(A)
        self.e_free, self.e_in, self.e_out = np.zeros(E), np.zeros(E), np.zeros(E)
        # The block each wave has out at the experts: its rows not yet taken per column, where it is still queued
        # (pend), when its message set is in at each expert GPU, its parts' last step end and last time out of an
        # expert GPU's link.
        self.rows = np.zeros((S, nh, E))
        # [blocks, hosted, expert GPUs] every wave's rows still pending there, by the wave's block
        self.queue = np.zeros((L, nh, E))
        self.bins = None
        self.pend = np.zeros((S, E), dtype=bool)
        self.arr = np.full((S, E), np.inf)
        self.step_end, self.out_end = np.zeros(S), np.zeros(S)
        self._group_cells(sched)

    def _group_cells(self, sched: SchedulerSection) -> None:
        """Under `waves` the expert side runs group cells (docs/scheduler.md "Group cells"): wave i of a rank is in
        group i // M (M: `sched.wave_group`, at least 1), a step takes one (block, group) cell, and a cell waits for
        its group's waves on their way. Per (wave, expert GPU) the notes the runtime keeps per (rank, wave): the
        block it last served the wave at and when (the wave's block before the one it is on its way to), the
        wave's last turn-around; per expert GPU a hold (since when, until when). Other policies, and `waves`
        without groups (wave_group 0: the runtime gathers per rank, a rule this engine does not model), run
        defrag's pick: on Mixtral 4 + 4 H100s at four times the bound's requests it gives the event level's
        figure (642,820 against 642,193 tokens/s), where cells of one wave each fall 7 % short (594,530). So do
        plans whose waves make more than MAX_GROUP_CELLS cells a block: the figure, and the policy the plan is served
        with (Simulated.expert_pick), are then defrag's."""
        from amoe import core

        S, E = self.A * self.W, self.E
        self.wave_group = max(1, sched.wave_group)
        self.num_groups = -(-self.W // self.wave_group)
        self.waves = sched.policy == "waves" and sched.wave_group > 0 and self.num_groups <= MAX_GROUP_CELLS
        self.group = (np.arange(S) % self.W) // self.wave_group
        self.max_hold = core.MAX_WAVE_HOLD_S
        self.served_block = np.full((S, E), -1, dtype=np.int64)
        self.served_at = np.full((S, E), -np.inf)
        self.turn = np.full((S, E), -1.0)
        self.hold_since, self.hold_until = np.full(E, -np.inf), np.full(E, np.inf)

    def _host_experts(self, model: ModelProfile, placed: list[list[int]]) -> list[list[int]]:
        """The expert GPUs that take part (those hosting an expert: more expert GPUs than expert ids leave some
        idle), their hosted experts' ids [nh, E] (num_ids: padding, a column of zeros) and SwiGLU widths (0:
        padding, never busy); the hosted experts of each."""
        self.gpus = np.array([g for g, p in enumerate(placed) if p], dtype=np.int64)
        hosted = [placed[g] for g in self.gpus]
        self.E = len(hosted)
        num_ids, nh = model.num_expert_ids, max(len(p) for p in hosted)
        self.ids = np.array([p + [num_ids] * (nh - len(p)) for p in hosted], dtype=np.int64).T
        self.num_hosted = np.array([len(p) for p in hosted], dtype=float)
        self.inter = np.array(
            [[model.intermediate_of(e) if e < num_ids else 0 for e in row] for row in self.ids], float
        )
        return hosted

    def _trace(
        self, trace: RequestTrace | None, model: ModelProfile, gpu: GpuProfile, host: HostOverhead, seed: int
    ) -> None:
        """Each wave's attention step from its own requests of `trace` (amoe.perf.plan.simulate.trace_loads: wave
        i of attention GPU a holds its slots i · w .. (i + 1) · w), or every wave the mean context's (None)."""
        self.model_gpu_host = (model, gpu, host)
        self.wave_attn = np.full(self.A * self.W, self.attn)
        self.wave_head = np.full(self.A * self.W, self.head)
        self.wave_rows = np.full(self.A * self.W, self.w)
        self.loads, self.attn_floor = None, self.attn
        if trace is not None:
            blocks = kv_blocks(model, gpu, cm.attention_rank_weight_bytes(model))
            self.loads = TraceLoads(trace, self.A, self.W * self.w, seed, blocks)
            # the least a wave's step can take (its rows at one token of context each): the look-ahead's bound
            self.attn_floor = float(cm.attention_load_time(model, gpu, self.w, self.w, self.w, host))

    def _wave_steps(self, slots: np.ndarray) -> None:
        """The attention step, head and rows of waves `slots` from their requests now (with a trace)."""
        if self.loads is None:
            return
        model, gpu, host = self.model_gpu_host
        rows, ctx = (a.reshape(-1)[slots] for a in self.loads.loads(self.W))
        self.wave_rows[slots] = rows.astype(np.int64)
        self.wave_attn[slots] = cm.attention_load_time(model, gpu, rows, ctx, ctx, host)
        self.wave_head[slots] = head_times(model, gpu, rows, host)

    def _decode_waves(self, slots: np.ndarray) -> None:
        """Waves `slots` passed their head: each request of theirs decoded a token (those that end replaced)."""
        if self.loads is None:
            return
        for s in slots.tolist():
            a, i = divmod(s, self.W)
            self.loads.decode(np.array([a]), slice(i * self.w, (i + 1) * self.w))
        self._wave_steps(slots)

    def _vary(self, variance: StepVariance, num_expert: int) -> None:
        """Step-time variance (docs/simulation.md "Step-time variance at scale"): attention GPU a is device a, expert
        GPU g device A + g; each step × the device's speed × a jitter drawn when the step is committed. The
        look-ahead takes the least a step can then be."""
        A = self.A
        self.variance = variance
        self.attn_min = self.attn_floor
        if not variance.is_off:
            self.a_speed = variance.speeds(0, A)
            self.e_speed = np.array([variance.speed(A + int(g)) for g in self.gpus])
            self.jit_rng = variance.jitter_rng(A + num_expert)
            low = 1.0 - variance.jitter
            self.step_min = self.step_min * self.e_speed * low
            self.attn_min = self.attn_floor * float(self.a_speed.min()) * low

    def step_times(self, take: np.ndarray, gpus: np.ndarray | None = None) -> np.ndarray:
        """[G] the grouped step of each of `gpus` (None: all) over its [nh, G] rows: GroupedSteps' formula on the
        hosted experts only (one copy an id), not over the [ids, GPUs] matrix (most of a round's time before)."""
        return self.steps.over(take, self.inter if gpus is None else self.inter[:, gpus])

    def run(
        self, warmup_s: float, duration_s: float, batches: int = 0, rel_halfwidth: float = 0.01,
        min_batches: int = 10,
    ) -> Simulated:  # fmt: skip
        """Simulate `duration_s` emulated seconds after `warmup_s`. With `batches` the window is split into that
        many batches and the run stops at the end of the first batch k ≥ `min_batches` whose k batch throughputs'
        95 % batch-means interval is within ±`rel_halfwidth` of their mean, else at the window's end (the same
        figures as without `batches`): a steady-state simulation's sequential stopping rule (docs/simulation.md
        "A stopping rule"). `self.measured_s` is the window the figures are over."""
        end = warmup_s + duration_s
        self.window = (warmup_s, end)
        self.done_rows, self.attn_busy, self.exp_busy, self.exp_steps, self.exp_rows = 0, 0.0, 0.0, 0, 0.0
        self.batch_s = duration_s / batches if batches else 0.0
        # per batch: attention rows, attention busy, expert busy, expert steps, expert rows (by start time)
        self.bins = np.zeros((5, batches)) if batches else None
        self.measured_s, checked = duration_s, min_batches - 1
        A, W, lat = self.A, self.W, self.lk.latency
        while True:
            ready = self.ready.reshape(A, W)
            first = ready.argmin(1)  # [A] each attention GPU's wave that became ready first
            r = ready[np.arange(A), first]
            begin = np.maximum(self.a_free, r)
            # [E] the first rows still queued at each (a holding GPU: the first in since it held, or its hold's end)
            queued = np.where(self.pend & (self.arr > self.hold_since), self.arr, np.inf).min(0)
            e_start = np.maximum(self.e_free, np.minimum(queued, self.hold_until))
            low = min(begin.min(), e_start.min())  # no step still to be committed starts before this
            if low >= end:
                break
            if batches:
                done = min(batches, int((low - warmup_s) // self.batch_s))  # batches no step can still enter
                if checked < done < batches:
                    checked = done
                    if batch_means_halfwidth(self.bins[0, :done]) <= rel_halfwidth:
                        return self._result_of_batches(done)
            # No reply still to be decided comes before ret_min, no dispatch before arr_min.
            ret_min = (e_start + self.step_min).min() + lat
            arr_min = min(begin.min(), ret_min) + self.attn_min + lat
            go_a = np.flatnonzero((r <= ret_min) & (begin < end))
            go_e = np.flatnonzero(e_start < arr_min)
            if len(go_a):
                self._attend(go_a, first[go_a], begin[go_a])
            if len(go_e):
                self._expert_steps(go_e, e_start[go_e])
        return self._result(duration_s)

    def _batch(self, t: np.ndarray) -> np.ndarray:
        """The batch each of the (counted) times `t` falls in."""
        return np.minimum(((t - self.window[0]) // self.batch_s).astype(np.int64), self.bins.shape[1] - 1)

    def _result_of_batches(self, k: int) -> Simulated:
        """The figures over the first k batches only."""
        rows, attn, exp, steps, exp_rows = self.bins[:, :k].sum(1)
        self.done_rows, self.attn_busy, self.exp_busy = rows, attn, exp
        self.exp_steps, self.exp_rows = int(round(steps)), exp_rows
        self.measured_s = k * self.batch_s
        return self._result(self.measured_s)

    def _attend(self, gpus: np.ndarray, waves: np.ndarray, begin: np.ndarray) -> None:
        """Each of `gpus` runs its wave's step at `begin`: the head (its next token starts), or a block's attention
        step and the dispatch of its rows."""
        slot = gpus * self.W + waves
        lo, hi = self.window
        counted = (begin >= lo) & (begin < hi)
        is_head = self.layer[slot] == self.L
        # each step's factor (the GPU's speed × its jitter), or none without variance
        f = None if self.variance.is_off else self.a_speed[gpus] * self.variance.draw(self.jit_rng, len(gpus))
        if is_head.any():
            self._heads(slot[is_head], gpus[is_head], begin[is_head], counted[is_head], f, is_head)
        att = ~is_head
        if not att.any():
            return
        s, g, b, c = slot[att], gpus[att], begin[att], counted[att]
        held = self.wave_attn[s] if f is None else self.wave_attn[s] * f[att]
        sent = b + held
        self.a_free[g] = sent
        # progress: one wave's block (as the event level counts attention-step rows)
        self.done_rows += int(self.wave_rows[s][c].sum())
        self.attn_busy += float(held[c].sum())
        if self.bins is not None:
            which, nb = self._batch(b[c]), self.bins.shape[1]
            self.bins[0] += np.bincount(which, self.wave_rows[s][c], nb)
            self.bins[1] += np.bincount(which, held[c], nb)
        order = np.argsort(sent, kind="stable")
        self._dispatch(s[order], g[order], sent[order])

    def _heads(
        self, s: np.ndarray, g: np.ndarray, begin: np.ndarray, counted: np.ndarray, f: np.ndarray | None,
        is_head: np.ndarray,
    ) -> None:  # fmt: skip
        """Waves `s` of GPUs `g` run the head at `begin`: their next token starts at block 0 when it is done."""
        held = self.wave_head[s] if f is None else self.wave_head[s] * f[is_head]
        self.a_free[g] = begin + held
        self.attn_busy += float(held[counted].sum())
        self.ready[s], self.layer[s] = self.a_free[g], 0
        if self.bins is not None:
            self.bins[1] += np.bincount(self._batch(begin[counted]), held[counted], self.bins.shape[1])
        self._decode_waves(s)

    def _dispatch(self, s: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
        """Waves `s` of GPUs `g`, sorted by the time `t` their attention step ends, send their rows to the expert
        GPUs: drawn per hosted expert, on each end's link, and queued there."""
        tokens = self.w if self.loads is None else self.wave_rows[s][:, None]  # each wave's rows
        drawn = self.counts.draw_many(self.layer[s], tokens, float(t[0]))  # [n, ids]
        drawn = np.concatenate([drawn, np.zeros((len(s), 1))], axis=1)[:, self.ids]  # [n, nh, E]
        into = drawn.sum(1)  # [n, E] rows each expert GPU receives
        lk = self.lk
        self.a_out[g] = np.maximum(t, self.a_out[g]) + self.copies * lk.attn_out
        # Each expert GPU's link in: message sets first sent first through; sets sent at one instant share it and
        # are in together (what the one timeline did with the A GPUs' rows).
        got = into > 0
        through = _fifo(np.where(got, t[:, None], -np.inf), into * lk.expert_in, self.e_in)
        self.e_in = through[-1]
        through = through[
            np.searchsorted(t, t, side="right") - 1
        ]  # each set's last one sent at the same instant
        self.arr[s] = np.where(got, np.maximum(self.a_out[g][:, None], through) + lk.latency, np.inf)
        self.pend[s] = got
        if self.waves:  # a wave served at the block before: its turn-around at each GPU its rows reach
            back = got & (self.served_block[s] == ((self.layer[s] - 1) % self.L)[:, None])
            self.turn[s] = np.where(back, self.arr[s] - self.served_at[s], self.turn[s])
        self.rows[s] = drawn
        np.add.at(self.queue, self.layer[s], drawn)
        self.ready[s] = np.inf
        self.step_end[s] = self.out_end[s] = -np.inf

    def _expert_steps(self, gpus: np.ndarray, start: np.ndarray) -> None:
        """Each of `gpus` starts a grouped step at `start` on what its policy picks from its queued rows: defrag's
        block, or waves' (block, group) cell; a GPU with no cell ready under waves holds instead."""
        if not self.waves:
            queued, pick = self._defrag_pick(gpus, start)
            self._take(gpus, start, queued & (self.layer[:, None] == pick[None, :]), pick)
            return
        taking, go, pick, release = self._waves_pick(gpus, start)
        held = ~go
        self.hold_since[gpus[held]], self.hold_until[gpus[held]] = start[held], release[held]
        gpus, start = gpus[go], start[go]
        if len(gpus):
            self.hold_since[gpus], self.hold_until[gpus] = -np.inf, np.inf
            self._take(gpus, start, taking[:, go], pick[go])

    def _take(self, gpus: np.ndarray, start: np.ndarray, taking: np.ndarray, pick: np.ndarray) -> None:
        """Each of `gpus` runs at `start` a grouped step of block `pick` over the queued rows of the waves
        `taking` [S, G] marks. A GPU's queues per block are the rows still pending there (`self.queue`, kept as
        waves are dispatched and steps take them); only the taken waves are read row by row. Every count is a whole
        number, so these sums are exact in any order: the same steps as summing the queued waves' [waves, hosted,
        GPUs] rows every round (88 % of a 32 + 32 plan's simulation, measured)."""
        G = len(gpus)
        pair_g, pair_s = np.nonzero(
            taking.T
        )  # (wave, GPU) pairs this step takes rows from, by GPU, then wave
        on = gpus[pair_g]
        had = self.rows[pair_s, :, on]  # [P, nh]
        took = had.copy()  # rows each pair gives this step
        first = np.flatnonzero(np.concatenate(([True], pair_g[1:] != pair_g[:-1])))
        take = np.zeros((G, self.rows.shape[1]))
        take[pair_g[first]] = np.add.reduceat(took, first, axis=0)  # [G, nh]
        # The expert cap: up to cap rows a queue, the first arrived first.
        for g, k in zip(*np.nonzero(take > self.cap)):
            who = np.flatnonzero((pair_g == g) & (took[:, k] > 0))
            who = who[np.argsort(self.arr[pair_s[who], gpus[g]], kind="stable")]
            r = took[who, k]
            took[who, k] = np.clip(self.cap - (np.cumsum(r) - r), 0.0, r)
            take[g, k] = self.cap
        left = had - took
        self.rows[pair_s, :, on] = left
        self.pend[pair_s, on] = left.max(1) > 0
        self.queue[pick, :, gpus] -= take
        if self.waves:  # the notes: this GPU served these waves at this block now
            self.served_block[pair_s, on], self.served_at[pair_s, on] = self.layer[pair_s], start[pair_g]
        self._run_steps(gpus, start, np.ascontiguousarray(take.T), pair_g, pair_s)

    def _run_steps(
        self, gpus: np.ndarray, start: np.ndarray, take: np.ndarray, pair_g: np.ndarray, pair_s: np.ndarray
    ) -> None:
        """The steps of `gpus` from `start` over their [nh, G] rows `take` (C order: step_times sums over nh as
        before): their times, the outputs back as one message set each, the waves whose every part is done."""
        dur = self.step_times(take, gpus)
        if not self.variance.is_off:
            dur = dur * self.e_speed[gpus] * self.variance.draw(self.jit_rng, len(gpus))
        done = start + dur
        self.e_free[gpus] = done
        sent = take.sum(0)
        out = np.maximum(done, self.e_out[gpus]) + sent * self.lk.expert_out
        self.e_out[gpus] = out
        np.maximum.at(self.step_end, pair_s, done[pair_g])
        np.maximum.at(self.out_end, pair_s, out[pair_g])
        self._count_expert_steps(start, dur, sent)
        waves = np.unique(pair_s)
        finished = waves[~self.pend[waves].any(1)]
        if len(finished):
            self._back(finished[np.argsort(self.layer[finished], kind="stable")])  # by block, as they were

    def _waves_pick(
        self, gpus: np.ndarray, start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Group cells (cpp/scheduler.cpp pick_oldest_group) for each of `gpus` at its `start`: [S, G] the waves
        of the picked cell queued there, [G] whether a cell is ready (no wave of its group on its way), the picked
        cell's block, and when a GPU with none ready holds until (the earliest end of a wait of a non-empty cell).
        Of the ready cells, the one whose first rows arrived first (the runtime stamps a cell when a pick first
        sees it non-empty), ties to the lowest (block, group)."""
        NG = self.num_groups
        queued = self.pend[:, gpus] & (self.arr[:, gpus] <= start)  # [S, G]
        cell = self.layer * NG + self.group  # [S]
        s_idx, g_idx = np.nonzero(queued)
        oldest = np.full((self.L * NG, len(gpus)), np.inf)
        np.minimum.at(oldest, (cell[s_idx], g_idx), self.arr[s_idx, gpus[g_idx]])
        until = self._cell_waits(gpus, start, queued)
        nonempty = np.isfinite(oldest)
        ready = nonempty & (until <= start)
        pick = np.where(ready, oldest, np.inf).argmin(0)  # [G]
        release = np.where(nonempty & ~ready, until, np.inf).min(0)
        return queued & (cell[:, None] == pick[None, :]), ready.any(0), pick // NG, release

    def _cell_waits(self, gpus: np.ndarray, start: np.ndarray, queued: np.ndarray) -> np.ndarray:
        """[cells, G] the latest end of the waits of each (block, group) cell at each of `gpus` (-inf: none): a
        wave with a turn-around measured is on its way to the block after the one the GPU last served it at until
        its rows there are in, and (served at any block but 0 since) to block 0, until the serving plus twice its
        turn-around per block still to pass, at most the hold guard after it."""
        L, NG = self.L, self.num_groups
        last, at, turn = self.served_block[:, gpus], self.served_at[:, gpus], self.turn[:, gpus]  # [S, G]
        known = turn >= 0
        nxt = (last + 1) % L
        there = queued & (self.layer[:, None] == nxt)
        ends = (
            (known & (last >= 0) & ~there, nxt, at + np.minimum(2 * turn, self.max_hold)),
            (known & (last >= 1) & ~(queued & (self.layer[:, None] == 0)), np.zeros_like(last),
             at + np.minimum(2 * (L - last) * turn, self.max_hold)),
        )  # fmt: skip
        until = np.full((L * NG, len(gpus)), -np.inf)
        for waiting, block, end in ends:
            s, g = np.nonzero(waiting & (end > start))
            np.maximum.at(until, (block[s, g] * NG + self.group[s], g), end[s, g])
        return until

    def _defrag_pick(self, gpus: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[S, G] the waves queued at each of `gpus` by its `start`, and [G] the block defrag picks for each."""
        L = self.L
        pend, arr = self.pend[:, gpus], self.arr[:, gpus]  # [S, G]
        queued = pend & (arr <= start)  # waves queued at each deciding GPU by its start
        q = self.queue[:, :, gpus]  # [L, nh, G]: Q[b][e], pending rows ...
        late_s, late_g = np.nonzero(pend & ~queued)
        if len(late_s):  # ... less those not in yet
            np.subtract.at(q, (self.layer[late_s], slice(None), late_g), self.rows[late_s, :, gpus[late_g]])
        # defrag (cpp/scheduler.cpp pick_defrag): LScore(b) + the block's deepest queue, non-empty blocks only,
        # ties to the lowest block.
        total = q.sum(1)  # [L, G]
        spread = total / self.num_hosted[gpus]
        blocks = np.arange(L)
        lscore = sum(d * spread[(blocks + k + 1) % L] for k, d in enumerate(self.decay))
        return queued, np.where(total > 0, lscore + q.max(1), -np.inf).argmax(0)

    def _count_expert_steps(self, start: np.ndarray, dur: np.ndarray, sent: np.ndarray) -> None:
        """Expert steps started at `start`, `dur` long, sending `sent` rows: counted when they start in the window."""
        lo, hi = self.window
        counted = (start >= lo) & (start < hi)
        self.exp_busy += float(dur[counted].sum())
        self.exp_steps += int(counted.sum())
        self.exp_rows += float(sent[counted].sum())
        if self.bins is not None and counted.any():
            which, nb = self._batch(start[counted]), self.bins.shape[1]
            self.bins[2] += np.bincount(which, dur[counted], nb)
            self.bins[3] += np.bincount(which, minlength=nb)
            self.bins[4] += np.bincount(which, sent[counted], nb)

    def _back(self, slots: np.ndarray) -> None:
        """Waves whose every part is done: each attention GPU's link in takes its wave's rows once the last step
        is done (one wave at a time, in the order their last steps end), and the wave is ready for its next
        block."""
        slots = slots[np.lexsort((self.step_end[slots], self.owner[slots]))]
        lk = self.lk
        while len(slots):
            a = self.owner[slots]
            firsts = np.concatenate(([True], a[1:] != a[:-1]))  # one wave per attention GPU a pass
            s, g = slots[firsts], a[firsts]
            self.a_in[g] = np.maximum(self.step_end[s], self.a_in[g]) + self.copies * lk.attn_in
            self.ready[s] = np.maximum(self.a_in[g], self.out_end[s]) + lk.latency
            self.layer[s] += 1
            slots = slots[~firsts]

    def _result(self, duration_s: float) -> Simulated:
        tps = self.done_rows / self.L / duration_s  # every token takes L blocks (the head counted in time)
        conc = self.A * self.W * self.w
        return Simulated(
            tokens_per_s=tps, itl_s=conc / tps if tps else float("inf"), concurrency=conc,
            attention_rows_per_step=float(self.w), expert_rows_per_step=self.exp_rows / max(1, self.exp_steps),
            attention_busy=min(1.0, self.attn_busy / (self.A * duration_s)),
            expert_busy=min(1.0, self.exp_busy / (self.E * duration_s)),
            expert_pick="waves" if self.waves else "defrag",
        )  # fmt: skip
