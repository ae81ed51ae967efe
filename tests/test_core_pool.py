"""Token pool and μ-queues: random arrival streams reach exactly the right queue, exactly once, whole."""

import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amoe import core
from amoe.config import POLICIES, SchedulerSection
from amoe.placement import Placement

H = 3
ATTN_RANK = 1


def attention_engine(top_k, num_experts, num_blocks, attn_cap=256, policy="defrag"):
    placement = Placement(attn_runtime=(1, 0), expert_runtime=tuple(2 for _ in range(num_experts)))
    hub = core.LoopbackHub(3)
    cfg = core.engine_config(
        0,
        placement,
        num_blocks=num_blocks,
        num_experts=num_experts,
        top_k=top_k,
        hidden=H,
        scheduler=SchedulerSection(policy=policy, attn_batch_cap=attn_cap),
    )
    return core.Engine(cfg, hub.communicator(0)), hub


@st.composite
def attention_streams(draw):
    """Parts of chunks (prefill and decode, blocks 0..num_blocks) in random order and message splits."""
    top_k = draw(st.integers(1, 4))
    num_experts = draw(st.integers(top_k, 6))
    num_blocks = draw(st.integers(1, 3))
    chunks, parts = {}, []
    for _ in range(draw(st.integers(1, 8))):
        key = (draw(st.integers(0, 3)), draw(st.integers(0, num_blocks)), draw(st.integers(0, 12)))
        if key in chunks:
            continue
        req, block, start = key
        length = draw(st.sampled_from([1, 1, 1, 2, 3, 5]))
        rows = []
        for pos in range(start, start + length):
            experts = draw(st.permutations(range(num_experts)))[:top_k]
            slots = [(0, -1)] + ([] if block == 0 else [(s + 1, e) for s, e in enumerate(experts)])
            rows.append([(slot, e, len(parts) + i + 1) for i, (slot, e) in enumerate(slots)])
            parts += [(req, block, start, length, pos, slot, e, v) for slot, e, v in rows[-1]]
        chunks[key] = rows
    order = draw(st.permutations(range(len(parts))))
    missing = set(draw(st.lists(st.sampled_from(order), max_size=2)))
    stream = [parts[i] for i in order if i not in missing]
    # Duplicates of a part while its chunk is still in the pool (before the chunk's last part arrives).
    for _ in range(draw(st.integers(0, 3)) if stream else 0):
        at = draw(st.integers(0, len(stream) - 1))
        key = stream[at][:3]
        later = [j for j in range(at + 1, len(stream)) if stream[j][:3] == key]
        incomplete = any(parts[i][:3] == key for i in missing)
        if later or incomplete:
            stream.insert(
                draw(st.integers(at + 1, later[-1] if later and not incomplete else len(stream))), stream[at]
            )
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    incomplete = {parts[i][:3] for i in missing}
    complete = {k: v for k, v in chunks.items() if k not in incomplete}
    in_pool = incomplete & {p[:3] for p in stream}  # incomplete chunks with at least one part arrived
    return top_k, num_experts, num_blocks, stream, cuts, complete, in_pool


def to_messages(stream, cuts):
    """Split a part stream into messages; token-id parts (block 0) and activation parts travel separately."""
    bounds = [0, *cuts, len(stream)]
    for lo, hi in zip(bounds, bounds[1:]):
        for is_ids in (True, False):
            rows = [p for p in stream[lo:hi] if (p[1] == 0) == is_ids]
            if not rows:
                continue
            req, block, start, length, pos, slot, expert, value = (list(c) for c in zip(*rows))
            data = (
                torch.tensor(value)
                if is_ids
                else torch.tensor(value, dtype=torch.float32)[:, None].repeat(1, H)
            )
            yield core.make_message(
                data,
                request_id=req,
                kind=[core.ATTN] * len(rows),
                block=block,
                index=[ATTN_RANK] * len(rows),
                position=pos,
                chunk_start=start,
                chunk_len=length,
                slot=slot,
                expert_id=expert,
                attn_rank=[ATTN_RANK] * len(rows),
            )


