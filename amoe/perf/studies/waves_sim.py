"""The simulation (32 blocks, staggered ranks) of waves-emulated's plans under waves, at the corrected bound's
concurrency (× MULT), with the expert side's wave group: `bound` (the plan's, bound_pools.wave_group) or N (0: per
rank, docs/scheduler.md "The straggler wait" and "The meeting block"). One JSON line per plan and multiple:

    amoe bench waves-sim 0,1,2,3,4,5,6 1 bound   # plans, MULT[,MULT...], group
"""

from __future__ import annotations

import argparse
import json
import time

from amoe.config import SchedulerSection
from amoe.errors import ConfigError
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds as B
from amoe.perf.plan.bound_pools import wave_group
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import simulate
from amoe.perf.studies.waves_emulated import BLOCKS, PLANS, ROUTING


def main(args: argparse.Namespace) -> int:
    """`amoe bench waves-sim PLANS [MULTS] [GROUP]` (amoe.perf.studies.commands)."""
    try:
        plans = [int(x) for x in args.plans.split(",")]
        mults = [float(x) for x in args.mults.split(",")]
        group = args.group if args.group == "bound" else int(args.group)
    except ValueError:
        raise ConfigError("waves-sim takes PLANS (i,j,...), MULTS (x,y,...) and GROUP (bound or N)") from None
    if bad := [i for i in plans if not 0 <= i < len(PLANS)]:
        raise ConfigError(f"waves-sim: no plan {bad[0]}; the plans are 0..{len(PLANS) - 1}")
    host, ctx = host_overhead("amoe-paper"), mean_context("short")
    for i in plans:
        gpu, k, a, e, cap, ecap = PLANS[i]
        m = model_profile(f"mixtral-8x7b-mqa:{BLOCKS}", k)
        d = Deployment("aep", gpu, a, gpu, e, cap, ecap)
        b = B.predict(m, d, routing_inclusion(m, ROUTING), ctx, host)
        M = wave_group(b.extra, cap) if group == "bound" else group
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
    return 0
