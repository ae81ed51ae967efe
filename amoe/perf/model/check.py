"""The serving config's emulation names that the cost model owns: GPUs, model profile, host overhead, step-time
variance and routing (`check_emulation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from amoe.errors import ConfigError
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import RoutingSpec
from amoe.perf.model.variance import StepVariance

if TYPE_CHECKING:
    from amoe.config import EmulationSection


def check_emulation(ex: EmulationSection, emulated: bool = True) -> None:
    """The emulation section's names that the cost model owns (GPUs, profile, host overhead, routing): a ConfigError
    naming the bad one; `emulated` (the executor is): its routing must be an override. `amoe serve` calls it before
    it starts anything; every Emulation calls it."""
    gpu_profile(ex.gpu)
    if ex.expert_gpu:
        gpu_profile(ex.expert_gpu)
    host_overhead(ex.host_overhead)
    if ex.profile is not None:
        model_profile(ex.profile, ex.top_k)
    StepVariance.parse(ex.step_variance)
    routing = RoutingSpec.parse(ex.routing)
    if emulated and not routing.is_override:
        raise ConfigError("emulated GPUs have no router weights: use --routing uniform or skew-exp[:λ]")
