"""What a bound (or a simulation refining it) predicts of a deployment: decode throughput, ITL, the concurrency it
takes and what bounds it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Prediction:
    """A deployment's best decode throughput and the ITL it comes with."""

    tokens_per_s: float
    itl_s: float
    concurrency: int  # requests decoding at once
    bottleneck: str  # attention | experts | critical path | link | barrier | memory
    attention_tokens_per_s: float = 0.0
    expert_tokens_per_s: float = 0.0
    expert_skew: float = (
        1.0  # the busiest expert GPU's load over the mean (aep / pingpong; ep: per block, mean)
    )
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


MEMORY = Prediction(0.0, math.inf, 0, "memory")
