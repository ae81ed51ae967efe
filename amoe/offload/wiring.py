"""What a process that runs experts adds for offloading: its store (or none), its routing recorder (or none), and
the few calls the model runner and the expert executor make — after a block's router, for a block's experts, at
a step's end and a sequence's end. With neither a budget nor a record file every call is a no-op."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from amoe.errors import ConfigError
from amoe.offload.policy import Policy
from amoe.offload.record import RoutingRecorder, chunk_routing
from amoe.offload.store import ExpertStore, dense_bytes, open_store

logger = logging.getLogger(__name__)

# An expert runtime never hears that a sequence ended (the attention rank knows); it ends the policy's state of
# the sequences it has not seen for longest once it tracks this many.
MAX_TRACKED_SEQS = 4096


class Offload:
    """A process's offloading parts; `store` None means every routed expert is resident the usual way."""

    def __init__(
        self, store: ExpertStore | None = None, recorder: RoutingRecorder | None = None, num_experts: int = 0
    ) -> None:
        self.store = store
        self.num_experts = num_experts  # routed experts per block (ids at and above are shared experts)
        self.recorder = recorder
        policy = store.policy if store is not None else None
        # LRU and LFU ignore routing: skip building it per chunk for them.
        self._policy_routes = policy is not None and type(policy).routed is not Policy.routed
        self._seen: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def local(cls, offload, model_dir, cfg, dtype: torch.dtype, device) -> Offload:
        """The single-process engine's: it holds the dense part and every expert (config.OffloadSection)."""
        if offload is None:
            return cls()
        store = None
        if offload.budget is not None:
            _check_device(device)
            keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
            dense = dense_bytes(cfg, dtype, attention=True, shared=range(cfg.num_experts, cfg.num_expert_ids))
            store = open_store(offload, model_dir, cfg, keys, dense, dtype, "this process")
        return cls(store, _recorder(offload, cfg, model_dir), cfg.num_experts)

    @classmethod
    def expert_runtime(cls, offload, model_dir, cfg, experts, dtype: torch.dtype, device) -> Offload:
        """An expert runtime's: its experts of every block; its dense part is the shared experts it hosts."""
        if offload is None or offload.budget is None:
            return cls()
        _check_device(device)
        routed = [e for e in experts if e < cfg.num_experts]
        keys = [(b, e) for b in range(cfg.num_blocks) for e in routed]
        dense = dense_bytes(cfg, dtype, attention=False, shared=[e for e in experts if e >= cfg.num_experts])
        store = open_store(
            offload, model_dir, cfg, keys, dense, dtype, f"the expert runtime of experts {experts}"
        )
        return cls(store, num_experts=cfg.num_experts)

    @classmethod
    def attention_rank(cls, offload, model_dir, cfg, rank: int, num_ranks: int) -> Offload:
        """An attention rank records routing (its router runs there); rank r of several writes FILE.rank<r>."""
        if offload is None or offload.record is None:
            return cls()
        path = offload.record if num_ranks == 1 else f"{offload.record}.rank{rank}"
        recorder = RoutingRecorder(path, cfg.num_blocks, cfg.num_experts, _model_name(model_dir))
        return cls(recorder=recorder, num_experts=cfg.num_experts)

    # ---- hooks

    def routed(self, block: int, seqs: list[int], topk_ids: torch.Tensor, cu_rows: torch.Tensor) -> None:
        """After block `block`'s router: chunk r (rows cu_rows[r]:cu_rows[r+1]) of sequence seqs[r] went to
        topk_ids [N, K]."""
        if self.recorder is None and not self._policy_routes:
            return
        routing = chunk_routing(topk_ids, cu_rows, self.num_experts)
        if self.recorder is not None:
            self.recorder.add(block, seqs, routing)
        if self.store is not None:
            self.store.routed(block, seqs, [r[0] for r in routing], [r[1] for r in routing])

    def end_step(self) -> None:
        if self.store is not None:
            self.store.end_step()

    def end(self, seq: int) -> None:
        """Sequence `seq` finished (or was aborted)."""
        if self.recorder is not None:
            self.recorder.end(seq)
        if self.store is not None:
            self.store.end(seq)

    def run_experts(
        self, block: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bounds: list[int]
    ) -> None:
        """Routed expert e's rows x[bounds[e]:bounds[e+1]] (weights w) into the same rows of out."""
        spans = {e: (bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1) if bounds[e] < bounds[e + 1]}
        self.run_spans(block, x, w, out, spans)

    def run_spans(self, block: int, x, w, out, spans: dict[int, tuple[int, int]]) -> None:
        """Each expert of `spans` on its rows, resident ones first while the others' copies come in."""
        store = self.store
        for block_expert in store.expect([(block, e) for e in spans]):
            lo, hi = spans[block_expert[1]]
            with store.use(block_expert) as layer:
                out[lo:hi] = layer(x[lo:hi], w[lo:hi])  # [n, H]

    def routed_on_expert_side(self, block: int, experts: list[int], seq_rows: list[list[int]]) -> None:
        """An expert runtime's view of the routing: of its experts, which sequences' rows came (seq_rows[g] the
        sequence id of each row of experts[g])."""
        store = self.store
        if store is None or not self._policy_routes:
            return
        per_seq: dict[int, dict[int, int]] = {}
        for e, rows in zip(experts, seq_rows):
            for seq in rows:
                counts = per_seq.setdefault(seq, {})
                counts[e] = counts.get(e, 0) + 1
        seqs = list(per_seq)
        store.routed(
            block, seqs, [list(c) for c in per_seq.values()], [list(c.values()) for c in per_seq.values()]
        )
        for seq in seqs:
            self._seen[seq] = None
            self._seen.move_to_end(seq)
        while len(self._seen) > MAX_TRACKED_SEQS:
            store.end(self._seen.popitem(last=False)[0])

    def stats(self) -> dict | None:
        return self.store.stats() if self.store is not None else None

    def unfilled_bytes(self) -> int:
        """Memory the store has set aside and not yet touched (its slots fill as experts are read): what sizing the
        KV cache from free memory must leave for it."""
        return self.store.unfilled_bytes() if self.store is not None else 0

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.recorder is not None:
            self.recorder.close()


