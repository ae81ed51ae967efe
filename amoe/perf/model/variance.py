"""Step-time variance of emulated GPUs: identical GPUs do not run at one speed, and one GPU's steps do not
all take the same time. Both are drawn, seeded, from public measurements (docs/cost-model.md "Step-time variance"):

* **Speed spread across GPUs.** Sinha et al., "Not All GPUs Are Created Equal: Characterizing Variability in
  Large-Scale, Accelerator-Rich Systems", SC'22 (arXiv 2208.11035v3, abstract): over 18,800 hours on >90 % of the
  GPUs of five clusters, "8 % (max 22 %) average performance variation" between GPUs of one architecture and SKU,
  "with outliers up to 1.5X slower than the median GPU". Each emulated GPU gets a fixed slowdown drawn uniformly
  from [1 − spread / 2, 1 + spread / 2] (the median GPU at 1: the cost model's calibrated one), so the fastest and
  slowest of many GPUs differ by `spread` = 0.08. The outliers are not drawn: the abstract gives no frequency.
* **Jitter per step.** DeepEP issue #208 (github.com/deepseek-ai/DeepEP/issues/208: test_low_latency on 8 ranks,
  dispatch + combine): each rank's mean is 923–925 µs and its extremes over the test's repetitions lie 2.5–8.8 %
  from that mean (rank 20: 842–981 µs around 923 µs), median 4.05 % over the 8 ranks. Each step's time is
  multiplied by 1 + U(−jitter, jitter), `jitter` = 0.04, independently per step and GPU.

Both keep the mean (a GPU's busy time over many steps is its speed × the cost model's); what they change is who
waits. A barrier (EP's all-to-alls, ping-pong's lock-step) waits for the slowest device of every step, a queue (AEP)
does not: `expected_max` is what the bounds charge a barrier.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from amoe.errors import ConfigError

# Sinha et al., SC'22 (arXiv 2208.11035v3): the range of speeds across identical GPUs, as a fraction of the median.
SOURCED_SPREAD = 0.08
# DeepEP issue #208: the median over 8 ranks of a step's largest deviation from its rank's mean, as a fraction.
SOURCED_JITTER = 0.04
_SALT = 0x5EED_0032  # keeps these draws apart from the routing override's, which use the same seed


@dataclass(frozen=True)
class StepVariance:
    """Per-GPU speed spread and per-step jitter (fractions; 0 and 0: none), and the seed of their draws."""

    spread: float = 0.0
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.spread < 2.0:
            raise ConfigError(f"--step-variance: the speed spread must be in [0, 2); got {self.spread:g}")
        if not 0.0 <= self.jitter < 1.0:
            raise ConfigError(f"--step-variance: the jitter must be in [0, 1); got {self.jitter:g}")

    @classmethod
    def parse(cls, text: str) -> StepVariance:
        """`sourced` | `off` | `SPREAD`, then optional `,jitter=J` and `,seed=N`: e.g. `sourced`, `0.2`,
        `0.08,jitter=0,seed=3`. A bare SPREAD keeps the sourced jitter."""
        head, *options = [part.strip() for part in str(text).split(",")]
        if head == "sourced":
            spread, jitter = SOURCED_SPREAD, SOURCED_JITTER
        elif head == "off":
            spread, jitter = 0.0, 0.0
        else:
            spread, jitter = _fraction(head, text), SOURCED_JITTER
        seed = 0
        for option in options:
            key, _, value = option.partition("=")
            if key == "jitter":
                jitter = _fraction(value, text)
            elif key == "seed":
                try:
                    seed = int(value)
                except ValueError:
                    raise ConfigError(f"--step-variance: seed must be an integer; got {value!r}") from None
            else:
                raise ConfigError(
                    f"--step-variance takes sourced | off | SPREAD[,jitter=J][,seed=N]; got {text!r}"
                )
        return cls(spread, jitter, seed)

    @property
    def is_off(self) -> bool:
        return self.spread == 0.0 and self.jitter == 0.0

    def speed(self, device: int) -> float:
        """Device `device`'s fixed slowdown (step time over the cost model's): the same for every process and
        every model of one deployment (keyed by seed and device id: runtime id, attention GPUs first)."""
        if self.spread == 0.0:
            return 1.0
        return _speed(self.spread, self.seed, device)

    def speeds(self, first: int, count: int) -> np.ndarray:
        """[count] slowdowns of devices first .. first + count − 1."""
        return np.array([self.speed(first + i) for i in range(count)])

    def jitter_rng(self, device: int, stream: int = 0) -> np.random.Generator:
        """The generator of one device's step jitter (`stream`: one per clock of the device)."""
        return np.random.default_rng([_SALT, self.seed, device, 1 + stream])

    def draw(self, rng: np.random.Generator, size: int | None = None):
        """Jitter factor(s) 1 + U(−jitter, jitter)."""
        if self.jitter == 0.0:
            return 1.0 if size is None else np.ones(size)
        return 1.0 + rng.uniform(-self.jitter, self.jitter, size)

    def describe(self) -> str:
        return "off" if self.is_off else f"spread {self.spread:g}, jitter ±{self.jitter:g}, seed {self.seed}"


