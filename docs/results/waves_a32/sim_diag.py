import json, sys, time
import numpy as np
from amoe.config import SchedulerSection
from amoe.emulation import bounds as B
from amoe.emulation.plan import mean_context
from amoe.emulation.profiles import host_overhead, model_profile
from amoe.emulation import simulate as S
sys.path.insert(0, "bench")
from waves_emulated import PLANS, ROUTING, BLOCKS

host, ctx = host_overhead("amoe-paper"), mean_context("short")
stagger = "--together" not in sys.argv
plans = [int(x) for x in sys.argv[1].split(",")]
diag = {}
orig_count = S._Aep._count
orig_start = S._Aep._start
def _start(self, dev):
    self._dev = dev
    return orig_start(self, dev)
def _count(self, side, rows, t):
    orig_count(self, side, rows, t)
S._Aep._start = _start
orig_exp_done = S._Aep._exp_done
def _exp_done(self, g, block, parts):
    lo, hi = self.window
    if lo <= self.now < hi:
        rw = set(zip(self.rank_of[parts].tolist(), self.wave[parts].tolist()))
        d = diag.setdefault("exp", [])
        d.append((len(parts), len(rw), len(set(self.rank_of[parts].tolist()))))
    return orig_exp_done(self, g, block, parts)
S._Aep._exp_done = _exp_done
for i in plans:
    gpu, k, a, e, cap, ecap = PLANS[i]
    m = model_profile(f"mixtral-8x7b-mqa:{BLOCKS}", k)
    d = B.Deployment("aep", gpu, a, gpu, e, cap, ecap)
    bound = B.predict(m, d, B.routing_inclusion(m, ROUTING), ctx, host)
    diag.clear()
    t0 = time.time()
    s = S.simulate(m, d, ROUTING, ctx, host, bound.concurrency, warmup_s=4 * bound.itl_s, duration_s=8 * bound.itl_s,
                   scheduler=SchedulerSection(policy="waves", attn_batch_cap=cap, expert_batch_cap=ecap),
                   stagger_ranks=stagger)
    ex = np.array(diag.get("exp", [(0, 0, 0)]))
    print(json.dumps({"plan_index": i, "plan": f"aep {a}+{e} {gpu} top{k} cap {cap}/{ecap}", "stagger": stagger,
        "bound": round(bound.tokens_per_s), "concurrency": bound.concurrency, "W": bound.extra["waves"],
        "w": bound.extra["wave_rows"], "m": bound.extra.get("group"), "extra": {kk: v for kk, v in bound.extra.items() if kk not in ("waves","wave_rows")},
        "of_bound": round(s.tokens_per_s / bound.tokens_per_s, 3), "itl_ms": round(s.itl_s * 1e3, 1),
        "attn_rows": round(s.attention_rows_per_step, 1), "exp_rows": round(s.expert_rows_per_step, 1),
        "attn_busy": round(s.attention_busy, 2), "exp_busy": round(s.expert_busy, 2),
        "exp_waves_per_step": round(float(ex[:, 1].mean()), 2), "exp_ranks_per_step": round(float(ex[:, 2].mean()), 2),
        "wall_s": round(time.time() - t0, 1)}, default=str), flush=True)
