"""`amoe bench eps`: EPS-MoE's claims against the cost model (docs/findings.md "EPS-MoE"), a table per check and a
final JSON line.

1. Table II: the kernel curves' predictions of every cell; the PN 1 rows are in sample (the curves were fitted to
   them: `--fit` refits and prints the constants), the others out of sample; per column, the best configuration.
2. Table III: DeepSeek-V2 prefill on 8 H800s, the gain of PN 1 / 5 / 20 over EP without the pipeline.
3. The closed-form N* = √(C/k) against the search, per load.
4. Decode: on the planner's table (its GPUs, pool sizes, top-k and routings; the best EP deployment of each cell),
   the bound with `auto` PN against the best fixed PN; then the same on cells where a pipeline can win
   (`decode_wide`: the h800, DeepSeek-V2 and the frontier profiles, many experts a device, an ideal host too).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

from amoe.perf.model import ep_block, eps, kernels
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.request import PlanRequest, plan_profile
from amoe.perf.plan.search import search
from amoe.perf.studies import eps_paper
from amoe.perf.studies.plan_table import PROFILE, ROUTINGS


def table2(curves: kernels.EpsCurves) -> dict:
    gpu = gpu_profile("h800")
    cells, best = [], {}
    for row in eps_paper.TABLE2:
        pred = eps_paper.table2_prediction(curves, gpu, row)
        for i, (got, paper) in enumerate(zip(pred, row.ms)):
            err = got / paper - 1
            cells.append({"id": row.id, "col": i, "paper_ms": paper, "model_ms": round(got, 3), "err": err})
            best.setdefault(i, []).append((row.id, paper, got))
    in_sample = [c for c in cells if eps_paper.TABLE2[c["id"]].pipelines == 1]
    out_sample = [c for c in cells if eps_paper.TABLE2[c["id"]].pipelines != 1]
    columns = []
    for i, entries in sorted(best.items()):
        paper_best = min(entries, key=lambda e: e[1])[0]
        model_best = min(entries, key=lambda e: e[2])[0]
        columns.append({"col": i, "paper_best_id": paper_best, "model_best_id": model_best})
    return {
        "cells": cells,
        "pn1_within_10pct": sum(abs(c["err"]) <= 0.10 for c in in_sample),
        "pn1_cells": len(in_sample),
        "other_within_15pct": sum(abs(c["err"]) <= 0.15 for c in out_sample),
        "other_cells": len(out_sample),
        "same_best": sum(c["paper_best_id"] == c["model_best_id"] for c in columns),
        "columns": columns,
    }


def table3() -> dict:
    gpu, model = gpu_profile("h800"), model_profile("deepseek-v2")
    rows = []
    for i, seq in enumerate(eps_paper.TABLE3_SEQ_LENS):
        block = eps_paper.prefill_block(
            model, gpu, 8, seq, eps_paper.PREFILL_TOKENS_PER_GPU, eps_paper.TABLE3_PIPELINES
        )
        gains = {pn: 100 * eps_paper.prefill_gain(block, pn) for pn in eps_paper.TABLE3_PIPELINES}
        paper = {pn: eps_paper.TABLE3_GAIN[pn][i] for pn in eps_paper.TABLE3_PIPELINES}
        order = sorted(gains, key=gains.get, reverse=True)
        rows.append({
            "seq_len": seq, "model_gain_pct": {pn: round(g, 2) for pn, g in gains.items()}, "paper_gain_pct": paper,
            "pn5_points_off": round(gains[5] - paper[5], 2), "order": order,
            "paper_order": sorted(paper, key=paper.get, reverse=True),
        })  # fmt: skip
    return {"rows": rows}


def closed_form() -> list[dict]:
    gpu, model = gpu_profile("h800"), model_profile("deepseek-v2")
    curves = kernels.curves_for(gpu)
    out = []
    for tokens in (256, 1024, 4096, 8192, 16384):
        layer = eps.model_layer(model, 8, tokens)
        n_star = eps.closed_form_pipelines(gpu, curves, layer, "dense")
        best, t_best = eps.search_pipelines(gpu, curves, layer, "dense")
        at = eps.layer_time(gpu, curves, layer, max(1, round(n_star)), "dense", True)
        out.append({
            "tokens_per_gpu": tokens, "n_star": round(n_star, 2), "search_pn": best,
            "time_at_n_star_over_best": round(at / t_best, 4),
        })  # fmt: skip
    return out


def decode(gpus: list[str], sizes: list[int], top_ks: list[int]) -> list[dict]:
    """Per cell of the planner's table: the best EP deployment by the bound; its bound with auto PN and each fixed
    PN (kernel auto)."""
    out = []
    host = host_overhead("amoe-paper")
    for gpu in gpus:
        for n in sizes:
            for k in top_ks:
                for routing in ROUTINGS:
                    req = PlanRequest(
                        PROFILE, {gpu: n}, top_k=k, routing=routing, modes=("ep",), simulate_top=0
                    )
                    plans = search(req)
                    if not plans:
                        continue
                    dep = replace(plans[0].deployment, replicas=1)
                    model = bounds.full_depth(plan_profile(req))
                    q = routing_inclusion(model, routing, req.seed)
                    ctx = mean_context(req.workload)
                    top = max(1, min(len(es) for es in dep.experts_on(model.num_expert_ids)))

                    def tps(pn: int, dep=dep, model=model, q=q, ctx=ctx) -> float:
                        d = replace(dep, ep_pipelines=pn, ep_kernel="auto")
                        return bounds.predict(model, d, q, ctx, host).tokens_per_s

                    fixed = {pn: tps(pn) for pn in range(1, top + 1)}
                    auto = tps(0)
                    best = max(fixed.values())
                    out.append({
                        "gpu": gpu, "gpus": n, "top_k": k, "routing": routing, "ep": dep.num_attn,
                        "local_experts": top, "auto_pn": d_auto_pn(dep, model, host, q), "auto_tps": round(auto), "best_fixed_pn": max(fixed, key=fixed.get),
                        "best_fixed_tps": round(best), "auto_loss_pct": round(float(100 * (1 - auto / best)), 3),
                    })  # fmt: skip
    return out


# Decode cells where a pipeline can matter (experiments/2026-11-27-eps-moe): the h800 with its Table II curves, the
# fine-grained profiles (DeepSeek-V2 and the frontier ones) in EP groups of 8 to 20 experts a device, the
# amoe-paper host and an ideal one (no host step per chunk), three batch caps, uniform and skewed routing.
WIDE_MODELS = (("deepseek-v2", 16), ("deepseek-v3", 32), ("qwen3-235b-a22b", 16), ("qwen3-30b-a3b", 8))
WIDE_HOSTS = ("amoe-paper", "none")
WIDE_CAPS = (64, 256, 1024)
WIDE_ROUTINGS = ("uniform", "skew-exp:0.4")


def decode_wide(gpu: str = "h800", workload: str = "medium") -> list[dict]:
    """Per cell: the EP bound with `auto` PN against every fixed PN (1 .. the experts a device holds), kernel auto."""
    out = []
    ctx = mean_context(workload)
    for name, n in WIDE_MODELS:
        model = bounds.full_depth(model_profile(name))
        for routing in WIDE_ROUTINGS:
            q = routing_inclusion(model, routing)
            for host_name in WIDE_HOSTS:
                host = host_overhead(host_name)
                for cap in WIDE_CAPS:
                    dep = Deployment("ep", gpu, n, attn_cap=cap)
                    top = max(1, min(len(es) for es in dep.experts_on(model.num_expert_ids)))

                    def run(pn: int, model=model, dep=dep, q=q, host=host):
                        return bounds.predict(
                            model, replace(dep, ep_pipelines=pn, ep_kernel="auto"), q, ctx, host
                        )

                    fixed = {pn: run(pn).tokens_per_s for pn in range(1, top + 1)}
                    auto = run(0)
                    best_pn = max(fixed, key=fixed.get)
                    if fixed[best_pn] <= 0:  # does not fit in memory
                        continue
                    out.append({
                        "model": name, "gpu": gpu, "ep": n, "local_experts": top, "host": host_name, "cap": cap,
                        "routing": routing, "auto_pn": auto.extra.get("ep_pipelines"), "auto_tps": round(auto.tokens_per_s),
                        "best_fixed_pn": best_pn, "best_fixed_tps": round(fixed[best_pn]),
                        "pn1_tps": round(fixed[1]),
                        "auto_loss_pct": round(float(100 * (1 - auto.tokens_per_s / fixed[best_pn])), 3),
                    })  # fmt: skip
    return out


def d_auto_pn(dep: Deployment, model, host, q) -> int:
    """The PN `auto` picks at the deployment's operating point (its batch cap on every device)."""
    gpu = gpu_profile(dep.attn_gpu)
    return ep_block.ep_pipelines_for(0, model, gpu, dep.num_attn, dep.num_attn * dep.attn_cap, host, q)


