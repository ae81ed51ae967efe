"""The barrier all-to-all of the synchronous modes (amoe/runtime/sync/exchange.py, moe.py) over in-process
inboxes: every routed row comes back to the slot it left from, through tag-framed messages."""

from __future__ import annotations

import pytest
import torch

from amoe import core
from amoe.errors import EngineDeadError
from amoe.runtime.sync.exchange import COMBINE, DISPATCH, Exchanger, Tag, frame
from amoe.runtime.sync.moe import DispatchPlan, Routed, receive_combine, send_dispatch, serve_experts
from amoe.runtime.sync.stats import SyncStats

H = 6


class ScaleByExpert:
    """An expert executor whose expert e multiplies its rows by e + 1 (so a row sent to the wrong expert, or
    returned to the wrong slot, changes the result)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []  # (expert, rows) per run

    def run(self, batch) -> torch.Tensor:
        self.batches.append((batch.index, batch.x.shape[0]))
        return batch.x * (batch.index + 1)

    def run_grouped(self, batches) -> list[torch.Tensor]:
        return [self.run(b) for b in batches]


def _routed(n: int, k: int, num_experts: int, seed: int) -> Routed:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]) if n else None
    ids = ids if ids is not None else torch.zeros(0, k, dtype=torch.int64)
    return Routed(
        torch.randn(n, H, generator=g),
        ids,
        torch.full((n, k), 1.0 / k),
        torch.arange(n) + 100,
        torch.arange(n),
    )


def _all_to_all(rows_per_device: list[int], expert_device: tuple[int, ...], k: int):
    """One dispatch → experts → combine round on every device, sequentially (the inboxes buffer the messages)."""
    devices = list(range(len(rows_per_device)))
    hub = core.LoopbackHub(len(devices))
    exs = [Exchanger(hub.communicator(d), d, timeout_s=2.0) for d in devices]
    executors = [ScaleByExpert() for _ in devices]
    routed = [_routed(n, k, len(expert_device), seed=d) for d, n in enumerate(rows_per_device)]
    plans = [DispatchPlan(r.topk_ids, expert_device, devices) for r in routed]
    tag = Tag(7, 2, DISPATCH)
    for d in devices:
        send_dispatch(exs[d], tag, routed[d], plans[d])
    for d in devices:
        serve_experts(exs[d], tag, devices, executors[d], H, SyncStats(4, len(expert_device)))
    back = Tag(7, 2, COMBINE)
    outs = [receive_combine(exs[d], back, plans[d], routed[d].moe_input, SyncStats(4, 8)) for d in devices]
    return routed, outs, executors, exs


@pytest.mark.parametrize(
    ("rows", "expert_device", "k"),
    [
        ([5, 3, 0, 4], (0, 1, 2, 3), 1),  # EP: one expert per device, one device with no rows this iteration
        ([6, 2], (0, 1, 0, 1), 2),  # two experts per device, top-2
    ],
)
def test_every_row_returns_to_its_slot_with_its_experts_output(rows, expert_device, k):
    routed, outs, executors, exs = _all_to_all(rows, expert_device, k)
    for r, out in zip(routed, outs):
        assert out.shape == (r.moe_input.shape[0], k, H)
        expected = r.moe_input[:, None, :] * (r.topk_ids[:, :, None] + 1).to(r.moe_input.dtype)
        torch.testing.assert_close(out, expected)
    for d, ex in enumerate(executors):
        hosted = {e for e, dev in enumerate(expert_device) if dev == d}
        assert {e for e, _ in ex.batches} <= hosted  # a device only runs the experts it hosts
        assert len(ex.batches) == len({e for e, _ in ex.batches})  # each expert once per all-to-all
    assert all(ex.num_dropped == 0 for ex in exs)


def test_a_message_without_a_tag_row_is_dropped_and_counted():
    hub = core.LoopbackHub(2)
    ex = Exchanger(hub.communicator(1), 1, timeout_s=0.2)
    bad = core.make_message(torch.zeros(2, H), request_id=[1, 2], kind=[0, 0], block=[0, 0], index=[0, 0],
                            position=[0, 0])  # fmt: skip
    hub.communicator(0).send(1, bad)
    with pytest.raises(EngineDeadError, match=r"peer\(s\) \[0\]"):
        ex.gather(Tag(0, 0, DISPATCH), [0])
    assert ex.num_dropped == 1


def test_framed_body_keeps_row_zero_for_the_tag_and_the_payload_after_it():
    payload = torch.arange(12, dtype=torch.bfloat16).reshape(2, H)
    body = frame(2, payload)
    body[1:] = payload
    hub = core.LoopbackHub(2)
    sender, receiver = Exchanger(hub.communicator(0), 0), Exchanger(hub.communicator(1), 1)
    sender.send(1, Tag(3, 1, COMBINE), framed=body, info=5)
    parcel = receiver.gather(Tag(3, 1, COMBINE), [0])[0]
    assert parcel.info == 5 and parcel.data.dtype == torch.bfloat16
    torch.testing.assert_close(parcel.data, payload)
