"""`amoe plan`'s output and entry: the table it prints (the best plans, the best of each mode, the verdict), the
`amoe serve` command that runs a plan (for people), its JSON, the config file of the best plan (`--out`), and
`main`, which the command runs (amoe.perf.studies.commands registers it)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from amoe.config import DEFAULT_POLICY, command_flags
from amoe.errors import ConfigError
from amoe.perf.plan.deployment import describe
from amoe.perf.plan.request import Plan, PlanRequest, check_policy, parse_gpus, parse_prices
from amoe.perf.plan.search import best_per_mode, search
from amoe.perf.plan.serving import plan_config, plan_file


def serve_command(plan: Plan, req: PlanRequest, model_dir: str = "MODEL_DIR", emulated: bool = False) -> str:
    """The `amoe serve` command line that runs `plan`, for people to read (programs serve the plan's config:
    amoe.perf.plan.serving.plan_config, `amoe plan --out`). `model_dir` stands in for a checkpoint the plan did
    not read; emulated: on emulated GPUs of the plan's type, with the routing the plan assumed."""
    config = plan_config(plan, req, emulated)
    if config.model.path is None and not emulated:
        config = config.replace(model={"path": model_dir})
    d = plan.deployment
    # What the plan decides shows even where it is today's default: the shape, the caps, the requests, the policy.
    shown = ("parallel.mode", "parallel.attn_ranks", "scheduler.attn_batch_cap", "cache.max_num_seqs")
    if d.mode != "ep":
        shown += ("parallel.expert_ranks",)
    if d.mode == "aep":
        shown += ("scheduler.expert_batch_cap", "scheduler.policy")
    if emulated:
        shown += ("emulation.gpu",)
    return " ".join(["amoe", "serve", *command_flags(config, always=shown)])


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


def write_plan(path: str, plan: Plan, req: PlanRequest, emulated: bool) -> None:
    """`--out FILE`: the plan's config file (amoe.perf.plan.serving.plan_file)."""
    try:
        Path(path).write_text(json.dumps(plan_file(plan, req, emulated), indent=1) + "\n")
    except OSError as exc:
        raise ConfigError(f"--out: cannot write {path}: {exc.strerror}") from None


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
        aep_policy=check_policy(getattr(args, "aep_policy", DEFAULT_POLICY)),
    )  # fmt: skip
    if req.simulate_top < 0 or req.simulate_per_mode < 0:
        raise ConfigError(
            f"--simulate-top and --simulate-per-mode must be >= 0; got {req.simulate_top}, {req.simulate_per_mode}"
        )
    if req.refine_retries < 0:
        raise ConfigError(f"--refine-retries must be >= 0; got {req.refine_retries}")
    out = getattr(args, "out", None)
    if getattr(args, "emulated", False) and not out:
        raise ConfigError("--emulated chooses what --out FILE writes: give --out too")
    bad = set(req.modes) - {"aep", "ep", "pingpong"}
    if bad:
        raise ConfigError(f"--modes takes aep, ep, pingpong; got {', '.join(sorted(bad))}")
    plans = search(req)
    if out and plans:
        write_plan(out, plans[0], req, getattr(args, "emulated", False))
    if args.json:
        written = {"out": out} if out and plans else {}
        print(
            json.dumps(
                {"request": asdict(req), "plans": [plan_json(p, req) for p in plans[: args.top]], **written}
            )
        )
    else:
        print(report(plans, req, args.top))
        if out and plans:
            print(f"\nthe best plan's config: {out} (serve it: amoe serve --config {out})")
    return 0 if plans else 1
