"""Emulated GPUs: a cost model of named GPUs and model shapes, the routing override, and emulated executors.

`profiles` holds every number and its source; `cost_model` turns shapes into step times; `routing` is the
`--routing uniform|skew-exp[:λ]` override; `clock` holds a runtime for emulated time × time scale; `executor` has
the emulated expert executor and the emulated attention compute, which the runtime composes with its real request
state exactly as it does the torch compute (imported on use: it needs torch); `shapes` turns profiles into the
runtime's model shapes and back; `links` places runtimes on nodes and prices the hold each peer's messages get in
flight.
See docs/emulation.md.
"""

from amoe.emulation.profiles import GPUS, HOSTS, MODELS, gpu_profile, host_overhead, model_profile
from amoe.emulation.routing import DEFAULT_LAMBDA, RouterOverride, RoutingSpec

__all__ = [
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
