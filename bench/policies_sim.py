"""The scheduling policies in the simulation at full depth (32 blocks), at the corrected AEP bound's concurrency and
twice it, on three of the planner's AEP plans (issue 32). One JSON line per run.

    PYTHONPATH=. .venv/bin/python bench/policies_sim.py > docs/results/policies_sim/policies_sim.jsonl
    PYTHONPATH=. .venv/bin/python bench/policies_sim.py waves     # only the policies named
    PYTHONPATH=. .venv/bin/python bench/policies_sim.py --stagger waves   # each attention rank starts at its own time

`--stagger`: the simulation's `stagger_ranks` (docs/engine.md "The waves rule" item 9): the attention ranks' waves
start out of phase, as the runtime's arrivals make them, instead of all at once. `--no-rank-barrier`: waves'
expert side as before item 9 (the oldest block, no wait), for comparison.
"""

import json
import sys

from amoe.config import POLICIES, SchedulerSection
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds as B
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import simulate

host, ctx, routing = host_overhead("amoe-paper"), mean_context("short"), "skew-exp:0.08"
args = sys.argv[1:]
stagger, barrier = "--stagger" in args, "--no-rank-barrier" not in args
chosen = [a for a in args if a not in ("--stagger", "--no-rank-barrier")] or list(POLICIES)
if unknown := set(chosen) - set(POLICIES):
    sys.exit(f"policies_sim: unknown policies {sorted(unknown)} (expected some of {', '.join(POLICIES)})")
for gpu, k, a, e, cap, ecap in (
    ("a100-80g", 1, 5, 3, 128, 1024),
    ("h100", 2, 4, 3, 256, 1024),
    ("h100", 1, 4, 4, 256, 512),
):
    m = B.full_depth(model_profile("mixtral-8x7b-mqa", k))
    d = Deployment("aep", gpu, a, gpu, e, cap, ecap)
    bound = B.predict(m, d, routing_inclusion(m, routing), ctx, host)
    for mult in (1, 2):
        c = mult * bound.concurrency
        for policy in chosen:
            s = simulate(
                m,
                d,
                routing,
                ctx,
                host,
                c,
                warmup_s=4 * bound.itl_s * mult,
                duration_s=8 * bound.itl_s * mult,
                scheduler=SchedulerSection(policy=policy, attn_batch_cap=cap, expert_batch_cap=ecap),
                stagger_ranks=stagger,
                rank_barrier=barrier,
            )
            print(
                json.dumps(
                    {
                        "plan": f"aep {a}+{e} {gpu} top{k} cap {cap}/{ecap}",
                        "bound": round(bound.tokens_per_s),
                        "bound_concurrency": bound.concurrency,
                        "concurrency": c,
                        "policy": policy,
                        "ranks_start": "staggered" if stagger else "together",
                        "rank_barrier": barrier,
                        "tokens_per_s": round(s.tokens_per_s),
                        "of_bound": round(s.tokens_per_s / bound.tokens_per_s, 3),
                        "itl_ms": round(s.itl_s * 1e3, 1),
                        "attention_rows_per_step": round(s.attention_rows_per_step, 1),
                        "expert_rows_per_step": round(s.expert_rows_per_step, 1),
                        "attention_busy": round(s.attention_busy, 2),
                        "expert_busy": round(s.expert_busy, 2),
                    }
                ),
                flush=True,
            )
