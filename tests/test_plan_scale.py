"""`amoe bench plan-scale`: throughput per GPU against cluster size. With --simulate each best plan is refined by the
simulation (one copy of it), and never claims more than its bound; the table and plot are benchmark output
(experiments/2026-11-26-plan-scale-simulated)."""

import argparse

import golden

from amoe.perf.studies import plan_scale


def _args(simulate: bool) -> argparse.Namespace:
    return argparse.Namespace(
        profile="mixtral-8x7b-16e", top_k=1, routing="skew-exp:0.08", itl_slo_ms=None, simulate=simulate
    )


@golden.case("plan")
def plan_scale_ep_16_h100() -> golden.Figures:
    """`amoe bench plan-scale`'s best EP plan on 16 H100s (Mixtral 16 experts, top-1), by the bound and simulated."""
    return {
        "bound": plan_scale.best("h100", 16, "ep", _args(False), replicate=True),
        "simulated": plan_scale.best("h100", 16, "ep", _args(True), replicate=True),
    }


def test_the_best_plan_is_simulated_one_copy_at_a_time_and_stays_under_its_bound():
    """--simulate ranks each mode's best shapes by the simulation (as `amoe plan` does): its pick is simulated, under
    its bound, and no worse than simulating the bound's own best plan."""
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.models import model_profile
    from amoe.perf.model.workloads import mean_context
    from amoe.perf.plan import bounds
    from amoe.perf.plan.refine import refine

    args = _args(True)
    f = plan_scale_ep_16_h100.check()
    bound, sim = f["bound"], f["simulated"]
    assert not bound["simulated"] and bound["tokens_per_s"] == bound["bound"]
    assert sim["simulated"]
    assert sim["tokens_per_s"] <= 1.01 * sim["bound"]
    assert sim["per_gpu"] == round(sim["tokens_per_s"] / 16)
    req = plan_scale.PlanRequest(
        args.profile, {"h100": 16}, modes=("ep",), gpus_per_node=8, attn_caps=(256, 1024), expert_caps=(512,),
        balanced=False, simulate_top=0,
    )  # fmt: skip
    first = plan_scale.search(req)[0]
    assert plan_scale.describe(first.deployment) == bound["plan"]
    model = bounds.full_depth(model_profile(args.profile, 1))
    alone = refine(model, first.deployment, args.routing, mean_context("short"), host_overhead("amoe-paper"))
    assert sim["tokens_per_s"] >= 0.99 * alone.prediction.tokens_per_s
