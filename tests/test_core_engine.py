"""Engine threads and dispatcher: relabelling, grouping by destination, the round trip through the loopback
hub, stats, a blocking next_batch that lets Python run, and stop() under load."""

import threading
import time

import pytest
import torch

from amoe import core
from amoe.config import POLICIES, SchedulerSection
from amoe.placement import Placement

H, K, E, NB = 4, 2, 6, 3


def cluster(policy="defrag", num_attn=2, num_expert=3, **caps):
    placement = Placement.disaggregated(num_attn, num_expert, E)
    hub = core.LoopbackHub(placement.num_runtimes)
    sched = SchedulerSection(policy=policy, **caps)
    engines = [
        core.Engine(
            core.engine_config(
                r, placement, num_blocks=NB, num_experts=E, top_k=K, hidden=H, scheduler=sched
            ),
            hub.communicator(r),
        )
        for r in range(placement.num_runtimes)
    ]
    return placement, hub, engines


def drain(engine):
    out = []
    while (b := engine.next_batch(0)) is not None:
        out.append(b)
    return out


def test_attention_output_goes_to_experts_and_comes_back_merged():
    """ATTN (b, r) -> EXPERT (b, e) on its runtime -> ATTN (b + 1, r) merged with the residual kept at r."""
    placement, hub, engines = cluster()
    attn = engines[1]  # rank 1
    attn.add_tokens(
        torch.tensor([5, 5, 5, 9]),
        torch.tensor([10, 11, 12, 13]),
        torch.tensor([0, 1, 2, 4]),
        torch.tensor([0, 0, 0, 4]),
        torch.tensor([3, 3, 3, 1]),
    )
    (batch,) = drain(attn)
    assert batch.layer == ("attn", 0, 1) and batch.cu_rows.tolist() == [0, 3, 4]
    assert batch.token_ids.tolist() == [10, 11, 12, 13] and batch.context_lens.tolist() == [3, 5]
    residual = torch.arange(4 * H, dtype=torch.float32).view(4, H)
    moe_input = -residual
    ids = torch.tensor([[0, 4], [3, 1], [2, 5], [4, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    attn.submit_attention(batch, residual, moe_input, ids, weights)  # not started: dispatched inline
    assert attn.stats()["pool_entries"] == 2  # residuals wait for the expert outputs
    seen = set()
    for r in range(2, placement.num_runtimes):
        expert = engines[r]
        expert.pump()
        (b,) = drain(expert)  # block 0's every hosted expert in one grouped batch
        kind, block, _ = b.layer
        groups, cu = b.group_experts.tolist(), b.cu_rows.tolist()
        assert kind == "expert" and block == 0 and len(set(groups)) == len(groups) and cu[-1] == len(b)
        for g, e in enumerate(groups):
            assert placement.expert_runtime[e] == r
            for i in range(cu[g], cu[g + 1]):
                row = int(-b.x[i, 0].item()) // H
                k = ids[row].tolist().index(e)
                assert b.weights[i].item() == pytest.approx(weights[row, k].item())
                assert b.attn_ranks[i].item() == 1 and b.positions[i].item() == [0, 1, 2, 4][row]
                seen.add((row, e))
        expert.submit_expert(b, b.x * b.weights[:, None])
    assert seen == {(i, e) for i in range(4) for e in ids[i].tolist()}
    attn.pump()
    (merged,) = drain(attn)
    assert merged.layer == ("attn", 1, 1)
    # Chunks leave the pool in completion order; rows of a chunk stay together in position order.
    where = {(5, 0): 0, (5, 1): 1, (5, 2): 2, (9, 4): 3}
    rows = torch.tensor([where[k] for k in zip(merged.request_ids.tolist(), merged.positions.tolist())])
    assert sorted(merged.request_ids.tolist()) == [5, 5, 5, 9] and rows.tolist() in (
        [0, 1, 2, 3],
        [3, 0, 1, 2],
    )
    assert torch.equal(merged.residual, residual[rows])
    order = ids.sort(dim=1)
    assert torch.equal(merged.expert_ids, order.values[rows])
    want = moe_input[:, None, :] * weights.gather(1, order.indices)[:, :, None]
    assert torch.allclose(merged.expert_out, want[rows])
    stats = attn.stats()
    assert stats["tokens_out"] == 8 and stats["pool_entries"] == 0
    assert stats["batches"][("attn", 0, 1)] == 1 and stats["rows"][("attn", 1, 1)] == 4


@pytest.mark.parametrize("grouped", [True, False])
def test_an_expert_runtime_runs_a_blocks_hosted_experts_as_one_step(grouped):
    """scheduler.group_experts: the picked block's every hosted expert's queue in one batch (each up to the expert
    cap), as EP runs a device's experts; off: one (block, expert) queue a batch."""
    placement, hub, engines = cluster(num_attn=1, num_expert=2, expert_batch_cap=2, group_experts=grouped)
    attn, expert = engines[0], engines[1]  # runtime 1 hosts experts 0, 2, 4
    n = 3
    attn.add_tokens(torch.arange(n), torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long))  # fmt: skip
    (batch,) = drain(attn)
    ids = torch.tensor([[0, 2], [0, 4], [0, 1]])  # expert 0 gets 3 rows (one over the cap), 2 and 4 one each
    attn.submit_attention(batch, torch.zeros(n, H), torch.zeros(n, H), ids, torch.full((n, K), 0.5))
    expert.pump()
    got = [(b.group_experts.tolist(), b.cu_rows.tolist()) for b in drain(expert)]
    if grouped:
        assert got == [([0, 2, 4], [0, 2, 3, 4]), ([0], [0, 1])]
    else:
        assert sorted(g for g, _ in got) == [[0], [0], [2], [4]] and all(len(g) == 1 for g, _ in got)


def test_submit_validates_outputs():
    _, _, engines = cluster()
    attn = engines[0]
    attn.add_tokens(
        torch.tensor([1]), torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1])
    )
    (batch,) = drain(attn)
    x = torch.zeros(1, H)
    with pytest.raises(ValueError, match="topk_ids"):
        attn.submit_attention(batch, x, x, torch.tensor([[0, E]]), torch.ones(1, K))
    with pytest.raises(ValueError, match="residual"):
        attn.submit_attention(batch, torch.zeros(2, H), x, torch.tensor([[0, 1]]), torch.ones(1, K))
    with pytest.raises(ValueError, match="expert batch"):
        attn.submit_expert(batch, x)
    with pytest.raises(ValueError, match="add_tokens"):
        engines[3].add_tokens(
            torch.tensor([1]), torch.tensor([3]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1])
        )


