"""The 100 ms table's AEP plans (docs/results/plan_table_slo_variance/100) refined by the planner with defrag and waves."""
import dataclasses, json, sys, time
from amoe.emulation import bounds
from amoe.emulation.plan import mean_context, refine
from amoe.emulation.profiles import host_overhead, model_profile
from amoe.emulation.variance import SOURCED

rows = json.load(open("docs/results/plan_table_slo_variance/100/plan_table.json"))["rows"]
ctx, host = mean_context("short"), host_overhead("amoe-paper")
for row in rows:
    dep = dict(row["aep"]["deployment"])
    if dep.get("expert_map") is not None:
        dep["expert_map"] = tuple(dep["expert_map"])
    d = bounds.Deployment(**dep)
    model = bounds.full_depth(model_profile("mixtral-8x7b-mqa", row["top_k"]))
    pred = bounds.predict(model, d, bounds.routing_inclusion(model, row["routing"]), ctx, host, 0.1, SOURCED)
    for policy in ("defrag", "waves"):
        t = time.process_time()
        p = refine(model, d, row["routing"], ctx, host, pred, 100.0, policy=policy).prediction
        print(json.dumps({"gpu": row["gpu"], "top_k": row["top_k"], "plan": row["aep"]["plan"], "policy": policy,
              "bound": round(pred.tokens_per_s), "bound_concurrency": pred.concurrency,
              "tokens_per_s": round(p.tokens_per_s), "of_bound": round(p.tokens_per_s / pred.tokens_per_s, 3),
              "itl_ms": round(p.itl_s * 1e3, 1), "concurrency": p.concurrency, "cpu_s": round(time.process_time() - t, 1)}), flush=True)
