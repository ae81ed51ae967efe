"""The expert store: the one place that knows which routed experts are resident, in a fixed pool of slots of one
expert each, filled from the safetensors files by an I/O thread.

Threads: the compute thread (the local engine's, or an expert runtime's loop) asks for experts (`acquire` /
`release`, or `use`), says what a block will need (`expect`) and what the policy wants early (`hint`); one I/O
thread per link (here the disk: one) copies one expert at a time, on-demand misses first, then the block's expected
experts, then the policy's prefetches. An expert a running step holds (pinned) is never evicted, nor one a step
has been promised but not yet run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch

from amoe.errors import ConfigError, ModelLoadError
from amoe.model.moe import ExpertLayer
from amoe.model.spec import ModelConfig
from amoe.model.weights import ExpertWeights
from amoe.offload.io import CheckpointIndex, DiskReader, ExpertExtents
from amoe.offload.policy import Key, Policy

logger = logging.getLogger(__name__)

DEMAND, SOON, PREFETCH = 0, 1, 2  # why a copy is queued, most urgent first


class ExpertStore:
    """At most `num_slots` of `keys` resident; the rest read from disk when asked for."""

    def __init__(
        self,
        model_dir,
        cfg: ModelConfig,
        keys: Iterable[Key],
        num_slots: int,
        policy: Policy,
        dtype: torch.dtype,
        prefetch: bool = True,
        index: CheckpointIndex | None = None,
    ) -> None:
        self.keys = sorted(keys)
        if num_slots < 1:
            raise ConfigError("the expert store needs at least one slot")
        index = index or CheckpointIndex(model_dir)
        self._extents: dict[Key, ExpertExtents] = {k: index.expert(cfg, *k) for k in self.keys}
        width = {cfg.expert_intermediate(e) for _, e in self.keys}
        if len(width) != 1:
            raise ConfigError(f"offloaded experts must share one width; got {sorted(width)}")
        inter, hidden = width.pop(), cfg.hidden_size
        self.num_slots = min(num_slots, len(self.keys))
        self.policy = policy
        self.prefetch_enabled = prefetch
        # The pool, allocated once; pages are touched (become resident) as slots fill.
        self._gate_up = torch.empty(self.num_slots, 2 * inter, hidden, dtype=dtype)  # [S, 2I, H]
        self._down = torch.empty(self.num_slots, hidden, inter, dtype=dtype)  # [S, H, I]
        self.expert_bytes = (self._gate_up[0].numel() + self._down[0].numel()) * dtype.itemsize
        self.reader_buffer_bytes = DiskReader.buffer_bytes(
            self._extents.values(), dtype
        )  # at most, once grown
        self._layers = [
            ExpertLayer(-1, -1, ExpertWeights(self._gate_up[s], self._down[s])) for s in range(self.num_slots)
        ]
        # Everything below is guarded by _cond: the compute thread and the I/O thread both read and write it.
        self._cond = threading.Condition()
        self._slot_of: dict[Key, int] = {}  # resident
        self._loading: dict[Key, int] = {}  # being copied into that slot
        self._free = list(range(self.num_slots))
        self._pins: dict[Key, int] = {}  # held by a step (or waited for by one): never evicted
        self._expected: set[Key] = set()  # a running step will ask for these: not evicted by lesser copies
        self._queue: dict[int, deque[Key]] = {DEMAND: deque(), SOON: deque(), PREFETCH: deque()}
        self._unused_prefetch: set[Key] = set()  # copied ahead and not yet used (prefetch recall)
        self._errors: dict[Key, BaseException] = {}
        self._stopping = False
        self.counters = dict.fromkeys(
            ("hits", "misses", "loads", "evictions", "bytes_read", "prefetches", "prefetch_used"), 0
        )
        self.stall_s = 0.0
        self._reader = DiskReader()
        self._thread = threading.Thread(target=self._io_loop, name="amoe-offload-io", daemon=True)
        self._thread.start()

    # ---- the compute thread

    def acquire(self, key: Key) -> ExpertLayer:
        """Expert `key`'s layer, resident and pinned until `release(key)`; waits for its copy on a miss."""
        with self._cond:
            self._pins[key] = self._pins.get(key, 0) + 1
            self._expected.discard(key)
            if key in self._slot_of:
                self.counters["hits"] += 1
            else:
                self.counters["misses"] += 1
                if key not in self._loading:
                    self._errors.pop(key, None)  # an earlier failed copy ahead: this one tries again
                    self._enqueue(key, DEMAND)
                start = time.perf_counter()
                while key not in self._slot_of:
                    if key in self._errors:
                        self._pins[key] -= 1
                        raise ModelLoadError(f"expert {key}: {self._errors.pop(key)}")
                    self._cond.wait()
                self.stall_s += time.perf_counter() - start
            if key in self._unused_prefetch:
                self._unused_prefetch.discard(key)
                self.counters["prefetch_used"] += 1
            self.policy.used(key)
            return self._layers[self._slot_of[key]]

    def release(self, key: Key) -> None:
        with self._cond:
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                self._cond.notify_all()  # a copy may be waiting for a slot to become evictable

    @contextlib.contextmanager
    def use(self, key: Key) -> Iterator[ExpertLayer]:
        layer = self.acquire(key)
        try:
            yield layer
        finally:
            self.release(key)

    def expect(self, keys: Sequence[Key]) -> list[Key]:
        """A step will run `keys` now: the absent ones are queued (behind misses) so their copies overlap the
        resident ones' compute. Returns `keys` in the order to run them: resident first."""
        with self._cond:
            resident = [k for k in keys if k in self._slot_of]
            absent = [k for k in keys if k not in self._slot_of]
            self._expected.update(absent)
            if self.prefetch_enabled:
                for key in absent:
                    if key not in self._loading:
                        self._enqueue(key, SOON)
            return resident + absent

    def routed(self, block: int, seqs: Sequence[int], experts: Sequence[Sequence[int]], counts) -> None:
        """After block `block`'s router: seqs[i]'s tokens went to experts[i] (counts[i] each). Tells the policy,
        then queues what it wants early."""
        with self._cond:
            for seq, ex, n in zip(seqs, experts, counts):
                self.policy.routed(seq, block, ex, n)
            if not self.prefetch_enabled:
                return
            wanted = [k for k in self.policy.wanted(self.num_slots) if k in self._extents]
            # The policy's latest ranking replaces the earlier one (MoE-Infinity re-enqueues with new scores).
            self._queue[PREFETCH].clear()
            for key in wanted:
                if key not in self._slot_of and key not in self._loading:
                    self._queue[PREFETCH].append(key)
            self._cond.notify_all()

    def end(self, seq: int) -> None:
        with self._cond:
            self.policy.end(seq)

    def end_step(self) -> None:
        """The step is over: what it expected but never ran (it could not) is evictable again."""
        with self._cond:
            self._expected.clear()
            self._queue[SOON].clear()

    # ---- the I/O thread

    def _enqueue(self, key: Key, why: int) -> None:
        if key not in self._queue[why]:
            self._queue[why].append(key)
        self._cond.notify_all()

    def _next_job(self) -> tuple[Key, int] | None:
        for why in (DEMAND, SOON, PREFETCH):
            q = self._queue[why]
            while q:
                key = q.popleft()
                if key not in self._slot_of and key not in self._loading:
                    return key, why
        return None

    def _slot_for(self, key: Key, why: int) -> int | None:
        """A free slot, or the policy's victim among the evictable residents (None: none may go now, or the policy
        rates a copy ahead below what it would evict)."""
        if self._free:
            return self._free.pop()
        # A miss may evict anything not held (what a step expects later is read again); a copy ahead keeps what
        # the step expects and what was fetched ahead and not yet used (MoE-Infinity: prefetched outranks cached).
        protected = set() if why == DEMAND else self._expected | self._unused_prefetch
        candidates = [k for k in self._slot_of if k not in self._pins and k not in protected]
        if not candidates:
            return None
        victim = self.policy.victim(candidates)
        if why == PREFETCH and not self.policy.admits(key, victim):
            return None
        self.counters["evictions"] += 1
        self._unused_prefetch.discard(victim)
        return self._slot_of.pop(victim)

    def _io_loop(self) -> None:
        while True:
            with self._cond:
                job = slot = None
                while not self._stopping:
                    job = self._next_job()
                    if job is not None:
                        slot = self._slot_for(*job)
                        if slot is not None:
                            break
                        if job[1] == DEMAND:  # every slot is held: wait for a release, then try again
                            self._queue[DEMAND].appendleft(job[0])
                            self._cond.wait()
                        continue  # a copy ahead that finds no room is dropped
                    self._cond.wait()
                if self._stopping:
                    return
                key, why = job
                self._loading[key] = slot
            error = self._copy(key, slot)
            with self._cond:
                del self._loading[key]
                if error is None:
                    self._slot_of[key] = slot
                    self.counters["loads"] += 1
                    self.counters["bytes_read"] += self._extents[key].nbytes
                    if why != DEMAND and key not in self._pins:
                        self.counters["prefetches"] += 1
                        self._unused_prefetch.add(key)
                else:
                    self._free.append(slot)
                    self._errors[key] = error
                self._cond.notify_all()

    def _copy(self, key: Key, slot: int) -> BaseException | None:
        """Disk → slot, outside the lock (the reads release the GIL)."""
        ext = self._extents[key]
        try:
            gate_up, at, parts = self._gate_up[slot], 0, []
            for part in ext.gate_up:
                rows = part.shape[0]
                parts.append((part, gate_up[at : at + rows]))
                at += rows
            self._reader.read_all([*parts, (ext.down, self._down[slot])])
        except Exception as exc:  # noqa: BLE001 - the step that wanted it fails, not the I/O thread
            logger.exception("[offload] reading expert %s failed", key)
            return exc
        return None

    # ---- anyone

    def resident(self) -> list[Key]:
        with self._cond:
            return sorted(self._slot_of)

    def stats(self) -> dict:
        """A consistent snapshot of the counters (docs/metrics.md, amoe_offload_*)."""
        with self._cond:
            return {
                **self.counters,
                "stall_s": self.stall_s,
                "slots": self.num_slots,
                "resident": len(self._slot_of),
                "experts": len(self.keys),
                "expert_bytes": self.expert_bytes,
                "reader_buffer_bytes": self._reader.allocated_bytes(),
                "direct_io": self._reader.direct,
            }

    def unfilled_bytes(self) -> int:
        """The pool's slots never filled yet, and the reader's buffers not yet grown: memory planned, not resident."""
        with self._cond:
            filled = self.num_slots - len(self._free)  # a slot, once used, stays touched
        unfilled_buffers = self.reader_buffer_bytes - self._reader.allocated_bytes()
        return (self.num_slots - filled) * self.expert_bytes + unfilled_buffers

    def close(self) -> None:
        """Stop the I/O thread; idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(10.0)
        self._reader.close()


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def plan_slots(
    budget: int, dense_bytes: int, expert_bytes: int, num_keys: int, where: str, buffer_bytes: int = 0
) -> int | None:
    """Expert slots `budget` buys beside a process's dense part and its reader's buffers; None when every expert
    fits (no offloading: no reader either)."""
    if dense_bytes + num_keys * expert_bytes <= budget:
        logger.info(
            "[offload] %s: --offload-budget %s holds all %d experts (%s beside a dense part of %s): every expert "
            "stays resident, no offloading",
            where, format_size(budget), num_keys, format_size(num_keys * expert_bytes), format_size(dense_bytes),
        )  # fmt: skip
        return None
    minimum = dense_bytes + buffer_bytes + expert_bytes
    if budget < minimum:
        reader = f" + the reader's buffers {format_size(buffer_bytes)}" if buffer_bytes else ""
        raise ConfigError(
            f"--offload-budget {format_size(budget)} is below the minimum for {where}: {minimum} bytes "
            f"({format_size(minimum)} = dense part {format_size(dense_bytes)}{reader} + one expert "
            f"{format_size(expert_bytes)})"
        )
    return (budget - dense_bytes - buffer_bytes) // expert_bytes


def reader_bytes(index: CheckpointIndex, cfg: ModelConfig, keys: Sequence[Key], dtype) -> int:
    """What the store's reader holds for its buffers reading `keys` into slots of `dtype` (counted in the budget)."""
    return DiskReader.buffer_bytes((index.expert(cfg, *k) for k in keys), dtype)