@functools.lru_cache(maxsize=1 << 16)
def _speed(spread: float, seed: int, device: int) -> float:
    # Cached: a seeded generator costs ~40 µs and the planner asks every candidate's devices (1.2 M calls on 256
    # GPUs, half of its bounds' time).
    rng = np.random.default_rng([_SALT, seed, device])
    return float(rng.uniform(1.0 - spread / 2, 1.0 + spread / 2))


OFF = StepVariance()
SOURCED = StepVariance(SOURCED_SPREAD, SOURCED_JITTER)


def _fraction(value: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(
            f"--step-variance takes sourced | off | SPREAD[,jitter=J][,seed=N]; got {text!r}"
        ) from None


# Points of the grid `expected_max` integrates over: the error of the trapezoid rule on a piecewise-polynomial CDF is
# far below the cost model's precision at this size.
_GRID = 512
# expected_max's answers by their exact inputs: the planner asks the same barriers for every attention cap that
# leaves a wave or micro-batch its size (354 k calls, most of `amoe plan`'s time on 256 H800s).
_MEMO: dict[tuple, np.ndarray] = {}
_MEMO_MAX = 8192


def expected_max(scales, jitter: float) -> np.ndarray | float:
    """E[max_i scales_i · (1 + U_i)], U_i ~ U(−jitter, jitter) independent: what a barrier over devices whose
    steps take `scales` (each already × its device's speed) waits on average. `scales` [..., devices]: the max is
    over the last axis (one value per leading index)."""
    a = np.asarray(scales, dtype=float)
    if jitter == 0.0 or a.shape[-1] == 0:
        return a.max(axis=-1) if a.shape[-1] else np.zeros(a.shape[:-1])
    key = (a.shape, a.tobytes(), float(jitter))  # exact inputs: a hit is the same answer to the last bit
    out = _MEMO.get(key)
    if out is None:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        out = _MEMO[key] = _expected_max(a, jitter)
    return float(out) if out.ndim == 0 else out.copy()


def _expected_max(a: np.ndarray, jitter: float) -> np.ndarray:
    lo = (a * (1 - jitter)).max(axis=-1, keepdims=True)  # the max is never below the largest lower end
    hi = (a * (1 + jitter)).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Devices that cannot be the slowest: one whose CDF is 1 already at lo (the grid's first point) is 1 at
        # every point (the computed u below is monotone in x: each of its operations rounds monotonically), and a
        # factor of exactly 1.0 leaves the product over devices bit for bit; so is a device with no step (a ≤ 0).
        # Dropping them is exact, not an approximation (with skew most expert GPUs are far below the hottest).
        keep = (a > 0) & ((lo / a - 1.0 + jitter) / (2 * jitter) < 1.0)
    kept = keep.sum(axis=-1).max()
    if kept < a.shape[-1]:
        # The kept devices of each row in their order (the product's order), padded with no-step devices.
        order = np.argsort(~keep, axis=-1, kind="stable")[..., :kept]
        a = np.where(np.take_along_axis(keep, order, axis=-1), np.take_along_axis(a, order, axis=-1), 0.0)
    x = lo + (hi - lo) * np.linspace(0.0, 1.0, _GRID)  # [..., grid]
    with np.errstate(divide="ignore", invalid="ignore"):
        # P(a_i (1 + U_i) <= x) for every device, over the grid: [..., devices, grid]; in place, the same
        # operations in the same order as (x / a − 1 + jitter) / (2 jitter).
        u = x[..., None, :] / a[..., :, None]
        u -= 1.0
        u += jitter
        u /= 2 * jitter
    np.clip(u, 0.0, 1.0, out=u)
    idle = a <= 0
    if idle.any():
        u[idle] = 1.0
    cdf = u.prod(axis=-2)  # [..., grid]
    tail = np.trapezoid(1.0 - cdf, x, axis=-1)
    return lo[..., 0] + tail
