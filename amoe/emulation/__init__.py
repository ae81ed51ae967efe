"""The planner, the simulations and the studies of the performance model, on their way to amoe.perf."""
