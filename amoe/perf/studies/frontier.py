"""`amoe bench frontier`: the cost model and the simulation against published large-scale deployments, with one
frozen calibration for every line (amoe.perf.model.calibrations; `--calibration NAME` an older one).

    amoe bench frontier [--deployments FILE] [--calibration NAME] [--out DIR]
    amoe bench frontier --table [--profiles deepseek-v3,qwen3-235b-a22b] [--sizes 16,32,64,128,256]

--deployments: a JSON-lines file of published deployments (amoe.perf.studies.deployments has the format; default
the built-in amoe/perf/studies/data/deployments.jsonl). Per line it prints the predicted tokens/s per GPU (decode:
output, simulated at scale with the sourced step-time variance; prefill: input, the EP prefill model), the ITL
(decode), the published figure and the ratio predicted / published, and for each ablation line the predicted gain
against the published one; then a final JSON line. Nothing in the model depends on which line it predicts: a line
gives the deployment's shape and workload only. Host overhead "none": the systems decode under CUDA graphs.

--table: the best plan of each mode (AEP, ping-pong, EP as deployed: EPLB + two-batch overlap) per GPU count and
ITL objective, each refined by the simulation (`amoe plan`'s search, one mode at a time), at a 2,000-token mean
context, and the sourced skew rescaled to 128-256 experts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from amoe.perf.model import calibrations
from amoe.perf.model.gpus import apply_calibration
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import ModelProfile, model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA, routing_inclusion
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.studies.deployments import DEFAULT_FILE, PublishedDeployment, load


def default_routing(model: ModelProfile) -> str:
    """The documented rescaling of the Mixtral-measured skew to the model's experts (docs/cost-model.md: λ · 8 /
    E), fixed before any prediction; DeepSeek-V3's auxiliary-loss-free balancing keeps its experts near even."""
    return f"skew-exp:{DEFAULT_LAMBDA * 8 / model.num_experts:g}"


ROUTING = default_routing(model_profile("deepseek-v3"))


def model_of(d: PublishedDeployment) -> ModelProfile:
    """The line's model profile (a name, or the cost profile of a config.json) at its precisions."""
    if d.model.endswith(".json"):
        from amoe.model.config import load_model_config
        from amoe.perf.model.shapes import profile_of

        model = profile_of(load_model_config(Path(d.model).parent), name=Path(d.model).parent.name)
    else:
        model = model_profile(d.model)
    change = {}
    if "attention" in d.precision:
        change["attn_precision"] = d.precision["attention"]
    if "experts" in d.precision:
        change["expert_precision"] = d.precision["experts"]
    return dataclasses.replace(model, **change) if change else model


def deployment_of(d: PublishedDeployment) -> Deployment:
    """The planner's Deployment of a decode line (one copy of the group)."""
    if d.mode == "ep":
        return Deployment(
            "ep", d.gpu, d.ep_size, attn_cap=round(d.batch_per_gpu), gpus_per_node=d.gpus_per_node,
            redundant_experts=d.redundant_experts, two_batch_overlap=d.two_batch_overlap,
            draft_tokens=d.draft_tokens, draft_acceptance=d.acceptance,
        )  # fmt: skip
    return Deployment(
        d.mode, d.gpu, d.attention_gpus, d.gpu, d.expert_gpus, attn_cap=round(d.batch_per_gpu),
        micro_batches=d.micro_batches, gpus_per_node=d.gpus_per_node,
    )  # fmt: skip


