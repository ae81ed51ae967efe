"""Recorded measurements of AEP against the simulation's prediction of the same plan at the same requests, as the
code that runs this predicts it (run from the repository root, once on the commit before a change to the simulation
and once after). Nothing here is fitted: the measurements are read from their files, the plans and requests are the
recorded ones, the prediction is amoe.perf.plan.refine (what `amoe bench plan-check` and `plan-table --measure`
compare against) or, for waves-emulated's plans, amoe.perf.plan.simulate at the bound's requests. The recorded runs
are read from their experiments/ folders (the flags name other copies):

    amoe bench repredict [sample] [table_100ms] [waves_32] > OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from amoe.config import SchedulerSection
from amoe.errors import ConfigError
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.refine import refine
from amoe.perf.plan.simulate import simulate
from amoe.perf.studies import plan_check as pc
from amoe.perf.studies.waves_emulated import BLOCKS, PLANS, ROUTING

HOST, CTX = host_overhead("amoe-paper"), mean_context("short")


def line(**kw):
    print(json.dumps(kw), flush=True)


def table_100ms(args: argparse.Namespace) -> None:
    """The 100 ms table's AEP plans (m32): each cell's plan at its requests, waves, 32 blocks, two measured runs."""
    runs = [
        json.loads((Path(d) / "plan_table.json").read_text())["rows"] for d in args.table_100ms.split(",")
    ]
    for row, again in zip(*runs):
        aep = row["aep"]
        dep = Deployment(**aep["deployment"])
        model = model_profile("mixtral-8x7b-mqa", row["top_k"])
        copy = aep["concurrency"] // dep.replicas
        p = refine(model, dep, row["routing"], CTX, HOST, concurrency=copy, policy="waves").prediction
        line(
            set="100ms",
            cell=f"{row['gpu']} top{row['top_k']}",
            plan=aep["plan"],
            concurrency=aep["concurrency"],
            recorded_prediction=aep["tokens_per_s"],
            prediction=round(p.tokens_per_s),
            measured=[aep["measured"], again["aep"]["measured"]],
            measured_over_prediction=[
                round(m / p.tokens_per_s, 3) for m in (aep["measured"], again["aep"]["measured"])
            ],
        )


def waves_32(args: argparse.Namespace) -> None:
    """waves-emulated's seven plans at the bound's requests, their three recorded runs (rounds.jsonl, plan6.jsonl)."""
    got = {}
    for path in args.waves_32.split(","):
        for text in Path(path).read_text().splitlines():
            r = json.loads(text)
            got.setdefault(r["plan"], []).append(r["of_bound"])
    for gpu, k, a, e, cap, ecap in PLANS:
        model = model_profile(f"mixtral-8x7b-mqa:{BLOCKS}", k)
        dep = Deployment("aep", gpu, a, gpu, e, cap, ecap)
        bound = bounds.predict(model, dep, routing_inclusion(model, ROUTING), CTX, HOST)
        name = f"aep {a}+{e} {gpu} top{k} cap {cap}/{ecap}"
        sched = SchedulerSection(policy="waves", attn_batch_cap=cap, expert_batch_cap=ecap)
        sims = {}
        for stagger in (False, True):
            s = simulate(
                model,
                dep,
                ROUTING,
                CTX,
                HOST,
                bound.concurrency,
                warmup_s=4 * bound.itl_s,
                duration_s=8 * bound.itl_s,
                scheduler=sched,
                stagger_ranks=stagger,
            )
            sims["staggered" if stagger else "together"] = round(s.tokens_per_s / bound.tokens_per_s, 3)
        runs = got.get(name, [])
        line(
            set="waves32",
            plan=name,
            bound=round(bound.tokens_per_s),
            concurrency=bound.concurrency,
            simulated_of_bound=sims,
            measured_of_bound=runs,
            measured_mean=round(sum(runs) / len(runs), 3) if runs else None,
        )


def sample(args: argparse.Namespace) -> None:
    """The out-of-sample check on seed 20261127 (4 blocks, defrag, as recorded): its AEP plans."""
    rec = json.loads(Path(args.sample).read_text())
    preset = pc.CheckPreset(
        checks=(),
        blocks=4,
        duration_s=1.0,
        time_scale=40.0,
        overload=2.0,
        tolerance=0.10,
        aep_policy="defrag",
    )
    for check, r in zip(pc.sample_checks(rec["summary"]["seed"]), rec["plans"]):
        if check.deployment.mode != "aep":
            continue
        model = model_profile(f"{check.profile}:{preset.blocks}", check.top_k)
        p = refine(
            model, check.deployment, check.routing, CTX, HOST, concurrency=r["concurrency"], policy="defrag"
        ).prediction
        line(
            set="sample20261127",
            plan=r["plan"],
            top_k=check.top_k,
            concurrency=r["concurrency"],
            recorded_prediction=round(r["predicted"]),
            prediction=round(p.tokens_per_s),
            measured=round(r["measured"]),
            measured_over_prediction=round(r["measured"] / p.tokens_per_s, 3),
        )


PARTS = {"sample": sample, "table_100ms": table_100ms, "waves_32": waves_32}


def main(args: argparse.Namespace) -> int:
    """`amoe bench repredict [PART ...]` (its flags: amoe.perf.studies.commands)."""
    if unknown := [p for p in args.parts if p not in PARTS]:
        raise ConfigError(f"repredict: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    for part in args.parts or list(PARTS):
        PARTS[part](args)
    return 0
