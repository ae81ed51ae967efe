"""The only module that reads environment variables: debugging switches and the standard cache location.

Read lazily (`amoe.envs.AMOE_LOG_LEVEL`), so a test can set a variable after import. Configuration proper goes
through amoe.config, never through here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _cache_home() -> Path:
    # The XDG base-directory convention, as pip and Hugging Face use it.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Log level of the `amoe` loggers (DEBUG, INFO, ...); -v/--verbose overrides it.
    "AMOE_LOG_LEVEL": lambda: os.environ.get("AMOE_LOG_LEVEL", "").upper() or None,
    # Where amoe keeps generated files such as the default model's corpus: $XDG_CACHE_HOME/amoe.
    "AMOE_CACHE_DIR": lambda: _cache_home() / "amoe",
    # Fault injection for tests (amoe/runtime/faults.py): "stage:token[,stage:token]", or "alloc:N".
    "AMOE_FAULTS": lambda: os.environ.get("AMOE_FAULTS") or None,
    # The API key of `amoe serve` when no --api-key / --api-key-file is given (keeps it out of `ps`).
    "AMOE_API_KEY": lambda: os.environ.get("AMOE_API_KEY") or None,
}


def flag_variable(flag: str) -> str | None:
    """The variable that stands in for a multi-node flag not given (`--dist-init-addr` → AMOE_DIST_INIT_ADDR,
    `--node-rank` → AMOE_NODE_RANK, ...): orchestrators set these per pod or task instead of flags."""
    return os.environ.get("AMOE_" + flag.lstrip("-").upper().replace("-", "_")) or None


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)