def predict(d: PublishedDeployment, seed: int = 0) -> dict:
    """One line's prediction: tokens/s per GPU (and in the published unit), its ratio to the published figure."""
    model = model_of(d)
    routing = d.routing or default_routing(model)
    t0 = time.time()
    if d.phase == "prefill":
        per_gpu, itl_ms, bound = predict_prefill(d, model, routing, seed), None, None
    else:
        per_gpu, itl_ms, bound = predict_decode(d, model, routing, seed)
    per_node = d.published.unit.endswith("per_node")
    predicted = per_gpu * (d.gpus_per_node if per_node else 1)
    return {
        "name": d.name, "phase": d.phase, "gpu": d.gpu, "gpus": d.gpus, "in_sample": d.in_sample,
        "predicted_per_gpu": per_gpu, "predicted": predicted, "unit": d.published.unit,
        "published": d.published.value, "ratio": predicted / d.published.value, "itl_ms": itl_ms,
        "bound_per_gpu": bound, "routing": routing, "seconds": round(time.time() - t0, 1),
    }  # fmt: skip


def predict_decode(d: PublishedDeployment, model: ModelProfile, routing: str, seed: int):
    """(simulated output tokens/s per GPU, ITL ms, the bound's tokens/s per GPU) of a decode line."""
    from amoe.perf.plan.simulate import simulate

    dep, host = deployment_of(d), host_overhead("none")
    q = routing_inclusion(model, routing, seed)
    bound = bounds.predict(model, dep, q, d.kv_length, host)
    group = dep.num_attn + dep.num_expert
    concurrency = round(d.batch_per_gpu * dep.num_attn)
    sim = simulate(
        model, dep, routing, d.kv_length, host, concurrency, duration_s=12 * bound.itl_s, seed=seed
    )
    return sim.tokens_per_s / group, sim.itl_s * 1e3, bound.tokens_per_s / group


def predict_prefill(d: PublishedDeployment, model: ModelProfile, routing: str, seed: int) -> float:
    """Input tokens/s per GPU of a prefill line (amoe.perf.plan.prefill)."""
    from amoe.perf.plan.prefill import prefill_step

    dep = Deployment(
        "ep", d.gpu, d.ep_size, gpus_per_node=d.gpus_per_node, redundant_experts=d.redundant_experts,
        two_batch_overlap=d.two_batch_overlap,
    )  # fmt: skip
    q = routing_inclusion(model, routing, seed)
    return prefill_step(model, dep, q, d.batch_per_gpu, d.prompt_len).tokens_per_s_per_gpu


