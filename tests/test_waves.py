"""The waves policy (docs/engine.md "The waves rule", issue 32): the C++ scheduler picks what the Python oracle
picks, step by step with its state (wave positions, readiness stamps); new requests fill waves of the cap; and a
run with Poisson arrivals and request replacement finishes every request without the deadline guard."""

import heapq
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe import core
from amoe.config import SchedulerSection
from amoe.placement import Placement
from amoe.testing import policies

OPS = st.lists(
    st.tuples(
        st.sampled_from(["rows", "rows", "out", "back", "pick", "pick", "force"]),
        st.integers(0, 60),
        st.integers(0, 60),
        st.integers(1, 9),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 6), waves=st.integers(1, 4), cap=st.integers(1, 12), ops=OPS)
def test_attention_picks_match_the_oracle(blocks, waves, cap, ops):
    """Rows arrive, parts go out and come back, the runtime picks and drains what it picked (up to the cap) or
    is forced: every pick, the hold flag and the waves' positions agree with the oracle."""
    s = core.Scheduler(blocks, waves, "waves", 0, 0.0)
    s.wave_cols = True
    o = policies.Waves(blocks, waves, wave_cols=True)
    for op, bi, wi, n in ops:
        b, w = bi % blocks, wi % waves
        if op == "rows":
            s.add(b, w, n)
            o.add(b, w, n)
        elif op == "out":
            s.add_pending(b, n, w)
            o.add_pending(b, n, w)
        elif op == "back":
            n = min(n, o.pending[b][w])
            s.add_pending(b, -n, w)
            o.add_pending(b, -n, w)
        else:
            force = op == "force"
            want = o.pick(force=force)
            assert s.pick(force=force) == want
            assert s.holding == o.holding
            if want is not None:
                taken = min(cap, o.depths[want[0]][want[1]])
                s.add(*want, -taken)
                o.add(*want, -taken)
        assert [s.wave_position(w) for w in range(waves)] == o.position
    for b in range(blocks):
        for w in range(waves):
            assert s.pending(b, w) == o.pending[b][w] and s.depth(b, w) == o.depths[b][w]


@settings(max_examples=150, deadline=None)
@given(blocks=st.integers(1, 6), experts=st.integers(1, 4), ops=OPS)
def test_expert_picks_match_the_oracle(blocks, experts, ops):
    """An expert runtime under waves runs the block that has waited longest, its deepest queue."""
    s = core.Scheduler(blocks, experts, "waves", 0, 0.0)
    o = policies.Waves(blocks, experts, wave_cols=False)
    for op, bi, ci, n in ops:
        b, c = bi % blocks, ci % experts
        if op == "rows":
            s.add(b, c, n)
            o.add(b, c, n)
        elif op in ("pick", "force"):
            want = o.pick()
            assert s.pick() == want and not s.holding
            if want is not None:  # a grouped step: every queue of the block
                for c2 in range(experts):
                    n2 = o.depths[want[0]][c2]
                    s.add(want[0], c2, -n2)
                    o.add(want[0], c2, -n2)


def test_a_wave_is_held_until_its_front_is_back_and_new_requests_wait_for_their_wave():
    """Two waves on 3 blocks + head: a wave with parts out at its front holds; rows of a wave behind its front
    (new requests at block 0) wait for the wave to come round; waves are never merged."""
    s = core.Scheduler(4, 2, "waves", 0, 0.0)
    s.wave_cols = True
    assert [s.admit(2) for _ in range(5)] == [0, 0, 1, 1, 0]  # waves of 2; all full: the fewest (lowest)
    s.leave(0)
    assert s.members(0) == 2 and s.members(1) == 2
    s.add(0, 0, 2)  # wave 0 at block 0
    s.add(0, 1, 2)  # wave 1 at block 0
    assert s.pick() == (0, 0)  # both ready: the lower wave first (stamped in the same pick)
    s.add(0, 0, -2)
    s.add_pending(1, 2, 0)  # wave 0 is out to block 1
    assert s.pick() == (0, 1)  # wave 1 is ready; wave 0 is not
    s.add(0, 1, -2)
    s.add_pending(1, 2, 1)
    s.add(0, 0, 1)  # a new request of wave 0 at block 0: behind wave 0's front (block 1)
    assert s.pick() is None and s.holding
    s.add_pending(1, -1, 0)
    s.add(1, 0, 1)  # half of wave 0 back at block 1: still held (its parts are out)
    assert s.pick() is None and s.holding
    s.add_pending(1, -1, 0)
    s.add(1, 0, 1)
    assert s.pick() == (1, 0)  # wave 0 whole at block 1; wave 1 (also at block 1) is not merged into it
    s.add(1, 0, -2)
    s.add_pending(2, 2, 0)  # wave 0 is out to block 2; its new request still waits at block 0
    s.add_pending(1, -2, 1)
    s.add(1, 1, 2)
    assert s.pick() == (1, 1)
    s.add(1, 1, -2)
    assert s.pick(force=True) == (0, 0)  # forced: the fullest cell, and wave 0's position moves there
    assert s.wave_position(0) == 0