def fake_attention(batch):
    """A stand-in layer: deterministic per row, so the whole pipeline has a closed-form answer."""
    if batch.block == 0:
        h = batch.token_ids.float()[:, None].repeat(1, H)
    else:
        h = batch.residual + batch.expert_out.sum(1)
    residual = h + 1
    ids = torch.stack(
        [
            (batch.token_ids if batch.block == 0 else batch.request_ids) % E,
            (batch.positions + batch.block + 1) % E,
        ],
        1,
    )
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    return residual, residual * 0.5, ids, torch.full((len(batch), K), 0.5)


def reference(tokens):
    """What the fake pipeline computes for each token, whatever its request or position."""
    out = []
    for tok in tokens:
        h = torch.full((H,), float(tok))
        for _ in range(NB):
            residual = h + 1
            h = residual + 2 * (residual * 0.5 * 0.5)  # two experts, each x * weight
        out.append(h)
    return torch.stack(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", POLICIES)
def test_threads_run_a_fake_model_end_to_end(policy):
    placement, hub, engines = cluster(policy, attn_batch_cap=3, expert_batch_cap=2)
    results, stop = {}, threading.Event()

    def loop(engine):
        while not stop.is_set():
            batch = engine.next_batch(0.01)
            if batch is None:
                continue
            if batch.kind == "expert":
                engine.submit_expert(batch, batch.x * batch.weights[:, None])
            elif batch.block == NB:
                h = batch.residual + batch.expert_out.sum(1)
                for i, rid in enumerate(batch.request_ids.tolist()):
                    results[(rid, batch.positions[i].item())] = h[i]
                none = torch.zeros(0, dtype=torch.long)
                engine.submit_head(batch, none, none, none, none)  # no request goes on
            else:
                engine.submit_attention(batch, *fake_attention(batch))

    threads = [threading.Thread(target=loop, args=(e,)) for e in engines]
    want = {}
    with engines[0], engines[1], engines[2], engines[3], engines[4]:
        for t in threads:
            t.start()
        for rid in range(20):
            n = 1 + rid % 4
            toks = torch.arange(n) + 7 * rid
            engines[rid % 2].add_tokens(
                torch.full((n,), rid),
                toks,
                torch.arange(n),
                torch.zeros(n, dtype=torch.long),
                torch.full((n,), n),
            )
            for p, h in enumerate(reference(toks.tolist())):
                want[(rid, p)] = h
        deadline = time.monotonic() + 30
        while len(results) < len(want) and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join()
    assert set(results) == set(want)
    for key, h in want.items():
        assert torch.allclose(results[key], h), key
    for e in engines:
        s = e.stats()
        assert s["pool_entries"] == 0 and s["errors"] == 0 and not any(s["depth"].values())
        assert sum(s["dropped"].values()) == 0


def test_head_output_reenters_block_zero_like_a_layer_output():
    """submit_head hands each continuing request's sampled token on to ATTN (0, rank), a one-row chunk at its
    position; requests that finished (left out) enter nothing."""
    placement, hub, engines = cluster()
    attn = engines[0]  # rank 0, not started: the head batch is made by hand from three one-row chunks
    attn.ingest(
        core.make_message(
            torch.zeros(3, H),
            request_id=[5, 6, 7],
            kind=[core.ATTN] * 3,
            block=[NB] * 3,
            index=[0] * 3,
            position=[3, 8, 1],
        )
    )
    for part in range(1, K + 1):
        attn.ingest(
            core.make_message(
                torch.zeros(3, H),
                request_id=[5, 6, 7],
                kind=[core.ATTN] * 3,
                block=[NB] * 3,
                index=[0] * 3,
                position=[3, 8, 1],
                slot=[part] * 3,
                expert_id=[part] * 3,
            )
        )
    head = attn.next_batch(0)
    assert head.kind == "head" and head.block == NB and len(head) == 3
    attn.submit_head(
        head, torch.tensor([7, 5]), torch.tensor([42, 43]), torch.tensor([2, 4]), torch.tensor([6])
    )
    entered = attn.next_batch(0)
    assert (entered.kind, entered.block, entered.index) == ("attn", 0, 0)
    assert sorted(
        zip(entered.request_ids.tolist(), entered.token_ids.tolist(), entered.positions.tolist())
    ) == [
        (5, 43, 4),
        (7, 42, 2),
    ]
    assert entered.cu_rows.tolist() == [0, 1, 2] and sorted(entered.context_lens.tolist()) == [3, 5]
    assert attn.next_batch(0) is None  # request 6 finished: nothing of it entered


# Slow: what it measures is wall time — a real 0.5 s timeout elapsing while another thread holds the CPU.
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_next_batch_releases_the_gil():
    _, _, engines = cluster()
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    with engines[0] as engine:
        t.start()
        time.sleep(0.05)
        before = count[0]
        t0 = time.monotonic()
        assert engine.next_batch(timeout=0.5) is None
        waited = time.monotonic() - t0
        progressed = count[0] - before
        stop.set()
        t.join()
        assert engine.stats()["idle_s"] >= 0.4
    assert 0.45 <= waited < 5 and progressed > 10_000


@pytest.mark.timeout(30)
def test_next_batch_without_timeout_returns_none_on_stop():
    _, _, engines = cluster()
    engine = engines[0]
    engine.start()
    got = []
    waiter = threading.Thread(target=lambda: got.append(engine.next_batch()))
    waiter.start()
    time.sleep(0.1)
    engine.stop()
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]


