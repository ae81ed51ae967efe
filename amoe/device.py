"""Where tensors live and in what type: the one place that maps dtype names to torch dtypes.

The GPU work (device choice, streams, memory budgets) grows here; everything else asks this module.
"""

from __future__ import annotations

import torch

from amoe.config import DTYPE_NAMES

_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config or checkpoint dtype name (one of DTYPE_NAMES)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}") from None
