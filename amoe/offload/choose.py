"""`--offload-policy NAME` → the policy object (its own module: the activation-aware policy builds on policy.py's
interface, so the chooser cannot live there without an import circle)."""

from __future__ import annotations

from amoe.errors import ConfigError
from amoe.offload.activation import ActivationPolicy
from amoe.offload.policy import LFU, LRU, Policy

POLICIES = ("activation", "lru", "lfu")


def make_policy(name: str, num_blocks: int, num_experts: int, eamc_path: str | None = None) -> Policy:
    """The policy `--offload-policy NAME` names, for a model of `num_blocks` MoE blocks of `num_experts` experts;
    ConfigError for an unknown name or an EAMC file that does not fit (both shapes named)."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "activation":
        return ActivationPolicy(num_blocks, num_experts, eamc_path)
    raise ConfigError(f"--offload-policy must be one of {', '.join(POLICIES)}; got {name!r}")
