"""The modelling wing: what amoe predicts of a deployment and how it checks the predictions, in three floors.

`amoe.perf.model` is the cost model (GPU, model, host and link profiles; step, transfer and kernel times; the routing
override; step-time variance; offload tiers), the only floor the serving product (amoe.runtime, amoe.engine,
amoe.serve, amoe.config, coordinator) may import. `amoe.perf.plan` builds on it: the bounds, the planner behind `amoe
plan`, the deployment type, and the simulations behind one entry (amoe.perf.plan.simulate.simulate). `amoe.perf.studies`
stands on both: the studies and measurement harnesses that check the model against the emulated runtime or against
published figures, and `commands`, where every planner and study command is registered. Imports run down the floors
only (studies → plan → model, never back up), amoe.bench's load generator imports none of them, and these packages
re-export nothing (tests/test_architecture.py checks all of it).
"""
