"""Expert activation matrices (MoE-Infinity, arXiv 2401.14361 §4): one per sequence, a small collection of them.

An EAM is a [blocks, experts] matrix of token counts: cell (l, e) is how many of a sequence's tokens (prompt and
generated) block l routed to expert e. The distance between two is the paper's Eq. (1): one minus the mean over
blocks of the cosine similarity of their rows. The EAMC is P ≪ N of them chosen by K-Means under that distance,
keeping per cluster the member nearest its centroid (§4.2), and rebuilt from the sequences it predicted badly
(§4.3 "Handling distribution shift").

Two choices the paper leaves open, made here:
- A row that is all zeros (a block the sequence has not reached yet) has no direction; the distance of a partial EAM
  is the mean over the blocks it has reached only, and 1 when it has reached none.
- K-Means under Eq. (1) is spherical K-Means on the concatenation of the unit-normalised rows: for such vectors
  u, v the dot product is Σ_l cos_l, so the Eq. (1) distance is 1 − u·v / L and the mean direction per block is
  the centroid that minimises it.

Files are npz without pickle (`np.load(allow_pickle=False)`): a `matrices` array [P, L, E] and a `format` string.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

FORMAT = "amoe-eamc/1"
DEFAULT_SIZE = 200  # §8.5: gains saturate at 100–110 entries; 300 fit the paper's 1.8 MB budget
KMEANS_ITERS = 20
# Rebuild after this many badly predicted sequences: §8.5 reruns the construction after 100 new sequences.
REBUILD_EVERY = 100
# A finished sequence whose EAM is farther than this from its nearest entry was predicted badly (§4.3 records
# "input sequences with insufficient performance"); 0.5 means on average the rows' directions differ by 60°.
POOR_DISTANCE = 0.5


def unit_rows(m: np.ndarray) -> np.ndarray:
    """Each row (the last axis) scaled to unit length; zero rows stay zero. [..., L, E] -> [..., L, E]."""
    m = np.asarray(m, dtype=np.float64)
    norm = np.linalg.norm(m, axis=-1, keepdims=True)
    return np.divide(m, norm, out=np.zeros_like(m), where=norm > 0)


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """Eq. (1) between two EAMs [L, E], over the blocks where both have activations (1 if there are none)."""
    ua, ub = unit_rows(a), unit_rows(b)
    seen = (ua.any(axis=-1)) & (ub.any(axis=-1))
    if not seen.any():
        return 1.0
    return float(1.0 - (ua[seen] * ub[seen]).sum(axis=-1).mean())


class EAMC:
    """A collection of EAMs [P, L, E] and the nearest-entry search the prefetcher runs after every router."""

    def __init__(self, matrices: np.ndarray, num_blocks: int, num_experts: int) -> None:
        matrices = np.asarray(matrices, dtype=np.float32)
        if matrices.ndim == 2 and matrices.size == 0:
            matrices = matrices.reshape(0, num_blocks, num_experts)
        if matrices.ndim != 3 or matrices.shape[1:] != (num_blocks, num_experts):
            raise ConfigError(
                f"EAMC entries are {tuple(matrices.shape[1:]) if matrices.ndim == 3 else matrices.shape} "
                f"(blocks, experts); the model needs ({num_blocks}, {num_experts})"
            )
        self.num_blocks, self.num_experts = num_blocks, num_experts
        self.matrices = matrices  # [P, L, E] token counts
        self.units = unit_rows(matrices).astype(np.float32)  # [P, L, E]
        sums = matrices.sum(axis=-1, keepdims=True)
        self.ratios = np.divide(matrices, sums, out=np.zeros_like(matrices), where=sums > 0)  # [P, L, E]

    def __len__(self) -> int:
        return self.matrices.shape[0]

    @classmethod
    def empty(cls, num_blocks: int, num_experts: int) -> EAMC:
        return cls(np.zeros((0, num_blocks, num_experts), dtype=np.float32), num_blocks, num_experts)

    def nearest(self, eam: np.ndarray) -> tuple[int, float]:
        """(index, Eq. (1) distance) of the entry nearest a (possibly partial) EAM [L, E]; (-1, 1.0) if empty."""
        if not len(self):
            return -1, 1.0
        u = unit_rows(eam)
        seen = u.any(axis=-1)
        if not seen.any():
            return 0, 1.0
        cos = np.einsum("ple,le->p", self.units[:, seen], u[seen])  # [P] sum of per-block cosines
        best = int(np.argmax(cos))
        return best, float(1.0 - cos[best] / seen.sum())

    @classmethod
    def build(cls, eams: np.ndarray, size: int = DEFAULT_SIZE, seed: int = 0) -> EAMC:
        """K-Means (K = size) under Eq. (1) over `eams` [N, L, E]; keeps each cluster's member nearest its centroid.
        With N <= size every EAM is kept."""
        eams = np.asarray(eams, dtype=np.float64)
        if eams.ndim != 3:
            raise ConfigError(f"EAMs must be [sequences, blocks, experts]; got shape {eams.shape}")
        if size < 1:
            raise ConfigError(f"EAMC size must be >= 1; got {size}")
        n, num_blocks, num_experts = eams.shape
        if n <= size:
            return cls(eams, num_blocks, num_experts)
        x = unit_rows(eams).reshape(n, -1)  # [N, L*E]: dot products are sums of per-block cosines
        rng = np.random.default_rng(seed)
        centroids = _kmeans_pp(x, size, rng)
        for _ in range(KMEANS_ITERS):
            assign = np.argmax(x @ centroids.T, axis=1)  # nearest = largest Σ cos
            moved = _centroids(x, assign, size, num_blocks, num_experts)
            empty = ~np.bincount(assign, minlength=size).astype(bool)
            moved[empty] = centroids[empty]  # an empty cluster keeps its centroid
            if np.allclose(moved, centroids):
                break
            centroids = moved
        assign = np.argmax(x @ centroids.T, axis=1)
        keep = []
        for c in range(size):
            members = np.flatnonzero(assign == c)
            if members.size:
                keep.append(members[np.argmax(x[members] @ centroids[c])])
        return cls(eams[np.array(sorted(keep))], num_blocks, num_experts)

    def save(self, path: str | Path) -> None:
        """npz: `matrices` [P, L, E] float32 and `format`; loadable without pickle."""
        with open(path, "wb") as f:  # np.savez on a path would append .npz
            np.savez(f, matrices=self.matrices, format=np.array(FORMAT))

    @classmethod
    def load(cls, path: str | Path, num_blocks: int, num_experts: int) -> EAMC:
        """An EAMC saved by `save` (or `amoe offload build-eamc`) for a model of num_blocks × num_experts."""
        try:
            with np.load(path, allow_pickle=False) as data:
                fmt = str(data["format"]) if "format" in data.files else ""
                matrices = data["matrices"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot read EAMC {path}: {exc}") from None
        if fmt != FORMAT:
            raise ConfigError(f"{path} is not an EAMC file (format {fmt!r}, expected {FORMAT!r})")
        if matrices.ndim != 3 or matrices.shape[1:] != (num_blocks, num_experts):
            raise ConfigError(
                f"EAMC {path} has entries of shape {tuple(matrices.shape[1:])} (blocks, experts); "
                f"the model needs ({num_blocks}, {num_experts})"
            )
        return cls(matrices, num_blocks, num_experts)


class Refiner:
    """The online update of §4.3: collect finished sequences the EAMC predicted badly, and rebuild the EAMC from its
    entries plus them every `rebuild_every` such sequences (§8.5 rebuilds after 100). An EAMC below its capacity
    takes every finished sequence, so a server started without one learns its first entries from traffic."""

    def __init__(
        self,
        capacity: int = DEFAULT_SIZE,
        rebuild_every: int = REBUILD_EVERY,
        poor_distance: float = POOR_DISTANCE,
        seed: int = 0,
    ) -> None:
        self.capacity, self.rebuild_every, self.poor_distance = capacity, rebuild_every, poor_distance
        self.pending: list[np.ndarray] = []
        self.rebuilds = 0
        self._seed = seed

    def observe(self, eamc: EAMC, eam: np.ndarray) -> EAMC:
        """The EAMC after a sequence with EAM `eam` finished (the same object when nothing changed)."""
        if not np.any(eam):
            return eamc
        if len(eamc) < self.capacity:
            return EAMC(np.concatenate([eamc.matrices, eam[None]]), eamc.num_blocks, eamc.num_experts)
        _, d = eamc.nearest(eam)
        if d <= self.poor_distance:
            return eamc
        self.pending.append(np.asarray(eam, dtype=np.float32))
        if len(self.pending) < self.rebuild_every:
            return eamc
        pool = np.concatenate([eamc.matrices, np.stack(self.pending)])
        self.pending.clear()
        self.rebuilds += 1
        logger.info("[offload] EAMC rebuilt from %d entries (rebuild %d)", len(pool), self.rebuilds)
        return EAMC.build(pool, self.capacity, seed=self._seed + self.rebuilds)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding under the cosine distance: each next centroid drawn ∝ its distance to the nearest chosen."""
    n = x.shape[0]
    chosen = [int(rng.integers(n))]
    best = x @ x[chosen[0]]  # [N] largest similarity to a chosen centroid so far
    scale = max(float(np.max(np.einsum("ij,ij->i", x, x))), 1e-12)
    for _ in range(1, k):
        weight = np.clip(scale - best, 0.0, None)
        total = weight.sum()
        nxt = int(rng.choice(n, p=weight / total)) if total > 0 else int(rng.integers(n))
        chosen.append(nxt)
        best = np.maximum(best, x @ x[nxt])
    return x[chosen].copy()


def _centroids(x: np.ndarray, assign: np.ndarray, k: int, num_blocks: int, num_experts: int) -> np.ndarray:
    """Per cluster the mean of its members, each block's part renormalised to unit length (spherical K-Means)."""
    sums = np.zeros((k, x.shape[1]))
    np.add.at(sums, assign, x)
    return unit_rows(sums.reshape(k, num_blocks, num_experts)).reshape(k, -1)