# Slow: stop's latency under a flood of senders is wall time (the margin, 5 s against milliseconds, is wide).
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_stop_under_load_returns_and_is_idempotent():
    placement, hub, engines = cluster()
    attn = engines[0]
    stop = threading.Event()
    msg_rows = 32
    x = torch.randn(msg_rows, H)

    def flood(sender):
        i = 0
        while not stop.is_set():
            rid = torch.arange(i, i + msg_rows) + sender * 10**9
            hub.send(
                0,
                core.make_message(
                    x,
                    request_id=rid,
                    kind=[core.ATTN] * msg_rows,
                    block=[1] * msg_rows,
                    index=[0] * msg_rows,
                    position=[3] * msg_rows,
                    slot=[sender % 3] * msg_rows,
                    expert_id=[sender] * msg_rows,
                ),
            )
            i += msg_rows

    def consume():
        while (b := attn.next_batch(0.01)) is not None or attn.running:
            if b is not None and b.kind == "attn" and b.block < NB:
                attn.submit_attention(
                    b,
                    b.residual,
                    b.residual,
                    torch.zeros(len(b), K, dtype=torch.long) + torch.arange(K),
                    torch.ones(len(b), K),
                )

    senders = [threading.Thread(target=flood, args=(s,)) for s in range(3)]
    for e in engines:
        e.start()
    consumer = threading.Thread(target=consume)
    for t in [*senders, consumer]:
        t.start()
    time.sleep(0.5)
    assert attn.stats()["tokens_in"] > 0
    t0 = time.monotonic()
    for e in engines:
        e.stop()
    stopped_in = time.monotonic() - t0
    for e in engines:
        e.stop()  # idempotent
    stop.set()
    for t in [*senders, consumer]:
        t.join(10)
        assert not t.is_alive()
    assert stopped_in < 5
    assert attn.next_batch(0) is None and not attn.running
    with pytest.raises(ValueError, match="stopped"):
        attn.start()


def test_context_manager_starts_and_stops():
    _, _, engines = cluster()
    with engines[2] as e:
        assert e.running
    assert not engines[2].running
    del engines  # destruction after stop, and of never-started engines, must not hang
