"""One device of a synchronous mode: an attention DP rank, a set of experts, or both (EP).

Requests enter and leave exactly as on an AEP attention runtime: `add_request` / `abort` (any thread) go to the
attention rank's requests, whose prompts and sampled tokens land in the device's `TokenInbox` until the next
iteration admits them; each head step's HeadOutput goes back up to the loop, which publishes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from amoe.model.config import ModelConfig
from amoe.runtime.requests import HeadOutput, RankRequest
from amoe.runtime.sync.batch import Chunk, LayerBatch, TokenInbox
from amoe.runtime.sync.stats import SyncStats, gpu_clock
from amoe.sampling_params import SamplingParams


class SyncDevice:
    """A runtime of `--parallel ep|pingpong`: its executors, its inbox and its stats.

    `attention` is an AttentionExecutor (torch or emulated compute); `experts` runs the experts this device hosts
    (`expert_device[e] == rank`). Either may be None (pingpong), not both. `attn_devices` / `expert_devices`: the
    ranks that run attention / host experts (in EP both are every rank).
    """

    def __init__(
        self,
        rank: int,
        cfg: ModelConfig,
        expert_device: tuple[int, ...],
        *,
        attn_devices: tuple[int, ...],
        expert_devices: tuple[int, ...],
        attention=None,
        experts=None,
        attn_rank: int = 0,
        max_batch_rows: int | None = None,
    ) -> None:
        if attention is None and experts is None:
            raise ValueError("a device needs an attention executor, experts, or both")
        self.rank, self.cfg, self.expert_device = rank, cfg, tuple(expert_device)
        self.attn_devices, self.expert_devices = tuple(attn_devices), tuple(expert_devices)
        self.all_devices = tuple(sorted(set(self.attn_devices) | set(self.expert_devices)))
        self.attention, self.experts = attention, experts
        self.inbox = TokenInbox() if attention is not None else None
        self.attn_rank = attn_rank
        self.max_batch_rows = max_batch_rows
        self.hosted_experts = [e for e, d in enumerate(self.expert_device) if d == rank]
        self.stats = SyncStats(cfg.num_blocks, cfg.num_expert_ids, gpu_clock(attention, experts))
        self._failures: list[HeadOutput] = []  # loop thread only
        self.iteration_rows = 0  # the current iteration's rows on all devices (the BEGIN barrier's total)
        # Physical expert slots (amoe.runtime.sync.slots) when the placement can change; None: expert ids are slots.
        self.slots = None
        self.rebalancer = None  # amoe.runtime.sync.rebalance.StopTheWorld when it rebalances; None: never

    @property
    def role(self) -> str:
        if self.attention is not None and self.experts is not None:
            return "ep"
        return "attention" if self.attention is not None else "expert"

    # Requests: what the control plane asks of any runtime.

    def add_request(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        num_generated: int = 0,
        seq_ids: Sequence[int] = (),
    ) -> RankRequest:
        """Bind a request to this device's attention rank; it joins at the next iteration. Any thread."""
        req, rows = self.attention.requests.add(request_id, prompt, params, num_generated, seq_ids)
        self.inbox.add(rows)
        return req

    def abort(self, request_id: int) -> bool:
        return self.attention.requests.abort(request_id)

    # Steps of an iteration, run by the loops in ep.py / pingpong.py.

    def admit(self) -> list[Chunk]:
        """The chunks that join this iteration (none on an expert-only device)."""
        if self.attention is None:
            return []
        return self.inbox.admit(self.attention.requests.blocks, self.max_batch_rows)

    def attend(self, batch: LayerBatch) -> tuple[torch.Tensor, ...] | None:
        """attention(batch.block) → (residual, moe_input, topk_ids, topk_weights); None if the layer failed: the
        executor has ended the batch's requests (freeing their KV), and their end waits in `take_failures`."""
        with self.stats.busy():
            out = self.attention.run(batch)
        if isinstance(out, HeadOutput):  # AttentionExecutor.run's answer for a batch whose layer raised
            self._failures.append(out)
            return None
        return out

    def fail(self, batch: LayerBatch, error: str) -> None:
        """End the batch's requests (an expert device failed on their rows); their end waits in take_failures."""
        rids = batch.request_ids[batch.cu_rows[:-1]].tolist()  # [R] one per chunk
        self._failures.append(self.attention.requests.fail(rids, error))

    def take_failures(self) -> list[HeadOutput]:
        """The ends of the requests whose batches failed since the last call, to be published."""
        failures, self._failures = self._failures, []
        return failures

    def head(self, batch: LayerBatch) -> HeadOutput:
        """Final merge, norm, lm_head and sampling; the tokens that go on wait in the inbox for the next
        iteration, the HeadOutput goes back to the loop to be published."""
        with self.stats.busy():
            out = self.attention.run(batch)
        self.inbox.add(out.next)
        return out