def main(args) -> int:
    curves = kernels.CURVES["h800"]
    if args.fit:
        curves = eps_paper.fit_table2(gpu_profile("h800"))
        # then the interference, from Table IV alone, on the refitted curves (it does not enter the PN 1 rows)
        curves = replace(curves, interference=eps_paper.fit_interference(curves, gpu_profile("h800")))
        print("fitted h800 curves:", json.dumps(asdict(curves)))
    t2 = table2(curves)
    print("Table II (ms): id col paper model err")
    for c in t2["cells"]:
        tag = "in " if eps_paper.TABLE2[c["id"]].pipelines == 1 else "out"
        print(
            f"  {tag} {c['id']:2d} {c['col']} {c['paper_ms']:8.3f} {c['model_ms']:8.3f} {100 * c['err']:+6.1f} %"
        )
    print(
        f"PN 1 cells within 10 %: {t2['pn1_within_10pct']}/{t2['pn1_cells']}; other cells within 15 %: "
        f"{t2['other_within_15pct']}/{t2['other_cells']}; same best configuration: {t2['same_best']}/6"
    )
    t3 = table3()
    print("Table III (prefill gain %, DeepSeek-V2, 8 x H800): seq  model{PN: gain}  paper")
    for r in t3["rows"]:
        print(f"  {r['seq_len']:5d} {r['model_gain_pct']} {r['paper_gain_pct']} order {r['order']}")
    cf = closed_form()
    print("N* = sqrt(C/k) vs search (DeepSeek-V2 layer, 8 x H800, dense):")
    for r in cf:
        print(f"  {r}")
    dec = decode(
        args.gpus.split(","), [int(s) for s in args.sizes.split(",")], [int(k) for k in args.top_k.split(",")]
    )
    worst = max((r["auto_loss_pct"] for r in dec), default=math.nan)
    print(
        f"decode: auto PN against the best fixed PN on {len(dec)} cells of the planner's table; worst loss {worst} %"
    )
    for r in dec:
        print(f"  {r}")
    wide = decode_wide()
    wide_worst = max((r["auto_loss_pct"] for r in wide), default=math.nan)
    print(
        f"decode, h800 and fine-grained MoE: auto PN against the best fixed PN on {len(wide)} cells "
        f"({sum(r['best_fixed_pn'] > 1 for r in wide)} where a pipeline wins); worst loss {wide_worst} %"
    )
    for r in wide:
        print(f"  {r}")
    summary = {
        "bench": "eps",
        "table2": {k: v for k, v in t2.items() if k != "cells"},
        "table3": t3["rows"],
        "closed_form": cf,
        "decode_cells": len(dec),
        "decode_worst_auto_loss_pct": worst,
        "decode_wide_cells": len(wide),
        "decode_wide_pipeline_wins": sum(r["best_fixed_pn"] > 1 for r in wide),
        "decode_wide_worst_auto_loss_pct": wide_worst,
    }
    print(json.dumps(summary))
    return 0
