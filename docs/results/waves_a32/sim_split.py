import json, sys
import numpy as np
from collections import defaultdict
from amoe.config import SchedulerSection
from amoe.emulation import bounds as B
from amoe.emulation.plan import mean_context
from amoe.emulation.profiles import host_overhead, model_profile
from amoe.emulation import simulate as S
sys.path.insert(0, "bench")
from waves_emulated import PLANS, ROUTING, BLOCKS
host, ctx = host_overhead("amoe-paper"), mean_context("short")
plans = [int(x) for x in sys.argv[1].split(",")]
stagger = "--together" not in sys.argv
rec = []
orig_start = S._Aep._start
orig_done = S._Aep._exp_done
def _exp_done(self, g, block, parts):
    rec.append((self.now, g, block, frozenset(zip(self.rank_of[parts].tolist(), self.wave[parts].tolist()))))
    return orig_done(self, g, block, parts)
S._Aep._exp_done = _exp_done
for i in plans:
    gpu, k, a, e, cap, ecap = PLANS[i]
    m = model_profile(f"mixtral-8x7b-mqa:{BLOCKS}", k)
    d = B.Deployment("aep", gpu, a, gpu, e, cap, ecap)
    bound = B.predict(m, d, B.routing_inclusion(m, ROUTING), ctx, host)
    rec.clear()
    s = S.simulate(m, d, ROUTING, ctx, host, bound.concurrency, warmup_s=4 * bound.itl_s, duration_s=8 * bound.itl_s,
                   scheduler=SchedulerSection(policy="waves", attn_batch_cap=cap, expert_batch_cap=ecap), stagger_ranks=stagger)
    # per GPU: map (block, wave) -> step index of its latest service
    splits, sizes = [], []
    last = defaultdict(dict)  # g -> (rank,wave) -> (block, step id)
    steps_by = {}
    nxt = defaultdict(lambda: defaultdict(set))  # step id -> set of next step ids
    for sid, (t, g, b, members) in enumerate(rec):
        for rw in members:
            prev = last[g].get(rw)
            if prev and prev[0] == (b - 1) % BLOCKS:
                nxt[prev[1]]["n"].add(sid)
            last[g][rw] = (b, sid)
        sizes.append(len(members))
    half = len(rec) // 2
    sp = [len(nxt[sid]["n"]) for sid in range(half, len(rec)) if nxt[sid]["n"]]
    print(json.dumps({"plan": i, "stagger": stagger, "of_bound": round(s.tokens_per_s / bound.tokens_per_s, 3),
        "bound_waves_per_step": a * bound.extra.get("group_waves", 1),
        "waves_per_step": round(float(np.mean(sizes[half:])), 2),
        "next_steps_per_step": round(float(np.mean(sp)), 2), "frac_split": round(float(np.mean(np.array(sp) > 1)), 3)}), flush=True)