def open_store(
    offload, model_dir, cfg: ModelConfig, keys: Sequence[Key], dense_bytes: int, dtype, where: str
):
    """The store `offload` (config.OffloadSection) asks for over `keys`, or None when its budget holds them all
    (or offloading is off)."""
    if offload.budget is None or not keys:
        return None
    expert_bytes = routed_expert_bytes(cfg, dtype)
    index = CheckpointIndex(model_dir)
    buffers = reader_bytes(index, cfg, keys, dtype)
    slots = plan_slots(offload.budget_bytes, dense_bytes, expert_bytes, len(keys), where, buffers)
    if slots is None:
        return None
    policy = make_store_policy(offload, cfg)
    store = ExpertStore(model_dir, cfg, keys, slots, policy, dtype, prefetch=offload.prefetch, index=index)
    logger.info(
        "[offload] %s: %d of %d experts resident at most (budget %s holds the dense part %s, %d slots of %s and the "
        "reader's buffers %s; policy %s; %s reads)",
        where, slots, len(keys), format_size(offload.budget_bytes), format_size(dense_bytes), slots,
        format_size(expert_bytes), format_size(buffers), policy.name,
        "O_DIRECT" if store.stats()["direct_io"] else "buffered+fadvise",
    )  # fmt: skip
    return store


