"""The cost model of emulated GPUs: profiles (`gpus`, `models`, `hosts`, `calibration`), the frozen kernel
calibration they read (`calibrations`: one dated data file each), step and transfer times (`cost_model`, `links`,
`kernels`, `eps`, `ep_block`, `ep_scale`, `ep_prefill`), the routing override (`routing`), step-time
variance (`variance`), offload tiers (`offload_tiers`), the paper workloads' lengths (`workloads`), the runtime's
model shapes of a profile (`shapes`) and the emulation section's check (`check`). The only floor of amoe.perf the
serving product imports. See docs/cost-model.md.
"""