def check_offload(config, model_dir) -> None:
    """Before anything loads or starts: every process that would host experts gets a budget above its minimum,
    and the policy builds (an EAMC file of the wrong shape fails here, with both shapes)."""
    from amoe.device import CPU, model_dtype
    from amoe.model.config import load_model_config
    from amoe.offload.io import CheckpointIndex
    from amoe.offload.store import make_store_policy, plan_slots, reader_bytes, routed_expert_bytes
    from amoe.placement import Placement

    offload = config.offload
    if offload.budget is None or config.executor.kind != "torch":
        return
    cfg = load_model_config(model_dir)
    dtype = model_dtype(config.model.dtype, cfg.dtype, CPU)
    expert = routed_expert_bytes(cfg, dtype)
    if config.parallel.mode == "local":
        hosts = {"this process": (list(range(cfg.num_expert_ids)), True)}
    else:
        placement = Placement.of(config.parallel, cfg.num_expert_ids)
        hosts = {
            f"the expert runtime of experts {placement.experts_of(r)}": (placement.experts_of(r), False)
            for r in sorted(set(placement.expert_runtime))
        }
    index = CheckpointIndex(model_dir)
    for where, (experts, attention) in hosts.items():
        shared = [e for e in experts if e >= cfg.num_experts]
        keys = [(b, e) for b in range(cfg.num_blocks) for e in experts if e < cfg.num_experts]
        dense = dense_bytes(cfg, dtype, attention=attention, shared=shared)
        buffers = reader_bytes(index, cfg, keys, dtype) if keys else 0
        plan_slots(offload.budget_bytes, dense, expert, len(keys), where, buffers)
    make_store_policy(offload, cfg)  # built once and dropped: its errors (a bad EAMC file) surface here


def _recorder(offload, cfg, model_dir) -> RoutingRecorder | None:
    if offload.record is None:
        return None
    return RoutingRecorder(offload.record, cfg.num_blocks, cfg.num_experts, _model_name(model_dir))


def _model_name(model_dir) -> str:
    return Path(model_dir).name


def _check_device(device) -> None:
    if device.torch.type != "cpu":
        raise ConfigError(
            f"--offload-budget keeps experts in this host's memory and reads them from disk: it runs with "
            f"--device cpu (got {device.torch.type})"
        )
