"""The barrier all-to-all of the synchronous modes (cpp/exchange.h via amoe/runtime/sync/moe.py) over in-process
inboxes: every routed row comes back to the slot it left from, through tag-framed messages; a peer's silence, a
message without a tag row, a duplicate or an expert failure never hangs or crashes the exchange."""

from __future__ import annotations

import threading

import pytest
import torch

from amoe import core
from amoe.errors import EngineDeadError
from amoe.runtime.sync.exchange import BEGIN, COMBINE, DISPATCH
from amoe.runtime.sync.moe import Routed, receive_combine, send_dispatch, serve_experts
from amoe.runtime.sync.stats import SyncStats

H = 6


class ScaleByExpert:
    """An expert executor whose expert e multiplies its rows by e + 1 (so a row sent to the wrong expert, or
    returned to the wrong slot, changes the result)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[tuple[int, int]] = []  # (expert, rows) per run
        self.fail_on = fail_on

    def run(self, batch) -> torch.Tensor:
        if batch.index == self.fail_on:
            raise RuntimeError(f"expert {batch.index} broke")
        self.batches.append((batch.index, batch.x.shape[0]))
        return batch.x * (batch.index + 1)

    def run_grouped(self, batches) -> list[torch.Tensor]:
        return [self.run(b) for b in batches]


def _routed(n: int, k: int, num_experts: int, seed: int, dtype=torch.float32) -> Routed:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]) if n else None
    ids = ids if ids is not None else torch.zeros(0, k, dtype=torch.int64)
    return Routed(
        torch.randn(n, H, generator=g).to(dtype),
        ids,
        torch.rand(n, k, generator=g),
        torch.arange(n) + 100,
        torch.arange(n),
    )


def _exchanges(num: int, expert_device, timeout_s: float = 2.0):
    hub = core.LoopbackHub(num)
    devices = sorted(set(expert_device))
    return hub, [
        core.BarrierExchange(hub.communicator(d), d, timeout_s, list(expert_device), devices)
        for d in range(num)
    ]


def _all_to_all(
    rows_per_device: list[int], expert_device: tuple[int, ...], k: int, executors=None, dtype=torch.float32
):
    """One dispatch → experts → combine round on every device, sequentially (the inboxes buffer the messages)."""
    devices = list(range(len(rows_per_device)))
    _, exs = _exchanges(len(devices), expert_device)
    executors = executors or [ScaleByExpert() for _ in devices]
    routed = [_routed(n, k, len(expert_device), seed=d, dtype=dtype) for d, n in enumerate(rows_per_device)]
    plans = [send_dispatch(exs[d], 7, 2, 0, routed[d]) for d in devices]
    stats = [SyncStats(4, len(expert_device)) for _ in devices]
    for d in devices:
        serve_experts(exs[d], 7, 2, 0, devices, executors[d], stats[d])
    outs = [receive_combine(exs[d], plans[d], stats[d]) for d in devices]
    return routed, outs, executors, exs, stats


@pytest.mark.parametrize(
    ("rows", "expert_device", "k"),
    [
        ([5, 3, 0, 4], (0, 1, 2, 3), 1),  # EP: one expert per device, one device with no rows this iteration
        ([6, 2], (0, 1, 0, 1), 2),  # two experts per device, top-2
        ([9, 7, 8], (0, 1, 2, 0, 1, 2, 0, 1), 3),  # uneven: three devices, eight experts, top-3
    ],
)
def test_every_row_returns_to_its_slot_with_its_experts_output(rows, expert_device, k):
    routed, outs, executors, exs, stats = _all_to_all(rows, expert_device, k)
    for r, out in zip(routed, outs):
        assert out.shape == (r.moe_input.shape[0], k, H)
        expected = r.moe_input[:, None, :] * (r.topk_ids[:, :, None] + 1).to(r.moe_input.dtype)
        torch.testing.assert_close(out, expected)
    for d, ex in enumerate(executors):
        hosted = {e for e, dev in enumerate(expert_device) if dev == d}
        assert {e for e, _ in ex.batches} <= hosted  # a device only runs the experts it hosts
        assert len(ex.batches) == len({e for e, _ in ex.batches})  # each expert once per all-to-all
    # every routed copy ran exactly once, and the stats counted it where it ran
    sent = torch.bincount(torch.cat([r.topk_ids.reshape(-1) for r in routed]), minlength=len(expert_device))
    ran = sum(torch.tensor(s.snapshot()["expert_rows"])[2] for s in stats)
    assert ran.tolist() == sent.tolist()
    assert all(ex.dropped == 0 for ex in exs)


def test_expert_rows_carry_their_request_position_and_weight():
    seen = []

    class Recorder(ScaleByExpert):
        def run(self, batch):
            seen.append(
                (batch.index, batch.request_ids.tolist(), batch.positions.tolist(), batch.weights.tolist())
            )
            return super().run(batch)

    routed, outs, *_ = _all_to_all([4], (0, 0), 2, executors=[Recorder()])
    r = routed[0]
    for expert, rids, pos, weights in seen:
        rows, ks = (r.topk_ids == expert).nonzero(as_tuple=True)
        assert rids == (r.request_ids[rows]).tolist() and pos == r.positions[rows].tolist()
        torch.testing.assert_close(torch.tensor(weights), r.topk_weights[rows, ks])


def test_bfloat16_payloads_keep_their_dtype():
    routed, outs, *_ = _all_to_all([3, 2], (0, 1), 1, dtype=torch.bfloat16)
    for r, out in zip(routed, outs):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(
            out, r.moe_input[:, None, :] * (r.topk_ids[:, :, None] + 1).to(torch.bfloat16)
        )


def test_an_expert_that_raises_fails_every_sources_rows_but_completes_the_barrier():
    # device 1 hosts expert 1, which raises: both sources hear "failed" from it (rows sent there or not)
    routed, outs, *_ = _all_to_all([4, 4], (0, 1), 1, executors=[ScaleByExpert(), ScaleByExpert(fail_on=1)])
    assert any(bool((r.topk_ids == 1).any()) for r in routed)
    assert outs == [None, None]


def test_a_row_for_an_expert_the_device_does_not_host_fails_instead_of_crashing():
    hub, (ex0, ex1) = _exchanges(2, (0, 1))
    # Runtime 0 claims to dispatch expert 0 rows to runtime 1 (a corrupt peer): a DISPATCH tag row + one payload row.
    head = dict(
        request_id=[3, 1],
        kind=[core.EXPERT, core.EXPERT],
        block=[0, 0],
        index=[0, 0],
        position=[0, 0],
        chunk_start=[0, 0],
        chunk_len=[0, 1],
        slot=[DISPATCH, 1],
        expert_id=[-1, 0],
        attn_rank=[0, 0],
    )
    hub.communicator(0).send(1, core.make_message(torch.zeros(2, H), **head))
    ex1.signal(1, 3, 0, DISPATCH, 0)  # its own (empty) part
    serve_experts(ex1, 3, 0, 0, [0, 1], ScaleByExpert(), SyncStats(1, 2))
    got = ex0.gather_info(3, 0, COMBINE, 0, [1])
    assert got[1][1] & core._core.EXPERTS_FAILED


def test_a_silent_peer_raises_engine_dead_naming_it():
    _, (ex0, _ex1, _ex2) = _exchanges(3, (0, 1, 2), timeout_s=0.3)
    with pytest.raises(EngineDeadError, match=r"peer\(s\) \[1, 2\]"):
        ex0.begin(0, [0, 1, 2], 5, False)


def test_a_message_without_a_tag_row_is_dropped_and_counted():
    hub, (_, ex) = _exchanges(2, (0, 1), timeout_s=0.2)
    bad = core.make_message(torch.zeros(2, H), request_id=[1, 2], kind=[0, 0], block=[0, 0], index=[0, 0],
                            position=[0, 0])  # fmt: skip
    hub.communicator(0).send(1, bad)
    with pytest.raises(EngineDeadError, match=r"peer\(s\) \[0\]"):
        ex.gather_info(0, 0, DISPATCH, 0, [0])
    assert ex.dropped == 1 and "without a tag row" in ex.last_drop


def test_a_duplicate_is_dropped_and_a_later_tag_waits_for_its_gather():
    _, (ex0, ex1) = _exchanges(2, (0, 1))
    ex0.signal(1, 4, 0, BEGIN, info=3)
    ex0.signal(1, 4, 0, BEGIN, info=9)  # duplicate of the same tag
    ex0.signal(1, 5, 0, BEGIN, info=7)  # the next iteration's, early
    ex1.signal(1, 4, 0, BEGIN, info=1)
    assert ex1.gather_info(4, 0, BEGIN, 0, [0, 1]) == {0: (3, 0), 1: (1, 0)}
    assert ex1.dropped == 1 and "duplicate" in ex1.last_drop
    ex1.signal(1, 5, 0, BEGIN, info=2, flags=1)
    assert ex1.gather_info(5, 0, BEGIN, 0, [0, 1]) == {0: (7, 0), 1: (2, 1)}


def test_begin_sums_every_devices_rows_and_spreads_a_stop():
    _, exs = _exchanges(3, (0, 1, 2))
    results = {}

    def begin(d: int, rows: int, stop: bool) -> None:
        results[d] = exs[d].begin(0, [0, 1, 2], rows, stop)

    threads = [
        threading.Thread(target=begin, args=args) for args in ((0, 1, False), (1, 2, True), (2, 3, False))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == {0: (6, True), 1: (6, True), 2: (6, True)}
