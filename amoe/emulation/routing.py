"""The routing override for benchmarks (AMoE §5): `model | uniform | skew-exp[:λ]`, seeded.

The paper replaces Mixtral's router with one that "randomly selects experts based on the profiled exponential
distribution" fitted to Dolly. We draw each row's top-k experts without replacement from a popularity
p ∝ exp(−λ · rank). Which expert holds which rank is a seeded random permutation per block, fixed for the run:
the skew is persistent (§2.1: "some experts are consistently favored") and differs between blocks (Figure 4a
shows per-layer skew), so in AEP a GPU hosting expert e is hot in some blocks and cold in others.

Default λ = 0.4. The paper publishes no λ; 0.4 gives the hottest expert ~1/3 of the top-1 choices, and these
hottest/mean load ratios (exact for top-1, 10^6-row Monte Carlo otherwise; `hottest_to_mean`):

    experts  top-k  hottest/mean   EP stall 1 - mean/hottest (one expert per GPU)
       8       1       2.75          64 %
       8       2       2.44          59 %
      16       1       5.28          81 %
      16       2       4.70          79 %

Figure 4b reports EP stalls "up to 70 %" of GPU time for Mixtral's top-2 router, i.e. a per-iteration ratio ~3.3:
the expected 2.44 plus the sampling noise of one iteration's batch. λ is per rank, so with 16 experts the hottest
still takes ~1/3 of the tokens: doubling EP GPUs cannot relieve it, which is what §5.2 saw for SGLang.
For fine-grained models pass a smaller λ (e.g. λ · 8 / E keeps the 8-expert shape over normalised rank).

Draws are keyed by (seed, block, row key) when row keys are given, so the same request token gets the same experts
whatever order the runtimes execute in: EP and AEP runs of one seed see identical routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amoe.errors import ConfigError

ROUTING_MODES = ("model", "uniform", "skew-exp")
DEFAULT_LAMBDA = 0.4
# hottest/mean at DEFAULT_LAMBDA, (num_experts, top_k) -> ratio; the module docstring's table.
DEFAULT_HOTTEST_TO_MEAN = {(8, 1): 2.75, (8, 2): 2.44, (16, 1): 5.28, (16, 2): 4.70}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: consecutive inputs land far apart


@dataclass(frozen=True)
class RoutingSpec:
    """A parsed `--routing` value."""

    mode: str = "model"
    lam: float = DEFAULT_LAMBDA

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ConfigError(f"routing must be one of model, uniform, skew-exp[:λ]; got {self.mode!r}")
        if not (np.isfinite(self.lam) and self.lam >= 0):
            raise ConfigError(f"skew-exp λ must be a finite number >= 0; got {self.lam}")

    @classmethod
    def parse(cls, text: str) -> RoutingSpec:
        """`model`, `uniform`, `skew-exp` or `skew-exp:0.6`."""
        mode, sep, arg = text.strip().partition(":")
        if not sep:
            return cls(mode)
        if mode != "skew-exp":
            raise ConfigError(f"only skew-exp takes a parameter; got {text!r}")
        try:
            return cls(mode, float(arg))
        except ValueError:
            raise ConfigError(f"skew-exp λ must be a number; got {arg!r}") from None

    @property
    def is_override(self) -> bool:
        return self.mode != "model"

    def __str__(self) -> str:
        return f"skew-exp:{self.lam:g}" if self.mode == "skew-exp" else self.mode


def popularity_by_rank(num_experts: int, lam: float) -> np.ndarray:
    """p[r] ∝ exp(−λ r), r = 0 is the hottest; sums to 1."""
    p = np.exp(-lam * np.arange(num_experts, dtype=np.float64))
    return p / p.sum()


def hottest_to_mean(num_experts: int, top_k: int, lam: float, rows: int = 1_000_000, seed: int = 0) -> float:
    """Expected load of the hottest expert over the mean load (exact for top-1, Monte Carlo otherwise)."""
    p = popularity_by_rank(num_experts, lam)
    if top_k == 1:
        return float(num_experts * p[0])
    ids = _gumbel_top_k(np.log(p), np.random.default_rng(seed).gumbel(size=(rows, num_experts)), top_k)
    counts = np.bincount(ids.ravel(), minlength=num_experts)
    return float(counts.max() / counts.mean())


def row_keys(request_ids, positions) -> np.ndarray:
    """One uint64 key per row from (request id, position) arrays (numpy, or CPU tensors): what a token's routing
    draw is keyed by."""
    rid = np.asarray(request_ids).astype(np.uint64)
    pos = np.asarray(positions).astype(np.uint64)
    return _splitmix64(rid) ^ pos


class RouterOverride:
    """Seeded expert choice for `uniform` or `skew-exp`: route(block, n) → (topk_ids [n, K], topk_weights [n, K])."""

    def __init__(
        self, spec: RoutingSpec, num_experts: int, top_k: int, num_blocks: int, seed: int = 0
    ) -> None:
        if not spec.is_override:
            raise ConfigError("routing 'model' uses the model's own router; nothing to override")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"top_k must be in [1, {num_experts}]; got {top_k}")
        self.spec, self.num_experts, self.top_k = spec, num_experts, top_k
        self.seed = seed
        self._rng = np.random.default_rng([seed, 1])  # the unkeyed stream
        lam = spec.lam if spec.mode == "skew-exp" else 0.0
        by_rank = popularity_by_rank(num_experts, lam)
        perm_rng = np.random.default_rng([seed, 0])
        self.hot_order = [perm_rng.permutation(num_experts) for _ in range(num_blocks)]  # [B][rank] -> expert
        self.popularity = np.empty((num_blocks, num_experts))  # [B, E] by expert id
        for b, order in enumerate(self.hot_order):
            self.popularity[b, order] = by_rank
        self._log_p = np.log(self.popularity)

    def route(self, block: int, n: int, keys: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k experts of n rows, drawn without replacement by popularity; weights are the chosen experts'
        popularities renormalised (they sum to 1). With `keys` [n] the draw depends only on (seed, block, key)."""
        noise = self._gumbel_noise(block, n, keys)  # [n, E]
        ids = _gumbel_top_k(self._log_p[block], noise, self.top_k)  # [n, K]
        w = self.popularity[block][ids]
        return ids.astype(np.int64), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)

    def _gumbel_noise(self, block: int, n: int, keys: np.ndarray | None) -> np.ndarray:
        if keys is None:
            return self._rng.gumbel(size=(n, self.num_experts))
        base = _splitmix64(
            np.asarray(keys, dtype=np.uint64) ^ _splitmix64(np.uint64(self.seed) + np.uint64(block))
        )
        per_expert = _splitmix64(
            base[:, None] + _GOLDEN * np.arange(1, self.num_experts + 1, dtype=np.uint64)
        )
        uniform = ((per_expert >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # (0, 1)
        return -np.log(-np.log(uniform))


def _gumbel_top_k(log_p: np.ndarray, noise: np.ndarray, k: int) -> np.ndarray:
    """Gumbel-top-k: the k largest log p + Gumbel noise are a draw of k experts without replacement ∝ p,
    in draw order (hottest key first)."""
    keys = log_p + noise  # [n, E]
    top = np.argpartition(-keys, k - 1, axis=1)[:, :k] if k < keys.shape[1] else np.argsort(-keys, axis=1)
    order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1)


def _splitmix64(x: np.ndarray | np.uint64) -> np.ndarray:
    """A stateless 64-bit mixer (Steele et al., SplitMix64): uint64 arithmetic wraps modulo 2^64 on purpose."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
