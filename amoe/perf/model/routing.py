"""The routing override for benchmarks (AMoE §5): `model | uniform | skew-exp[:λ][,rho=ρ][,shift=T][,drift=N]`,
seeded.

The paper replaces Mixtral's router with one that "randomly selects experts based on the profiled exponential
distribution" fitted to Dolly. We draw each row's top-k experts without replacement from a popularity
p ∝ exp(−λ · rank). Which expert holds which rank is a seeded random permutation per block: the skew persists
(§2.1: "some experts are consistently favored") and differs between blocks (Figure 4a shows per-layer skew), so in
AEP a GPU hosting expert e is hot in some blocks and cold in others.

**Default λ = 0.08, from measured routing.** The OLMoE paper (Muennighoff et al. 2024, arXiv 2409.02060, §5 and
its routing analysis) publishes Mixtral-8x7B's expert counts on five domains (arXiv, GitHub, Wikipedia, books, C4;
raw counts in the allenai/OLMoE repository, scripts/routing_output/mistral, layers 0, 7 and 15). Their hottest
expert over the mean is 1.16–1.58 for the first choice, i.e. λ ≈ 0.04–0.15 under this exponential shape (median
≈ 0.08), and 1.08–1.33 counting both of the top-2 choices; the hottest expert differs by domain. λ = 0.4 (hottest
2.75× the mean) is twice the largest measured skew: it stays available as the stress case (`skew-exp:0.4`).

    λ      experts  top-k  hottest/mean (top-1 exact; top-2 exact inclusion, `hottest_to_mean`)
    0.04      8       1       1.15
    0.08      8       1       1.30
    0.08      8       2       1.27
    0.15      8       1       1.60
    0.08     16       1       1.70
    0.40      8       1       2.75   (stress)
    0.40      8       2       2.44   (stress)
    0.40     16       1       5.28   (stress)

**Request affinity ρ** (`rho=`): the Mixtral paper (Jiang et al. 2024, arXiv 2401.04088 §5, routing analysis)
notes that consecutive tokens of a sequence are often routed to the same expert, which independent per-token draws
miss and which makes one iteration's batch more skewed than the corpus average. With `rho=ρ` a request keeps its
previous token's experts with probability ρ (per block), else draws afresh: the corpus popularity is unchanged, runs
of one expert are 1/(1−ρ) tokens long on average. Default 0.

**Shifting skew** (`shift=T`): which expert is hot is re-drawn every T seconds of emulated time, as the mix of
domains in the traffic changes (the hottest expert differs by domain). Default: never.

**Drifting traffic** (`drift=N`): requests with an id of N or more come from another mix of domains, so their
tokens draw from the next skew epoch's popularity (the same λ, another seeded permutation of which experts are
hot): a hot set that moves when new traffic arrives, at the same moment in every mode and on every rank, since a
request's id is the same everywhere. Default: never. The drift benchmark (`amoe bench drift`) is built on it.

Draws are keyed by (seed, block, request, position), so the same token gets the same experts whatever order the
runtimes execute in: EP and AEP runs of one seed see identical routing (a shifting skew follows each runtime's own
emulated clock, so runs agree on it only statistically).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amoe.errors import ConfigError
from amoe.perf.model.models import ModelProfile

ROUTING_MODES = ("model", "uniform", "skew-exp")
DEFAULT_LAMBDA = 0.08  # the median of Mixtral-8x7B's measured first-choice skew (module docstring)
STRESS_LAMBDA = 0.4  # twice the largest measured skew
# λ values of the skew sweep (docs/cost-model.md): the measured range and the stress case.
LAMBDA_SWEEP = (0.02, 0.04, 0.08, 0.15, 0.25, 0.4)
# hottest/mean, (λ, num_experts, top_k) -> ratio; the module docstring's table.
HOTTEST_TO_MEAN = {
    (0.04, 8, 1): 1.15, (0.08, 8, 1): 1.30, (0.08, 8, 2): 1.27, (0.15, 8, 1): 1.60, (0.08, 16, 1): 1.70,
    (0.4, 8, 1): 2.75, (0.4, 8, 2): 2.44, (0.4, 16, 1): 5.28,
}  # fmt: skip
AFFINITY_WALK = (
    64  # a token looks back at most this many positions for the draw it keeps (ρ^64 is negligible)
)

_OPTIONS = {"rho": "rho", "shift": "shift_s", "drift": "drift_id"}  # option -> RoutingSpec field
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: consecutive inputs land far apart


@dataclass(frozen=True)
class RoutingSpec:
    """A parsed `--routing` value."""

    mode: str = "model"
    lam: float = DEFAULT_LAMBDA
    rho: float = 0.0  # request affinity: P(a token keeps its previous token's experts)
    shift_s: float | None = None  # emulated seconds between re-draws of which experts are hot; None: never
    drift_id: int | None = None  # requests from this id on draw from the next skew epoch; None: never

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ConfigError(
                f"routing must be one of model, uniform, skew-exp[:λ][,rho=ρ][,shift=T]; got {self.mode!r}"
            )
        if not (np.isfinite(self.lam) and self.lam >= 0):
            raise ConfigError(f"skew-exp λ must be a finite number >= 0; got {self.lam}")
        if not 0.0 <= self.rho < 1.0:
            raise ConfigError(f"routing rho (request affinity) must be in [0, 1); got {self.rho}")
        if self.shift_s is not None and not (np.isfinite(self.shift_s) and self.shift_s > 0):
            raise ConfigError(f"routing shift (seconds) must be positive; got {self.shift_s}")
        if self.drift_id is not None and not (self.drift_id == int(self.drift_id) and self.drift_id >= 0):
            raise ConfigError(f"routing drift (a request id) must be an integer >= 0; got {self.drift_id}")
        if self.drift_id is not None:
            object.__setattr__(self, "drift_id", int(self.drift_id))  # parsed as a number; kept as an id

    @classmethod
    def parse(cls, text: str) -> RoutingSpec:
        """`model`, `uniform`, `skew-exp`, `skew-exp:0.6`, `skew-exp:0.08,rho=0.5,shift=2`, `skew-exp,drift=1000`
        (`uniform,rho=0.5`)."""
        head, *options = [part.strip() for part in text.strip().split(",")]
        mode, sep, arg = head.partition(":")
        if sep and mode != "skew-exp":
            raise ConfigError(f"only skew-exp takes a λ; got {text!r}")
        if options and mode == "model":
            raise ConfigError(f"routing 'model' takes no options; got {text!r}")
        values: dict = {}
        try:
            if sep:
                values["lam"] = float(arg)
            for option in options:
                key, eq, value = option.partition("=")
                if not eq or key not in _OPTIONS:
                    raise ConfigError(
                        f"routing options are rho=ρ, shift=T (seconds) and drift=N (a request id); got {option!r} "
                        f"in {text!r}"
                    )
                values[_OPTIONS[key]] = float(value)
        except ValueError:
            raise ConfigError(f"routing parameters must be numbers; got {text!r}") from None
        return cls(mode, **values)

    @property
    def is_override(self) -> bool:
        return self.mode != "model"

    def __str__(self) -> str:
        text = f"skew-exp:{self.lam:g}" if self.mode == "skew-exp" else self.mode
        if self.rho:
            text += f",rho={self.rho:g}"
        if self.shift_s is not None:
            text += f",shift={self.shift_s:g}"
        if self.drift_id is not None:
            text += f",drift={int(self.drift_id)}"
        return text


def popularity_by_rank(num_experts: int, lam: float) -> np.ndarray:
    """p[r] ∝ exp(−λ r), r = 0 is the hottest; sums to 1."""
    p = np.exp(-lam * np.arange(num_experts, dtype=np.float64))
    return p / p.sum()


def hottest_to_mean(num_experts: int, top_k: int, lam: float) -> float:
    """Expected load of the hottest expert over the mean load: the hottest's probability of being among a row's
    top_k picks over the mean, top_k / num_experts (exact, `inclusion_probabilities`)."""
    q = inclusion_probabilities(popularity_by_rank(num_experts, lam), top_k)
    return float(q.max() * num_experts / top_k)


# Exact inclusion probabilities enumerate ordered draws: E · (E-1) · ... (k terms); above this, Monte Carlo.
_EXACT_LIMIT = 2_000_000


def inclusion_probabilities(popularity: np.ndarray, top_k: int, seed: int = 0) -> np.ndarray:
    """q[..., e]: the probability that expert e is among a row's `top_k` experts drawn without replacement ∝
    `popularity` (the last axis), which is what loads an expert. Not popularity · k: the hottest expert cannot be
    picked twice, so q_e < k p_e for hot experts and > k p_e for cold ones; Σ_e q_e = k. Exact by enumerating the
    ordered draws while that is cheap (every Mixtral-style model), a 200 000-row Gumbel-top-k sample otherwise."""
    p = np.asarray(popularity, dtype=np.float64)
    if p.ndim > 1:
        return np.stack([inclusion_probabilities(row, top_k, seed) for row in p])
    e = p.shape[0]
    if top_k >= e:
        return np.ones(e)
    if np.prod(np.arange(e, e - top_k + 1, -1, dtype=np.float64)) <= _EXACT_LIMIT:
        q = np.zeros(e)
        _accumulate(p / p.sum(), np.ones(e, dtype=bool), 1.0, top_k, q)
        return q
    if np.all(p == p[0]):  # even routing: every expert is in a row's top-k with probability k / E, exactly
        return np.full(e, top_k / e)
    rng = np.random.default_rng(seed)
    ids = _gumbel_top_k(np.log(p), rng.gumbel(size=(200_000, e)), top_k)
    return np.bincount(ids.ravel(), minlength=e) / 200_000


def _accumulate(p: np.ndarray, left: np.ndarray, mass: float, draws: int, q: np.ndarray) -> None:
    """Adds to q the probability of every expert still `left` being drawn in the next `draws` draws, given the
    draws so far happened with probability `mass`."""
    total = p[left].sum()
    for e in np.flatnonzero(left):
        chance = mass * p[e] / total
        q[e] += chance
        if draws > 1:
            left[e] = False
            _accumulate(p, left, chance, draws - 1, q)
            left[e] = True


def row_keys(request_ids, positions) -> np.ndarray:
    """One uint64 key per row from (request id, position) arrays (numpy, or CPU tensors): what a token's routing
    draw is keyed by."""
    rid = np.asarray(request_ids).astype(np.uint64)
    pos = np.asarray(positions).astype(np.uint64)
    return _splitmix64(rid) ^ pos


class RouterOverride:
    """Seeded expert choice for `uniform` or `skew-exp`: route(block, n) → (topk_ids [n, K], topk_weights [n, K]);
    with `num_shared` shared experts, every row also goes to ids num_experts.. (weight 1): [n, K + num_shared]."""

    def __init__(
        self,
        spec: RoutingSpec,
        num_experts: int,
        top_k: int,
        num_blocks: int,
        seed: int = 0,
        num_shared: int = 0,
    ) -> None:
        if not spec.is_override:
            raise ConfigError("routing 'model' uses the model's own router; nothing to override")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"top_k must be in [1, {num_experts}]; got {top_k}")
        self.spec, self.num_experts, self.top_k, self.num_blocks = spec, num_experts, top_k, num_blocks
        self.seed, self.num_shared = seed, num_shared
        self._rng = np.random.default_rng([seed, 1])  # the unkeyed stream
        lam = spec.lam if spec.mode == "skew-exp" else 0.0
        self._by_rank = popularity_by_rank(num_experts, lam)
        self._epochs: dict[int, np.ndarray] = {}  # skew epoch -> popularity [B, E]
        self.popularity = self.popularity_at(0)  # [B, E] by expert id, before any shift
        self.hot_order = [np.argsort(-row, kind="stable") for row in self.popularity]  # [B][rank] -> expert

    def popularity_at(self, epoch: int) -> np.ndarray:
        """[B, E] popularity by expert id in skew epoch `epoch` (0 unless the skew shifts): a seeded permutation of
        the ranks per block, drawn afresh per epoch."""
        if epoch not in self._epochs:
            perm_rng = np.random.default_rng([self.seed, 0] if epoch == 0 else [self.seed, 0, epoch])
            table = np.empty((self.num_blocks, self.num_experts))
            for b in range(self.num_blocks):
                table[b, perm_rng.permutation(self.num_experts)] = self._by_rank
            self._epochs = {epoch: table, **dict(list(self._epochs.items())[-3:])}  # a few epochs stay cached
        return self._epochs[epoch]

    def inclusion_at(self, epoch: int = 0) -> np.ndarray:
        """[B, E] inclusion probabilities (`inclusion_probabilities`) in skew epoch `epoch`. Every block's
        popularity is a permutation of one by-rank vector, so where the probabilities are sampled (DeepSeek-V3's
        256 experts: 51 M Gumbel keys a row) they are sampled once by rank and permuted to each block, not once per
        block (58x the work: most of a minute for the planner's bounds). Exact ones keep their per-block
        computation."""
        table = self.popularity_at(epoch)
        e, k = self.num_experts, self.top_k
        if k >= e or np.prod(np.arange(e, e - k + 1, -1, dtype=np.float64)) <= _EXACT_LIMIT:
            return inclusion_probabilities(table, k)
        by_rank = inclusion_probabilities(self._by_rank, k, seed=epoch)
        rank_of = np.argsort(np.argsort(-table, axis=1, kind="stable"), axis=1, kind="stable")
        return by_rank[rank_of]

    def epoch(self, now_s: float) -> int:
        """The skew epoch at emulated time `now_s`."""
        return 0 if self.spec.shift_s is None else int(now_s // self.spec.shift_s)

    def route(
        self,
        block: int,
        n: int,
        keys: np.ndarray | None = None,
        *,
        request_ids: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        now_s: float = 0.0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k experts of n rows, drawn without replacement by popularity; weights are the chosen experts'
        popularities renormalised (they sum to 1). With `keys` [n], or `request_ids` and `positions` [n], the draw
        depends only on (seed, block, key); with request affinity a token reuses the draw of the earliest of its
        request's previous positions it is chained to (each link kept with probability ρ)."""
        if request_ids is not None:
            rid, pos = np.asarray(request_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64)
            if self.spec.rho > 0:
                pos = self._affine_positions(block, rid, pos)
            keys = row_keys(rid, pos)
        popularity = self._row_popularity(block, n, request_ids, self.epoch(now_s))  # [n, E]
        noise = self._gumbel_noise(block, n, keys)  # [n, E]
        ids = _gumbel_top_k(np.log(popularity), noise, self.top_k)  # [n, K]
        w = np.take_along_axis(popularity, ids, axis=1)
        ids, w = ids.astype(np.int64), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
        if self.num_shared:
            shared = np.arange(self.num_experts, self.num_experts + self.num_shared, dtype=np.int64)
            ids = np.concatenate([ids, np.broadcast_to(shared, (n, self.num_shared))], axis=1)
            w = np.concatenate([w, np.ones((n, self.num_shared), dtype=np.float32)], axis=1)
        return ids, w

    def _row_popularity(self, block: int, n: int, request_ids, epoch: int) -> np.ndarray:
        """[n, E]: each row's popularity, the next epoch's for the rows of drifted requests (`drift=N`)."""
        now = self.popularity_at(epoch)[block]
        if self.spec.drift_id is None or request_ids is None:
            return np.broadcast_to(now, (n, self.num_experts))
        drifted = np.asarray(request_ids, dtype=np.int64) >= self.spec.drift_id  # [n]
        return np.where(drifted[:, None], self.popularity_at(epoch + 1)[block], now)

    def _affine_positions(self, block: int, rid: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The position whose draw each token keeps: walk back while a keyed coin (P = ρ) says "same as the token
        before", stopping at the request's first position. Stateless, so every runtime and schedule agrees."""
        steps = np.arange(AFFINITY_WALK, dtype=np.int64)
        back = np.maximum(pos[:, None] - steps[None, :], 0)  # [n, W] positions pos, pos-1, ...
        salt = _splitmix64(np.uint64(self.seed) ^ np.uint64(0xAFF1) + np.uint64(block))
        coin = _splitmix64(row_keys(np.repeat(rid, AFFINITY_WALK), back.ravel()) ^ salt).reshape(back.shape)
        keep = ((coin >> np.uint64(11)).astype(np.float64) * 2.0**-53 < self.spec.rho) & (back > 0)
        first_fresh = np.where(keep.all(axis=1), AFFINITY_WALK - 1, np.argmin(keep, axis=1))
        return back[np.arange(len(pos)), first_fresh]

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


def routing_inclusion(model: ModelProfile, routing: str, seed: int = 0) -> np.ndarray:
    """q [blocks, expert ids]: each expert's probability of being among a token's top-k, per block, under the
    routing override `routing` (seeded as the emulated runtimes seed it), and 1 for the shared expert. Request
    affinity does not change it."""
    spec = RoutingSpec.parse(routing)
    if not spec.is_override:
        spec = RoutingSpec("uniform")
    router = RouterOverride(spec, model.num_experts, model.top_k, model.num_blocks, seed)
    q = router.inclusion_at(0)
    return np.concatenate([q, np.ones((model.num_blocks, model.num_shared_experts))], axis=1)
