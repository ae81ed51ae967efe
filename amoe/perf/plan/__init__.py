"""What a deployment can do, predicted from the cost model (amoe.perf.model): the deployment type (`deployment`),
its bounds (`bounds`, with each mode's in `bound_pools` and `bound_ep`, the expert side's steps in `expert_steps`,
the result in `prediction`), the planner behind `amoe plan` (`request`, `search`, `refine`, `report`), a deployment
as the serving config and back (`serving`: what `amoe plan --out` writes and the studies serve), and the simulations
behind one entry, `simulate.simulate`. Never imports amoe.perf.studies. See docs/simulation.md and docs/plan.md.
"""
