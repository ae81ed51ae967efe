"""The simulation (32 blocks, staggered ranks) of bench/waves_emulated.py's plans under waves, at the corrected bound's
concurrency (× MULT), with the expert side's wave group: `bound` (the plan's, bounds.wave_group) or N (0: per rank,
docs/engine.md items 9-10). One JSON line per plan; run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/results/wave_groups/sim.py 0,1,2,3,4,5,6 1 bound   # plans, MULT, group
"""

import json
import sys
import time

sys.path.insert(0, "bench")
from waves_emulated import BLOCKS, PLANS, ROUTING  # noqa: E402

from amoe.config import SchedulerSection  # noqa: E402
from amoe.emulation import bounds as B  # noqa: E402
from amoe.emulation.plan import mean_context  # noqa: E402
from amoe.emulation.profiles import host_overhead, model_profile  # noqa: E402
from amoe.emulation.simulate import simulate  # noqa: E402

host, ctx = host_overhead("amoe-paper"), mean_context("short")
plans = [int(x) for x in sys.argv[1].split(",")]
mults = [float(x) for x in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1"])]
group = sys.argv[3] if len(sys.argv) > 3 else "bound"
for i in plans:
    gpu, k, a, e, cap, ecap = PLANS[i]
    m = model_profile(f"mixtral-8x7b-mqa:{BLOCKS}", k)
    d = B.Deployment("aep", gpu, a, gpu, e, cap, ecap)
    b = B.predict(m, d, B.routing_inclusion(m, ROUTING), ctx, host)
    M = B.wave_group(b.extra, cap) if group == "bound" else int(group)
    sched = SchedulerSection(policy="waves", attn_batch_cap=cap, expert_batch_cap=ecap, wave_group=M)
    for mult in mults:
        c, t = int(mult * b.concurrency), time.time()
        s = simulate(
            m, d, ROUTING, ctx, host, c, warmup_s=4 * b.itl_s * mult, duration_s=8 * b.itl_s * mult,
            scheduler=sched, stagger_ranks=True,
        )  # fmt: skip
        row = {
            "plan": i, "M": M, "c": c, "of": round(s.tokens_per_s / b.tokens_per_s, 3), "itl": round(s.itl_s * 1e3, 1),
            "bitl": round(b.itl_s * 1e3, 1), "erows": round(s.expert_rows_per_step, 1),
            "abusy": round(s.attention_busy, 3), "ebusy": round(s.expert_busy, 3), "wall": round(time.time() - t),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
