"""Emulated GPUs: a cost model of named GPUs and model shapes, the routing override, and emulated executors.

`profiles` holds every number and its source; `cost_model` turns shapes into step times; `routing` is the
`--routing uniform|skew-exp[:λ]` override; `clock` holds a runtime for emulated time × time scale; `executor` has
the emulated expert executor and the emulated attention compute, which the runtime composes with its real request
state exactly as it does the torch compute (imported on use: it needs torch); `shapes` turns profiles into the
runtime's model shapes and back; `links` places runtimes on nodes and prices the hold each peer's messages get in
flight.
See docs/emulation.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amoe.emulation.profiles import GPUS, HOSTS, MODELS, gpu_profile, host_overhead, model_profile
from amoe.emulation.routing import DEFAULT_LAMBDA, RouterOverride, RoutingSpec
from amoe.errors import ConfigError

if TYPE_CHECKING:
    from amoe.config import ExecutorSection


def check_executor(ex: ExecutorSection) -> None:
    """The executor section's names that the cost model owns (GPUs, profile, host overhead, routing): a ConfigError
    naming the bad one. `amoe serve` calls it before it starts anything; every Emulation calls it."""
    gpu_profile(ex.gpu)
    if ex.expert_gpu:
        gpu_profile(ex.expert_gpu)
    host_overhead(ex.host_overhead)
    if ex.profile is not None:
        model_profile(ex.profile, ex.top_k)
    from amoe.emulation.variance import StepVariance

    StepVariance.parse(ex.step_variance)
    routing = RoutingSpec.parse(ex.routing)
    if ex.kind == "emulated" and not routing.is_override:
        raise ConfigError("emulated GPUs have no router weights: use --routing uniform or skew-exp[:λ]")


__all__ = [
    "check_executor",
    "DEFAULT_LAMBDA",
    "GPUS",
    "HOSTS",
    "MODELS",
    "RouterOverride",
    "RoutingSpec",
    "gpu_profile",
    "host_overhead",
    "model_profile",
]