def check_batches(batches, complete, top_k, attn_cap):
    seen = {}
    for b in batches:
        kind, block, rank = b.layer
        assert (kind, rank) == ("attn", ATTN_RANK)
        cu = b.cu_rows.tolist()
        assert cu[-1] == len(b) and (len(b) <= attn_cap or len(cu) == 2)
        for c in range(len(cu) - 1):
            lo, hi = cu[c], cu[c + 1]
            req = b.request_ids[lo].item()
            assert (b.request_ids[lo:hi] == req).all()
            start = b.positions[lo].item()
            assert b.positions[lo:hi].tolist() == list(range(start, start + hi - lo))
            key = (req, block, start)
            assert key not in seen, "a chunk came out twice"
            rows = complete[key]
            assert len(rows) == hi - lo and b.context_lens[c].item() == start + hi - lo
            for i, parts in zip(range(lo, hi), rows):
                if block == 0:
                    assert b.token_ids[i].item() == parts[0][2]
                    continue
                assert torch.equal(b.residual[i], torch.full((H,), float(parts[0][2])))
                by_expert = sorted(parts[1:], key=lambda p: p[1])
                assert b.expert_ids[i].tolist() == [p[1] for p in by_expert]
                want = torch.tensor([float(p[2]) for p in by_expert])[:, None].repeat(1, H)
                assert torch.equal(b.expert_out[i], want)
            seen[key] = True
    assert set(seen) == set(complete), "a complete chunk never came out"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=attention_streams(), attn_cap=st.integers(1, 8), policy=st.sampled_from(POLICIES))
def test_attention_parts_merge_exactly_once(stream, attn_cap, policy):
    top_k, num_experts, num_blocks, parts, cuts, complete, incomplete = stream
    engine, _ = attention_engine(top_k, num_experts, num_blocks, attn_cap, policy)
    for msg in to_messages(parts, cuts):
        engine.ingest(msg)
    batches = []
    while (b := engine.next_batch(0)) is not None:
        batches.append(b)
    check_batches(batches, complete, top_k, attn_cap)
    stats = engine.stats()
    assert stats["pool_entries"] == len(incomplete)
    assert stats["tokens_in"] == len(parts)
    num_dup = len(parts) - len({p[7] for p in parts})
    assert stats["dropped"]["duplicate"] == num_dup
    assert sum(stats["rows"].values()) == sum(len(r) for r in complete.values())
    assert all(d == 0 for d in stats["depth"].values())


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 9)), min_size=1, max_size=40
    ),
    cap=st.integers(1, 10),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**16),
)
def test_expert_rows_reach_their_queue_once(rows, cap, policy, seed):
    """Rows for (block, expert): hosted ones come out once, in arrival order per queue; others are dropped."""
    placement = Placement(attn_runtime=(0,), expert_runtime=(1, 2, 1, 2, 1, 1))
    cfg = core.engine_config(
        1, placement, num_blocks=3, num_experts=6, top_k=2, hidden=H,
        scheduler=SchedulerSection(policy=policy, expert_batch_cap=cap),
    )  # fmt: skip
    engine = core.Engine(cfg, core.LoopbackHub(3).communicator(1))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(rows) + 1), min(3, len(rows) + 1)))
    bounds = [0, *cuts, len(rows)]
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            continue
        block, expert, req = (list(c) for c in zip(*rows[lo:hi]))
        value = torch.arange(lo, hi, dtype=torch.float32)[:, None].repeat(1, H)
        engine.ingest(
            core.make_message(
                value,
                request_id=req,
                kind=[core.EXPERT] * (hi - lo),
                block=block,
                index=expert,
                position=list(range(lo, hi)),
                slot=[1] * (hi - lo),
                expert_id=expert,
                weight=[0.5 + i for i in range(lo, hi)],
                attn_rank=[0] * (hi - lo),
            )
        )
    out = {}
    while (b := engine.next_batch(0)) is not None:
        kind, block, _ = (
            b.layer
        )  # a grouped step: every hosted expert's queue of the block, each up to the cap
        groups, cu = b.group_experts.tolist(), b.cu_rows.tolist()
        assert kind == "expert" and len(set(groups)) == len(groups) and cu[-1] == len(b)
        for g, expert in enumerate(groups):
            assert placement.expert_runtime[expert] == 1 and 1 <= cu[g + 1] - cu[g] <= cap
            for i in range(cu[g], cu[g + 1]):
                idx = int(b.x[i, 0].item())
                assert idx not in out
                assert rows[idx][:2] == (block, expert) and b.request_ids[i].item() == rows[idx][2]
                assert b.weights[i].item() == 0.5 + idx and b.positions[i].item() == idx
                out[idx] = (block, expert)
    hosted = [i for i, (blk, e, _) in enumerate(rows) if placement.expert_runtime[e] == 1]
    assert sorted(out) == hosted
    for key in set(out.values()):  # FIFO within a queue
        order = [i for i in out if out[i] == key]
        assert order == sorted(order)
    assert engine.stats()["dropped"]["misrouted"] == len(rows) - len(hosted)


