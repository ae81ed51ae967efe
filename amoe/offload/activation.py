"""The activation-aware policy of MoE-Infinity (arXiv 2401.14361 §5–6): prefetch by the nearest past sequence,
evict by the current ones.

After each block's router (`routed`), the sequence's EAM is updated and the EAMC entry nearest it is found (Eq. (1),
over the blocks reached so far). Every expert of every later block is then queued with the priority of Algorithm 1,
(p + ε) · (1 − block / L), where p is that block's activation ratio in the nearest entry: likely experts first, near
blocks before far ones. The experts the router just picked are queued at MAX_PRIORITY: if they are not resident they
are on-demand misses, which jump the queue (Algorithm 1 step 11). A sequence's queue is replaced at every block
(the paper's continuous refinement) and never reaches past the last block into the next step.

Eviction (`victim`) ranks resident experts the same way (Algorithm 2): (ratio + ε) · (1 − block / L), the ratio
taken from the EAM of the sequences running now, so experts reused within a sequence and experts of early blocks
(which prefetching covers poorly) stay. Prefetched experts — the ones the nearest entry predicts for later blocks —
outrank every merely cached one (§6.2), and an on-demand one outranks them all.

Concurrent sequences: each has its own EAM and queue; the queue a store sees is their union with each key's highest
priority, and eviction uses the ratios of their summed EAM. Finished sequences refine the EAMC (eam.Refiner).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from amoe.errors import ConfigError
from amoe.offload.eam import DEFAULT_SIZE, EAMC, Refiner, unit_rows
from amoe.offload.policy import Key, Policy

logger = logging.getLogger(__name__)

# The paper gives no value: small enough not to reorder experts with any observed activation (a ratio is at least
# 1 / tokens), large enough that zero-ratio experts are still ordered by block.
EPSILON = 1e-4
PREFETCH_TIER = 2.0  # added to a queued expert's priority when ranking evictions: above any cached-only score
MAX_PRIORITY = 4.0  # an expert the running step needs now: above every queued and cached score


class _SeqState:
    """One running sequence: its EAM, its queue, and the running sums of the nearest-entry search."""

    def __init__(self, num_blocks: int, num_experts: int, num_entries: int) -> None:
        self.eam = np.zeros((num_blocks, num_experts))  # [L, E] tokens routed so far
        self.queue = np.zeros((num_blocks, num_experts))  # [L, E] priority; 0 = not queued
        self.block_cos = np.zeros((num_blocks, num_entries))  # [L, P] per-block cosine to each entry
        self.cos_sum = np.zeros(num_entries)  # [P] Σ over seen blocks
        self.seen = np.zeros(num_blocks, dtype=bool)
        self.eamc_version = -1


class ActivationPolicy(Policy):
    """MoE-Infinity's activation-aware prefetching and caching over an EAMC (`eamc_path`, or learnt online)."""

    name = "activation"

    def __init__(
        self,
        num_blocks: int,
        num_experts: int,
        eamc_path: str | None = None,
        *,
        eamc: EAMC | None = None,
        refine: bool = True,
        refiner: Refiner | None = None,
        history: bool = False,
    ) -> None:
        self.num_blocks, self.num_experts = num_blocks, num_experts
        if eamc is None:
            eamc = (
                EAMC.load(eamc_path, num_blocks, num_experts)
                if eamc_path
                else EAMC.empty(num_blocks, num_experts)
            )
        elif (eamc.num_blocks, eamc.num_experts) != (num_blocks, num_experts):
            raise ConfigError(
                f"EAMC entries are ({eamc.num_blocks}, {eamc.num_experts}) (blocks, experts); "
                f"the model needs ({num_blocks}, {num_experts})"
            )
        self.eamc = eamc
        self._version = 0
        self.refiner = (refiner or Refiner(capacity=max(DEFAULT_SIZE, len(eamc)))) if refine else None
        self._seqs: dict[int, _SeqState] = {}
        self.history = history
        if history:
            self.name = "activation+history"
        # (1 − block / L) per block: the linear decay of Algorithm 1 step 26 and Algorithm 2 step 8.
        self.decay = 1.0 - np.arange(num_blocks) / num_blocks  # [L]
        self.predictions = 0
        self.distance_sum = 0.0
        logger.info("[offload] activation-aware policy: EAMC of %d entries, refine=%s", len(eamc), refine)

    # -- what the store tells the policy
    def routed(self, seq: int, block: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        state = self._seqs.get(seq)
        if state is None:
            state = self._seqs[seq] = _SeqState(self.num_blocks, self.num_experts, len(self.eamc))
        experts = np.asarray(experts, dtype=np.int64)
        np.add.at(state.eam[block], experts, np.asarray(counts, dtype=np.float64))
        state.queue[:] = 0.0
        state.queue[block, experts] = MAX_PRIORITY
        nearest = self._nearest(state, block)
        if nearest >= 0 and block + 1 < self.num_blocks:
            ratios = self.eamc.ratios[nearest, block + 1 :]  # [L-b-1, E] predicted activation ratios
            state.queue[block + 1 :] = (ratios + EPSILON) * self.decay[block + 1 :, None]

    def used(self, key: Key) -> None:
        for state in self._seqs.values():
            if state.queue[key] >= MAX_PRIORITY:
                state.queue[key] = 0.0  # the on-demand request is served

    def end(self, seq: int) -> None:
        state = self._seqs.pop(seq, None)
        if state is None or self.refiner is None:
            return
        refined = self.refiner.observe(self.eamc, state.eam.astype(np.float32))
        if refined is not self.eamc:
            self.eamc, self._version = refined, self._version + 1

    # -- what the store asks
    def priorities(self) -> np.ndarray:
        """[L, E] the score `victim` ranks by: on-demand > queued (PREFETCH_TIER + queue priority) > cached."""
        eam = sum((s.eam for s in self._seqs.values()), np.zeros((self.num_blocks, self.num_experts)))
        totals = eam.sum(axis=1, keepdims=True)
        ratios = np.divide(eam, totals, out=np.zeros_like(eam), where=totals > 0)
        if self.history and len(self.eamc):
            # amoe's variant: between sequences Algorithm 2 knows nothing; let the EAMC's mean ratios (what past
            # sequences used) rank the experts the running ones have not used.
            ratios = ratios + self.eamc.ratios.mean(axis=0)
        score = (ratios + EPSILON) * self.decay[:, None]
        queue = self._merged_queue()
        # Only experts the nearest entry predicts (ratio > 0) count as prefetched: the ε-priority rest of the queue
        # is there to order copies when the link has time, not to pin every later block in the cache.
        # "Prefetched" (§6.2) is read as "predicted by the nearest entry": the paper's system always prefetches
        # them, so a demand-paging replay ranks them as its cache would (docs/offload.md compares the other reading).
        likely = self._predicted(queue)
        return np.where(queue >= MAX_PRIORITY, MAX_PRIORITY, np.where(likely, PREFETCH_TIER + queue, score))

    def _predicted(self, queue: np.ndarray) -> np.ndarray:
        """[L, E] queued above the ε floor: predicted by the nearest entry, or needed now."""
        return queue > EPSILON * self.decay[:, None] * (1.0 + 1e-9)

    def victim(self, resident: Iterable[Key]) -> Key:
        keys = list(resident)
        index = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
        score = self.priorities()[index[:, 0], index[:, 1]]
        # Ties (equal scores) go to the later block, then the higher expert id: deterministic, and a later block
        # is the one prefetching can still cover.
        order = np.lexsort((-index[:, 1], -index[:, 0], score))
        return keys[int(order[0])]

    def admits(self, key: Key, victim: Key) -> bool:
        """A prefetch evicts only an expert ranked below it: §6.2 aligns the cache's priority with the prefetch
        priority (both (ratio + ε) · (1 − block / L)), so a far, unlikely prediction does not push out an expert
        the running sequences reuse."""
        return bool(self._merged_queue()[key] > self.priorities()[victim])

    def wanted(self, limit: int) -> list[Key]:
        # Only what the nearest entry predicts (and on-demand experts): an ε-priority expert is worth ordering but
        # not worth evicting a cached one for (replaying with every later expert queued, more bandwidth lowered
        # the hit ratio: the link filled the cache with experts no entry predicted).
        queue = self._merged_queue()
        queue = np.where(self._predicted(queue), queue, 0.0).ravel()
        limit = min(limit, int(np.count_nonzero(queue)))
        if limit <= 0:
            return []
        top = np.argpartition(-queue, limit - 1)[:limit]
        # Highest priority first; equal priorities in block then expert order (the order the model runs them).
        top = top[np.lexsort((top, -queue[top]))]
        return [(int(i) // self.num_experts, int(i) % self.num_experts) for i in top]

    def stats(self) -> dict:
        return {
            "eamc_entries": len(self.eamc),
            "eamc_rebuilds": self.refiner.rebuilds if self.refiner else 0,
            "predictions": self.predictions,
            "mean_distance": self.distance_sum / self.predictions if self.predictions else None,
        }

    # -- internals
    def _merged_queue(self) -> np.ndarray:
        if not self._seqs:
            return np.zeros((self.num_blocks, self.num_experts))
        return np.max(np.stack([s.queue for s in self._seqs.values()]), axis=0)

    def _nearest(self, state: _SeqState, block: int) -> int:
        """The EAMC entry nearest the sequence's EAM, updating only `block`'s cosines (its row is what changed)."""
        if not len(self.eamc):
            return -1
        if state.eamc_version != self._version or state.block_cos.shape[1] != len(self.eamc):
            units = unit_rows(state.eam)  # [L, E]
            state.seen = units.any(axis=1)
            state.block_cos = np.einsum("ple,le->lp", self.eamc.units, units)  # [L, P]
            state.cos_sum = state.block_cos[state.seen].sum(axis=0)
            state.eamc_version = self._version
        else:
            row = state.eam[block]
            unit = row / np.linalg.norm(row)
            new = self.eamc.units[:, block, :] @ unit  # [P]
            state.cos_sum += new - state.block_cos[block]
            state.block_cos[block] = new
            state.seen[block] = True
        best = int(np.argmax(state.cos_sum))
        self.predictions += 1
        self.distance_sum += 1.0 - state.cos_sum[best] / max(int(state.seen.sum()), 1)
        return best
