"""`amoe plan`'s output and entry: the table it prints (the best plans, the best of each mode, the verdict), the
`amoe serve` command that runs a plan, its JSON, and `main`, which the command runs (amoe.perf.studies.commands
registers it)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from amoe.errors import ConfigError
from amoe.perf.plan.bound_pools import wave_group
from amoe.perf.plan.deployment import describe
from amoe.perf.plan.request import AEP_POLICY, BEST, Plan, PlanRequest, check_policy, parse_gpus, parse_prices
from amoe.perf.plan.search import best_per_mode, search


def serve_command(plan: Plan, req: PlanRequest, model_dir: str = "MODEL_DIR", emulated: bool = False) -> str:
    """The `amoe serve` command line that runs `plan` (emulated: on emulated GPUs of the plan's type, with the
    routing the plan assumed, as `amoe bench plan-check` runs it)."""
    d = plan.deployment
    args = ["amoe", "serve"]
    if emulated:
        where = ["--model", req.model_dir] if req.model_dir else ["--executor-profile", req.profile]
        args += ["--executor", "emulated", *where]
    else:
        args += ["--model", req.model_dir or model_dir]
    if d.mode == "ep":
        args += ["--parallel", "ep", "--attn-ranks", str(d.num_attn)]
        if d.pipelined:
            pn = str(d.ep_pipelines) if d.ep_pipelines else "auto"
            args += ["--ep-pipelines", pn, *(["--ep-kernel", d.ep_kernel] if d.ep_kernel else [])]
    else:
        args += ["--parallel", d.mode, "--attn-ranks", str(d.num_attn), "--expert-ranks", str(d.num_expert)]
    args += ["--scheduler-attn-batch-cap", str(d.attn_cap)]
    # The requests each attention GPU holds at the plan's operating point (one copy's share): more only lengthens
    # ITL, fewer leaves the experts' batches smaller than the prediction assumed.
    per_rank = math.ceil(plan.prediction.concurrency / d.replicas / d.num_attn)
    args += ["--cache-max-num-seqs", str(per_rank)]
    if d.mode == "aep":
        args += ["--scheduler-expert-batch-cap", str(d.expert_cap)]
        # The policy the plan's figure was simulated with (refine's record; a bound-only plan: the one asked for).
        policy = plan.prediction.extra.get(
            "aep_policy", AEP_POLICY if req.aep_policy == BEST else req.aep_policy
        )
        if policy != "defrag":  # `amoe serve`'s default
            # waves keeps ceil(--cache-max-num-seqs / attention cap) waves a rank: the W the plan was simulated with
            args += ["--scheduler", policy]
        # the expert side's groups of those waves: the simulated plan's, else the bound's (item 13)
        if policy == "waves":
            extra = plan.prediction.extra
            group = extra.get("wave_group") or wave_group(extra, d.attn_cap)
            args += ["--scheduler-wave-group", str(group)]
    if d.mode == "pingpong":
        args += ["--parallel-micro-batches", str(d.micro_batches)]
    if d.expert_map is not None:
        args += ["--parallel-expert-map", ",".join(map(str, d.expert_map))]
    if emulated:
        args += ["--gpu", d.attn_gpu, "--routing", req.routing, "--executor-decode-only", "true"]
        if d.mode != "ep" and d.expert_gpu != d.attn_gpu:
            args += ["--expert-gpu", d.expert_gpu]
        if d.num_attn + d.num_expert > d.gpus_per_node:
            # One copy spans hosts: the prediction priced its messages between them at the network's time.
            args += ["--executor-gpus-per-node", str(d.gpus_per_node)]
        if req.top_k is not None:
            args += ["--executor-top-k", str(req.top_k)]
        if req.step_variance != "sourced":  # the emulated executor's default
            args += ["--step-variance", req.step_variance]
    return " ".join(args)


def report(plans: list[Plan], req: PlanRequest, top: int = 5) -> str:
    """The table `amoe plan` prints: the best plans, the best of each mode, the verdict and the commands."""
    if not plans:
        return "no deployment fits: too few GPUs for the model's weights, or the ITL objective is too tight"
    lines = [
        f"{'#':>2} {'deployment':<58} {'tok/s':>9} {'/GPU':>7} {'ITL ms':>7} {'$/Mtok':>7} {'bound by':<9}",
        "-" * 106,
    ]
    best = best_per_mode(plans)
    shown = plans[:top] + [p for p in best.values() if p not in plans[:top]]
    for plan in shown:
        p = plan.prediction
        cost = f"{plan.cost_per_mtok:7.3f}" if plan.cost_per_mtok is not None else f"{'-':>7}"
        rank = f"{plans.index(plan) + 1:>2}"
        mark = " " if p.extra.get("simulated") else "*"
        lines.append(
            f"{rank} {describe(plan.deployment):<58} {p.tokens_per_s:9.0f}{mark}{plan.tokens_per_s_per_gpu:7.0f} "
            f"{p.itl_s * 1e3:7.2f} {cost} {p.bottleneck:<9}"
        )
    if any("*" in line[61:72] for line in lines[2:]):
        lines.append("* the bound only: not refined by the simulation (--simulate-top)")
    winner = plans[0]
    verdict = f"best: {describe(winner.deployment)}"
    if "aep" in best and "ep" in best:
        ratio = best["aep"].prediction.tokens_per_s / best["ep"].prediction.tokens_per_s
        verdict += f"; best AEP / best EP = {ratio:.2f}x" + (
            "" if winner.deployment.mode == "aep" else " (AEP is not the better choice here)"
        )
    lines += ["", verdict, "", "run it:", "  " + serve_command(winner, req)]
    if winner.deployment.replicas > 1:
        lines.append(
            f"  (x{winner.deployment.replicas} such servers, each on its own GPUs, behind one load balancer)"
        )
    lines += ["check it on emulated GPUs:", "  " + serve_command(winner, req, emulated=True)]
    return "\n".join(lines)


def plan_json(plan: Plan, req: PlanRequest) -> dict:
    return {
        "deployment": asdict(plan.deployment),
        "prediction": plan.prediction.to_dict(),
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
        "cost_per_mtok": plan.cost_per_mtok,
        "command": serve_command(plan, req),
        "emulated_command": serve_command(plan, req, emulated=True),
    }


def main(args: argparse.Namespace) -> int:
    """`amoe plan` (amoe.cli)."""
    gpus = parse_gpus(args.gpus)
    model_dir = getattr(args, "model", None)
    req = PlanRequest(
        profile=args.model_profile or Path(model_dir).resolve().name, gpus=gpus, workload=args.workload,
        top_k=args.top_k, routing=args.routing, itl_slo_ms=args.itl_slo_ms, prices=parse_prices(args.price, gpus),
        gpus_per_node=args.gpus_per_node, modes=tuple(args.modes.split(",")), simulate_top=args.simulate_top,
        simulate_per_mode=args.simulate_per_mode, model_dir=model_dir, eps=getattr(args, "eps", False),
        step_variance=getattr(args, "step_variance", "sourced"), refine_retries=getattr(args, "refine_retries", 3),
        aep_policy=check_policy(getattr(args, "aep_policy", AEP_POLICY)),
    )  # fmt: skip
    if req.simulate_top < 0 or req.simulate_per_mode < 0:
        raise ConfigError(
            f"--simulate-top and --simulate-per-mode must be >= 0; got {req.simulate_top}, {req.simulate_per_mode}"
        )
    if req.refine_retries < 0:
        raise ConfigError(f"--refine-retries must be >= 0; got {req.refine_retries}")
    bad = set(req.modes) - {"aep", "ep", "pingpong"}
    if bad:
        raise ConfigError(f"--modes takes aep, ep, pingpong; got {', '.join(sorted(bad))}")
    plans = search(req)
    if args.json:
        print(json.dumps({"request": asdict(req), "plans": [plan_json(p, req) for p in plans[: args.top]]}))
    else:
        print(report(plans, req, args.top))
    return 0 if plans else 1