def run_with_arrivals(seed: int, num_requests: int = 120, slots: int = 7, cap: int = 3) -> tuple[int, int]:
    """One attention runtime (3 blocks + head, waves of `cap`) and one expert runtime (3 experts, top-2, grouped
    steps), both scheduled by the C++ scheduler under waves, transfers taking random times. Requests arrive as a
    Poisson process; at most `slots` decode at once and a finished request's slot goes to the next waiting
    arrival (request replacement). The runtimes never force a pick (no deadline guard): returns the requests
    finished and the events run."""
    rng = random.Random(seed)
    blocks, experts, k = 3, 3, 2
    waves = -(-slots // cap)
    attn = core.Scheduler(blocks + 1, waves, "waves", 0, 0.0)
    attn.wave_cols = True
    exp = core.Scheduler(blocks, experts, "waves", 0, 0.0)
    attn_q = [[[] for _ in range(waves)] for _ in range(blocks + 1)]
    exp_q = [[[] for _ in range(experts)] for _ in range(blocks)]
    wave_of, need, out = {}, {}, {}
    events, seq, busy = [], iter(range(10**9)), {"a": False, "e": False}
    waiting, finished, active = [], 0, 0

    def at(t, *what):
        heapq.heappush(events, (t, next(seq), what))

    def enqueue_attn(b, rid):
        attn_q[b][wave_of[rid]].append(rid)
        attn.add(b, wave_of[rid], 1)

    def admit(now):
        nonlocal active
        while waiting and active < slots:
            rid = waiting.pop(0)
            wave_of[rid] = attn.admit(cap)
            active += 1
            enqueue_attn(0, rid)
        at(now, "start", "a")

    t = 0.0
    for rid in range(num_requests):
        t += rng.expovariate(1.0)
        need[rid] = rng.randint(1, 5)
        at(t, "arrive", rid)
    runs = 0
    while events:
        now, _, what = heapq.heappop(events)
        runs += 1
        assert runs < 200_000, "no progress"
        if what[0] == "arrive":
            waiting.append(what[1])
            admit(now)
        elif what[0] == "start":
            side = what[1]
            if busy[side]:
                continue
            sched = attn if side == "a" else exp
            picked = sched.pick()
            if picked is None:
                continue
            b, c = picked
            busy[side] = True
            if side == "a":
                rows = attn_q[b][c][:cap]
                del attn_q[b][c][: len(rows)]
                attn.add(b, c, -len(rows))
                at(now + 1.0, "attn_done", b, rows)
            else:
                rows = []
                for e in range(experts):
                    rows += [(rid, e) for rid in exp_q[b][e]]
                    exp.add(b, e, -len(exp_q[b][e]))
                    exp_q[b][e] = []
                at(now + 0.5, "exp_done", b, rows)
        elif what[0] == "attn_done":
            busy["a"] = False
            b, rows = what[1], what[2]
            for rid in rows:
                if b == blocks:  # the head: a token out
                    need[rid] -= 1
                    if need[rid] == 0:
                        attn.leave(wave_of.pop(rid))
                        finished += 1
                        active -= 1
                    else:
                        enqueue_attn(0, rid)
                    continue
                out[rid] = k
                attn.add_pending(b + 1, k, wave_of[rid])
                for e in rng.sample(range(experts), k):
                    at(now + rng.uniform(0.1, 2.0), "to_expert", b, e, rid)
            admit(now)
        elif what[0] == "to_expert":
            b, e, rid = what[1:]
            exp_q[b][e].append(rid)
            exp.add(b, e, 1)
            at(now, "start", "e")
        elif what[0] == "exp_done":
            busy["e"] = False
            for rid, _ in what[2]:
                at(now + rng.uniform(0.1, 2.0), "back", what[1], rid)
            at(now, "start", "e")
        elif what[0] == "back":
            b, rid = what[1], what[2]
            attn.add_pending(b + 1, -1, wave_of[rid])
            out[rid] -= 1
            if out[rid] == 0:
                enqueue_attn(b + 1, rid)
            at(now, "start", "a")
    return finished, runs


def test_no_livelock_under_poisson_arrivals_with_request_replacement():
    for seed in range(3):
        finished, _ = run_with_arrivals(seed)
        assert finished == 120


def test_the_simulation_keeps_the_bounds_waves_full_and_apart():
    """In the simulation (which runs this scheduler) at the bound's concurrency, W = 4 waves of the cap's 64 rows a
    rank: every attention step is a whole wave, and keeping the waves apart beats merging them (`wave`)."""
    from amoe.emulation import bounds
    from amoe.emulation.plan import mean_context
    from amoe.emulation.profiles import host_overhead, model_profile
    from amoe.emulation.simulate import simulate

    host, ctx, routing = host_overhead("amoe-paper"), mean_context("short"), "skew-exp:0.08"
    model = model_profile("mixtral-8x7b-mqa:8", 1)
    dep = bounds.Deployment("aep", "a100-80g", 2, "a100-80g", 2, 64, 256)
    bound = bounds.predict(model, dep, bounds.routing_inclusion(model, routing), ctx, host)
    assert (bound.extra["waves"], bound.extra["wave_rows"], bound.concurrency) == (4, 64, 512)
    got = {
        policy: simulate(
            model, dep, routing, ctx, host, bound.concurrency, warmup_s=4 * bound.itl_s,
            duration_s=8 * bound.itl_s, scheduler=SchedulerSection(policy=policy, attn_batch_cap=64, expert_batch_cap=256),
        )
        for policy in ("wave", "waves")
    }  # fmt: skip
    assert got["waves"].attention_rows_per_step == 64
    assert got["waves"].tokens_per_s > 1.5 * got["wave"].tokens_per_s


def test_a_request_cancelled_while_its_rows_are_out_does_not_hold_its_wave():
    """The engine under waves (waves of 1): request 9's block-0 batch is drained, then 9 is forgotten before its
    expert rows go out. Its outputs would be dropped on arrival, so nothing is expected of them; a request that
    joins 9's wave next is served at once instead of being held for parts that never return."""
    placement = Placement.disaggregated(1, 2, 4)
    hub = core.LoopbackHub(3)
    sched = SchedulerSection(policy="waves", attn_batch_cap=1)
    cfg = core.engine_config(
        0, placement, num_blocks=2, num_experts=4, top_k=2, hidden=4, scheduler=sched, track_requests=True,
        max_requests=2,
    )  # fmt: skip
    assert cfg.num_waves == 2
    attn = core.Engine(cfg, hub.communicator(0))

    def add(rid):
        one = torch.tensor([rid])
        attn.add_tokens(one, torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))

    add(9)
    add(10)
    first = attn.next_batch(0)
    assert first.request_ids.tolist() == [9]
    attn.forget(torch.tensor([9]))
    attn.submit_attention(
        first, torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    )
    assert attn.stats()["expected_parts"] == 0
    assert attn.next_batch(0).request_ids.tolist() == [10]  # wave 1
    add(11)  # joins wave 0, which 9 left
    assert attn.next_batch(0).request_ids.tolist() == [11]
