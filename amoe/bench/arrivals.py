"""When each benchmark request is sent: Poisson or gamma arrivals at a mean rate, seeded.

Inter-arrival gaps follow a gamma distribution with shape = burstiness and scale = 1 / (rate · burstiness), as
`vllm bench serve --burstiness` does: the mean gap is always 1 / rate and the coefficient of variation of the gaps is
1 / sqrt(burstiness). burstiness 1 is a Poisson process (exponential gaps, the paper's §5 arrivals); below 1 the
arrivals are burstier, above 1 more even. An infinite rate sends every request at once.
"""

from __future__ import annotations

import math

import numpy as np

from amoe.errors import ConfigError


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start of the run, non-decreasing; the first request goes at 0."""
    if num_requests < 0:
        raise ConfigError(f"the number of requests must be >= 0; got {num_requests}")
    if not rate > 0:  # also rejects NaN
        raise ConfigError(f"the request rate must be > 0 (or inf); got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ConfigError(f"burstiness must be a positive number; got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