def ablations(rows: list[dict], lines: list[PublishedDeployment]) -> list[dict]:
    """Each ablation line's predicted gain (its feature's line over it) against the published gain, in points."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for d in lines:
        if d.ablation_of is None:
            continue
        gain = by_name[d.ablation_of]["predicted"] / by_name[d.name]["predicted"]
        out.append({"with": d.ablation_of, "without": d.name, "predicted_gain": gain,
                    "published_gain": d.published_gain,
                    "points": 100 * (gain - d.published_gain)})  # fmt: skip
    return out


def main(args) -> int:
    if getattr(args, "table", False):
        return table_main(args)
    name = getattr(args, "calibration", None) or calibrations.ACTIVE
    apply_calibration(name)
    lines = load(getattr(args, "deployments", None) or DEFAULT_FILE)
    rows = [predict(d) for d in lines]
    gains = ablations(rows, lines)
    print_rows(name, rows, gains)
    result = {"calibration": name, "deployments": rows, "ablations": gains}
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "frontier.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"frontier": result}))
    return 0


def print_rows(name: str, rows: list[dict], gains: list[dict]) -> None:
    print(f"calibration {name} (frozen; the same for every line)")
    print(f"{'deployment':<28} {'phase':<7} {'GPUs':>4} {'pred/GPU':>9} {'predicted':>10} {'published':>10} "
          f"{'ratio':>6} {'ITL ms':>7}  unit")  # fmt: skip
    for r in rows:
        itl = f"{r['itl_ms']:7.1f}" if r["itl_ms"] is not None else f"{'-':>7}"
        mark = " (in-sample)" if r["in_sample"] else ""
        print(f"{r['name']:<28} {r['phase']:<7} {r['gpus']:>4} {r['predicted_per_gpu']:>9.0f} "
              f"{r['predicted']:>10.0f} {r['published']:>10.0f} {r['ratio']:>6.3f} {itl}  {r['unit']}{mark}")  # fmt: skip
    for g in gains:
        print(f"ablation {g['with']} over {g['without']}: predicted {g['predicted_gain']:.3f}x, published "
              f"{g['published_gain']:.3f}x ({g['points']:+.1f} points)")  # fmt: skip


TABLE_SIZES = (16, 32, 64, 128, 256)
TABLE_SLOS_MS = (50.0, 100.0)
TABLE_CONTEXT = 2000.0


def table_cell(profile: str, gpu: str, n: int, mode: str, slo_ms: float) -> dict:
    """The best plan of `mode` on n GPUs under the ITL objective, refined by the simulation."""
    from amoe.perf.plan.deployment import describe
    from amoe.perf.plan.request import PlanRequest
    from amoe.perf.plan.search import search

    experts = model_profile(profile).num_experts
    req = PlanRequest(
        profile, {gpu: n}, routing=f"skew-exp:{DEFAULT_LAMBDA * 8 / experts:g}", itl_slo_ms=slo_ms, host="none",
        modes=(mode,), attn_caps=(128, 512), expert_caps=(1024,), simulate_top=1, simulate_per_mode=1,
        context=TABLE_CONTEXT, ep_redundant_experts=32,
    )  # fmt: skip
    t0 = time.time()
    plans = search(req)
    cell = {"profile": profile, "gpu": gpu, "gpus": n, "mode": mode, "itl_slo_ms": slo_ms, "wall_s": 0.0}
    if plans:
        p = plans[0]
        cell |= {
            "plan": describe(p.deployment), "tokens_per_s": round(p.prediction.tokens_per_s),
            "per_gpu": round(p.prediction.tokens_per_s / n), "itl_ms": round(p.prediction.itl_s * 1e3, 1),
            "concurrency": p.prediction.concurrency, "simulated": bool(p.prediction.extra.get("simulated")),
            "bound": round(p.prediction.extra.get("bound", p.prediction.tokens_per_s)),
        }  # fmt: skip
    cell["wall_s"] = round(time.time() - t0, 1)
    return cell


def table_main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = [m for m in getattr(args, "modes", "aep,pingpong,ep").split(",") if m]
    if not modes or set(modes) - {"aep", "pingpong", "ep"}:
        raise SystemExit(f"amoe bench frontier: --modes takes aep, pingpong, ep (got {args.modes!r})")
    for profile in args.profiles.split(","):
        for slo in TABLE_SLOS_MS:
            for n in sizes:
                for mode in modes:
                    cell = table_cell(profile, args.gpu, n, mode, slo)
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
                    (out / "table.jsonl").open("a").write(json.dumps(cell) + "\n")
    print(f"{'profile':<16} {'ITL':>4} {'GPUs':>5} {'AEP /GPU':>9} {'ping-pong':>9} {'EP /GPU':>9}  best")
    for profile in args.profiles.split(","):
        for slo in TABLE_SLOS_MS:
            for n in sizes:
                row = {
                    c["mode"]: c
                    for c in cells
                    if (c["profile"], c["itl_slo_ms"], c["gpus"]) == (profile, slo, n)
                }
                per = {m: row.get(m, {}).get("per_gpu", 0) for m in ("aep", "pingpong", "ep")}
                print(f"{profile:<16} {slo:>4.0f} {n:>5} {per['aep']:>9} {per['pingpong']:>9} {per['ep']:>9}  "
                      f"{max(per, key=per.get) if any(per.values()) else '-'}")  # fmt: skip
    print(json.dumps({"frontier_table": [{k: c.get(k) for k in ("profile", "itl_slo_ms", "gpus", "mode",
                                                                "per_gpu", "simulated")} for c in cells]}))  # fmt: skip
    return 0
