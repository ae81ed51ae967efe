"""Batch means (Law & Kelton, "Simulation Modeling and Analysis", §9.5.3): the 95 % interval of a steady-state
mean from the spread of the means of consecutive stretches ("batches") of one run — the half-load ITL of
`amoe bench policies` and the stopping rule of `amoe plan`'s AEP-at-scale refinements."""

from __future__ import annotations

import math
import statistics

import numpy as np

from amoe.errors import ConfigError

# Student's t at 97.5 % (two-sided 95 %) for 1–40 degrees of freedom (scipy is not a dependency; past 40 the last
# is within 1.5 %).
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.306, 2.2622, 2.2281, 2.201, 2.1788, 2.1604, 2.1448,
    2.1314, 2.1199, 2.1098, 2.1009, 2.093, 2.086, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484,
    2.0452, 2.0423, 2.0395, 2.0369, 2.0345, 2.0322, 2.0301, 2.0281, 2.0262, 2.0244, 2.0227, 2.0211,
)  # fmt: skip


def t95(dof: int) -> float:
    """The two-sided 95 % Student t quantile for `dof` degrees of freedom (40's past 40)."""
    if dof < 1:
        raise ConfigError(f"a confidence interval needs at least two batches; got {dof + 1}")
    return _T975[min(dof, len(_T975)) - 1]


def batch_means_halfwidth(x: np.ndarray) -> float:
    """The 95 % batch-means interval's half-width of the mean of `x` (one value a batch), relative to that mean:
    t(0.975, k − 1) · s / √k / mean (inf with fewer than 2 batches or a mean of 0)."""
    k = len(x)
    mean = float(np.mean(x)) if k else 0.0
    if k < 2 or mean <= 0:
        return math.inf
    return t95(k - 1) * float(np.std(x, ddof=1)) / math.sqrt(k) / mean


def batch_means(series: list, start: float, end: float, batches: int, little: bool = False) -> dict:
    """The token-weighted mean ITL over [start, end] (or, `little`, the throughput by Little's law: requests in
    flight over that ITL) and its 95 % interval by batch means.

    `series`: scrapes in time order, each (time, ITL sum, ITL count[, requests running, ...]) with the sums
    cumulative (any time unit; ITL in the unit of sum / count). The window is cut into `batches` equal stretches
    at the scrapes nearest the cut times; each stretch's figure is its Δsum / Δcount (with `little`, its scrapes'
    mean requests running over that), the interval's half-width t × sd(batch figures) / sqrt(batches), also
    relative to the window's figure. And the lag-1 autocorrelation of the batch figures: well above 0 says the
    batches are shorter than the series' correlation and the interval too narrow."""
    if batches < 2:
        raise ConfigError(f"batch means need at least 2 batches; got {batches}")
    inside = [s for s in series if start <= s[0] <= end]
    if len(inside) < batches + 1:
        raise ConfigError(f"{len(inside)} scrapes in the window cannot make {batches} batches")
    cuts = [start + (end - start) * i / batches for i in range(batches + 1)]
    marks = [min(range(len(inside)), key=lambda i, c=c: abs(inside[i][0] - c)) for c in cuts]

    def figure(i: int, j: int) -> float:
        a, b = inside[i], inside[j]
        if b[2] <= a[2]:
            raise ConfigError("a batch holds no ITL observation: fewer batches or a longer window")
        itl = (b[1] - a[1]) / (b[2] - a[2])
        return statistics.fmean(s[3] for s in inside[i : j + 1]) / itl if little else itl

    means = [figure(i, j) for i, j in zip(marks, marks[1:])]
    whole = figure(marks[0], marks[-1])
    mean = statistics.fmean(means)
    sd = statistics.stdev(means)
    half = t95(batches - 1) * sd / math.sqrt(batches)
    lag1 = None
    if batches >= 3 and sd > 0:
        dev = [m - mean for m in means]
        lag1 = sum(x * y for x, y in zip(dev, dev[1:])) / sum(x * x for x in dev)
    return {"value": whole, "batch_means": means, "half_width": half, "ci_rel": half / whole, "lag1": lag1}