def test_malformed_input_is_dropped_and_counted():
    engine, _ = attention_engine(top_k=2, num_experts=4, num_blocks=2)
    x = torch.zeros(1, H)
    kw = dict(
        request_id=[1], kind=[core.ATTN], block=[1], index=[ATTN_RANK], position=[0], attn_rank=[ATTN_RANK]
    )
    engine.ingest(core.make_message(torch.zeros(1, H + 1), **kw))  # wrong width
    engine.ingest(core.make_message(x, **{**kw, "index": [0]}))  # another rank's layer
    engine.ingest(core.make_message(x, **{**kw, "slot": [3]}))  # slot > top_k
    engine.ingest(core.make_message(x, **{**kw, "position": [4], "chunk_start": [0], "chunk_len": [2]}))
    engine.ingest(core.make_message(torch.tensor([5]), **kw))  # token ids for block 1
    drops = engine.stats()["dropped"]
    assert drops == {
        "bad_message": 1,
        "misrouted": 1,
        "bad_row": 3,
        "duplicate": 0,
        "unknown_request": 0,
        "retired": 0,
    }
    assert engine.next_batch(0) is None


def test_message_metadata_round_trips_through_bytes():
    msg = core.make_message(
        torch.ones(2, H),
        request_id=[7, 2**40],
        kind=[core.EXPERT] * 2,
        block=[1, 0],
        index=[3, 4],
        position=[5, 6],
        slot=[1, 2],
        expert_id=[3, 4],
        weight=[0.25, 0.75],
    )
    meta = msg.to_bytes()
    assert len(meta) == 32 + 2 * 56  # header + two RowMeta (cpp/meta.h)
    back = core.Message.from_bytes(meta, msg.data)
    for k, v in msg.meta().items():
        assert torch.equal(back.meta()[k], v), k
    with pytest.raises(ValueError, match="length"):
        core.Message.from_bytes(meta[:-1], msg.data)


@pytest.mark.timeout(60)
def test_receptor_thread_with_many_senders():
    """The same kind of stream, sent by three threads through the loopback hub to a started engine."""
    rng = random.Random(0)
    top_k, num_blocks = 2, 2
    complete = {}
    parts = []
    for req in range(200):
        block, start, length = rng.randint(1, num_blocks), rng.randint(0, 50), rng.choice([1, 1, 4])
        rows = []
        for pos in range(start, start + length):
            experts = rng.sample(range(4), top_k)
            slots = [(0, -1)] + [(s + 1, e) for s, e in enumerate(experts)]
            rows.append([(slot, e, len(parts) + i + 1) for i, (slot, e) in enumerate(slots)])
            parts += [(req, block, start, length, pos, slot, e, v) for slot, e, v in rows[-1]]
        complete[(req, block, start)] = rows
    rng.shuffle(parts)
    engine, hub = attention_engine(top_k, 4, num_blocks, attn_cap=16)
    shards = [parts[i::3] for i in range(3)]

    def send(shard):
        for lo in range(0, len(shard), 7):
            for msg in to_messages(shard[lo : lo + 7], []):
                hub.send(0, msg)

    want = sum(len(r) for r in complete.values())
    with engine:
        senders = [threading.Thread(target=send, args=(s,)) for s in shards]
        for t in senders:
            t.start()
        batches, got, deadline = [], 0, time.monotonic() + 30
        while got < want and time.monotonic() < deadline:
            if (b := engine.next_batch(timeout=0.1)) is not None:
                batches.append(b)
                got += len(b)
        for t in senders:
            t.join()
    assert got == want
    check_batches(batches, complete, top_k, 16)
    assert engine.next_batch(0) is None and not engine.running