def make_store_policy(offload, cfg: ModelConfig) -> Policy:
    """The policy by name; a bad EAMC file is a one-line start-up error naming it."""
    from amoe.offload.choose import make_policy

    try:
        return make_policy(offload.policy, cfg.num_blocks, cfg.num_experts, offload.eamc)
    except ConfigError as exc:
        if offload.eamc is None or str(exc).startswith("--offload"):
            raise
        raise ConfigError(f"--offload-eamc {offload.eamc}: {exc}") from None


def routed_expert_bytes(cfg: ModelConfig, dtype) -> int:
    """One routed expert's weights in `dtype` (they share one width)."""
    from amoe.model import weights as W

    shapes = W.expert_shapes(cfg, 0, 0)
    return sum(_numel(s) for s in shapes.values()) * dtype.itemsize


def dense_bytes(cfg: ModelConfig, dtype, attention: bool, shared: Iterable[int] = ()) -> int:
    """What a process holds besides its routed experts: (attention) embedding, every layer's attention side, final
    norm and lm_head; and the shared experts `shared` (ids >= num_experts) of every block."""
    from amoe.model import weights as W

    total = 0
    if attention:
        total += _numel((cfg.vocab_size, cfg.hidden_size)) * (1 if cfg.tie_word_embeddings else 2)
        total += cfg.hidden_size  # final norm
        total += sum(
            _numel(s) for layer in range(cfg.num_layers) for s in W.layer_shapes(cfg, layer).values()
        )
    total += sum(
        _numel(s) for b in range(cfg.num_blocks) for e in shared for s in W.expert_shapes(cfg, b, e).values()
    )
    return total * dtype.itemsize


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
