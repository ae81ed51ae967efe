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
from amoe.perf.model.variance import OFF, StepVariance
from amoe.perf.plan.bound_pools import pool_links
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.batch_means import batch_means_halfwidth
from amoe.perf.plan.simulate.result import Simulated


class RowCounts(Protocol):
    """What this simulation draws its rows from (scale.Counts)."""

    def draw_many(self, blocks: np.ndarray, tokens: int, now_s: float) -> np.ndarray: ...


class StepCosts(Protocol):
    """The grouped step costs it prices its expert steps with (scale.GroupedSteps): [expert ids] rows → [expert
    GPUs] seconds, and the model, GPU and host they are of."""

    model: ModelProfile
    gpu: GpuProfile
    host: HostOverhead

    def __call__(self, rows: np.ndarray) -> np.ndarray: ...


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
        variance: StepVariance = OFF,
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
            SchedulerSection()
        )  # defrag's pick (the rule modelled at scale); K and δ the config's defaults
        self.decay = sched.decay ** np.arange(1, sched.lookahead + 1)
        self.lk = pool_links(model, dep)
        self.copies = w * model.experts_per_token
        self.attn = cm.decode_attention_time(model, ga, w, int(round(ctx)), host)
        self.head = cm.head_time(model, ga, w, host=host)
        # The least an expert GPU's step can take (one row of its cheapest hosted expert): how far ahead a reply
        # still to be decided cannot come.
        one = np.zeros(model.num_expert_ids)
        for experts in hosted:
            one[min(experts, key=model.intermediate_of)] = 1.0
        self.step_min = self.steps(one)[self.gpus]
        self._vary(variance, dep.num_expert)
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

    def _vary(self, variance: StepVariance, num_expert: int) -> None:
        """Step-time variance (docs/simulation.md "Step-time variance at scale"): attention GPU a is device a, expert
        GPU g device A + g; each step × the device's speed × a jitter drawn when the step is committed. The
        look-ahead takes the least a step can then be."""
        A = self.A
        self.variance = variance
        self.attn_min = self.attn
        if not variance.is_off:
            self.a_speed = variance.speeds(0, A)
            self.e_speed = np.array([variance.speed(A + int(g)) for g in self.gpus])
            self.jit_rng = variance.jitter_rng(A + num_expert)
            low = 1.0 - variance.jitter
            self.step_min = self.step_min * self.e_speed * low
            self.attn_min = self.attn * float(self.a_speed.min()) * low

    def step_times(self, take: np.ndarray, gpus: np.ndarray | None = None) -> np.ndarray:
        """[G] the grouped step of each of `gpus` (None: all) over its [nh, G] rows: scale.GroupedSteps'
        formula on the hosted experts only (one copy an id), not over the [ids, GPUs] matrix (most of a round's
        time before)."""
        st, inter = self.steps, self.inter if gpus is None else self.inter[:, gpus]
        m, gpu, host = st.model, st.gpu, st.host
        h, bp, ba = m.hidden_size, m.bytes_per_param, m.bytes_per_activation
        busy = take > 0
        r = np.where(busy, np.maximum(1.0, np.round(take)), 0.0)
        weights = np.where(busy, h * inter * bp, 0.0)
        gate_up_f, gate_up_b = (4 * r * h * inter).sum(0), (2 * weights + r * (h + 2 * inter) * ba).sum(0)
        act_b = (r * 3 * inter * ba).sum(0)
        down_f, down_b = (2 * r * inter * h).sum(0), (weights + r * (inter + h) * ba).sum(0)
        count = busy.sum(0)
        phases = ((gate_up_f, gate_up_b), (0.0, act_b), (down_f, down_b))
        mean_rows = r.sum(0) / np.maximum(count, 1)
        slow = gpu.kernels.decode_grouped_slowdown
        gpu_s = cm.swiglu_gemms_time(gpu, m.expert_precision, phases, mean_rows, count > 0, slow)
        fixed = np.where(busy.any(0), cm.EXPERT_KERNELS * gpu.launch_s + host.expert_step_s, 0.0)
        return gpu_s + fixed + take.sum(0) * host.expert_row_s

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
            queued = np.where(self.pend, self.arr, np.inf).min(0)  # [E] the first rows still queued at each
            e_start = np.maximum(self.e_free, queued)
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
        s, g, b = slot[att], gpus[att], begin[att]
        held = self.attn if f is None else self.attn * f[att]
        sent = b + held
        self.a_free[g] = sent
        # progress: one wave's block (as the event level counts attention-step rows)
        self.done_rows += self.w * int(counted[att].sum())
        if f is None:
            self.attn_busy += self.attn * int(counted[att].sum())
        else:
            self.attn_busy += float(held[counted[att]].sum())
        if self.bins is not None:
            n = np.bincount(self._batch(b[counted[att]]), minlength=self.bins.shape[1])
            self.bins[0] += self.w * n
            self.bins[1] += (
                self.attn * n
                if f is None
                else np.bincount(self._batch(b[counted[att]]), held[counted[att]], self.bins.shape[1])
            )
        order = np.argsort(sent, kind="stable")
        self._dispatch(s[order], g[order], sent[order])

    def _heads(
        self, s: np.ndarray, g: np.ndarray, begin: np.ndarray, counted: np.ndarray, f: np.ndarray | None,
        is_head: np.ndarray,
    ) -> None:  # fmt: skip
        """Waves `s` of GPUs `g` run the head at `begin`: their next token starts at block 0 when it is done."""
        if f is None:
            self.a_free[g] = begin + self.head
            self.attn_busy += self.head * int(counted.sum())
        else:
            held = self.head * f[is_head]
            self.a_free[g] = begin + held
            self.attn_busy += float(held[counted].sum())
        self.ready[s], self.layer[s] = self.a_free[g], 0
        if self.bins is not None:
            if f is None:
                self.bins[1] += (
                    np.bincount(self._batch(begin[counted]), minlength=self.bins.shape[1]) * self.head
                )
            else:
                self.bins[1] += np.bincount(self._batch(begin[counted]), held[counted], self.bins.shape[1])

    def _dispatch(self, s: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
        """Waves `s` of GPUs `g`, sorted by the time `t` their attention step ends, send their rows to the expert
        GPUs: drawn per hosted expert, on each end's link, and queued there."""
        drawn = self.counts.draw_many(self.layer[s], self.w, float(t[0]))  # [n, ids]
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
        self.rows[s] = drawn
        np.add.at(self.queue, self.layer[s], drawn)
        self.ready[s] = np.inf
        self.step_end[s] = self.out_end[s] = -np.inf

    def _expert_steps(self, gpus: np.ndarray, start: np.ndarray) -> None:
        """Each of `gpus` starts a grouped step at `start` on the block defrag picks from its queued rows. A GPU's
        queues per block are the rows still pending there (`self.queue`, kept as waves are dispatched and steps
        take them) less those of waves not in by its start; only the picked block's waves are read row by row.
        Every count is a whole number, so these sums are exact in any order: the same steps as summing the
        queued waves' [waves, hosted, GPUs] rows every round (88 % of a 32 + 32 plan's simulation, measured)."""
        G = len(gpus)
        queued, pick = self._defrag_pick(gpus, start)
        # (wave, GPU) pairs this step takes rows from, by GPU, then by wave
        pair_g, pair_s = np.nonzero((queued & (self.layer[:, None] == pick[None, :])).T)
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
        take = np.ascontiguousarray(take.T)  # [nh, G], C order: step_times sums over nh as before
        dur = self.step_times(take, gpus)
        if not self.variance.is_off:
            dur = dur * self.e_speed[gpus] * self.variance.draw(self.jit_rng, len(gpus))
        done = start + dur
        self.e_free[gpus] = done
        sent = take.sum(0)
        # a step's outputs go back as one message set
        out = np.maximum(done, self.e_out[gpus]) + sent * self.lk.expert_out
        self.e_out[gpus] = out
        np.maximum.at(self.step_end, pair_s, done[pair_g])
        np.maximum.at(self.out_end, pair_s, out[pair_g])
        self._count_expert_steps(start, dur, sent)
        waves = np.unique(pair_s)
        finished = waves[~self.pend[waves].any(1)]
        if len(finished):
            self._back(finished[np.argsort(self.layer[finished], kind="stable")])  # by block, as they were

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
        )  # fmt: skip