def tracking_engine():
    placement = Placement(attn_runtime=(0,), expert_runtime=(1, 1))
    cfg = core.engine_config(
        0, placement, num_blocks=2, num_experts=2, top_k=1, hidden=H, track_requests=True
    )
    return core.Engine(cfg, core.LoopbackHub(2).communicator(0))


def parts(rid, block, position=3):
    """Both parts (residual, one expert output) of a one-row chunk of `rid` at ATTN (block, 0)."""
    kw = dict(request_id=[rid], kind=[core.ATTN], block=[block], index=[0], position=[position])
    return [
        core.make_message(torch.zeros(1, H), **kw),
        core.make_message(torch.zeros(1, H), slot=[1], expert_id=[1], weight=[1.0], **kw),
    ]


def test_a_tracking_rank_drops_rows_of_requests_it_does_not_hold():
    """Rows of a request that never entered here, or that finished, are dropped and counted, never queued; a
    request the rank holds goes through; forgetting one drops its waiting parts and queued chunks too."""
    engine = tracking_engine()
    for msg in parts(99, 1):  # never entered
        engine.ingest(msg)
    assert engine.stats()["dropped"]["unknown_request"] == 2 and engine.next_batch(0) is None
    one = torch.tensor([1])
    engine.add_tokens(torch.tensor([7]), torch.tensor([5]), torch.tensor([3]), torch.tensor([3]), one)
    batch = engine.next_batch(0)
    assert batch.request_ids.tolist() == [7] and engine.stats()["tracked_requests"] == 1
    with engine:  # block 0's output: the residual waits here, the expert output is expected
        zeros = torch.zeros(1, H)
        engine.submit_attention(batch, zeros, zeros, torch.tensor([[1]]), torch.tensor([[1.0]]))
        deadline = time.monotonic() + 10
        while engine.stats()["expected_parts"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.ingest(parts(7, 1)[1])  # the expert's answer
        assert engine.next_batch(5).layer == ("attn", 1, 0)
        engine.ingest(parts(7, 1)[1])  # a second answer nobody waits for
        assert engine.stats()["dropped"]["duplicate"] == 1
    first, second = parts(7, 2)  # the head's parts: one waits in the pool, then the request is forgotten
    engine.ingest(first)
    assert engine.stats()["pool_entries"] == 1
    engine.forget(torch.tensor([7]))
    stats = engine.stats()
    assert stats["pool_entries"] == 0 and stats["pool_parts"] == 0 and stats["tracked_requests"] == 0
    engine.ingest(second)  # a late part of a forgotten request
    assert engine.stats()["dropped"]["unknown_request"] == 3 and engine.next_batch(0) is None
    # A queued chunk is purged too, and the queue depth follows.
    engine.add_tokens(
        torch.tensor([8, 8]),
        torch.tensor([5, 6]),
        torch.tensor([0, 1]),
        torch.tensor([0, 0]),
        torch.tensor([2, 2]),
    )
    assert sum(engine.stats()["depth"].values()) == 2
    engine.forget(torch.tensor([8]))
    assert sum(engine.stats()["depth"].values()) == 0 and engine.next_batch(0) is None
