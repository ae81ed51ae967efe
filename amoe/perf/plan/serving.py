"""A deployment as the serving config and back: what `amoe serve` runs of a planned deployment (`to_config`), the
deployment a config serves (`from_config`), a plan's config (`plan_config`: its operating point, policy and wave
group; on emulated GPUs the routing and settings it was predicted under), and the file `amoe plan --out` writes
(`plan_file`: that config with the record of its prediction in a `plan` block, which `amoe serve` logs)."""

from __future__ import annotations

import math
from dataclasses import asdict

from amoe.config import DEFAULT_POLICY, PLAN_KEY, AmoeConfig
from amoe.errors import ConfigError
from amoe.perf.plan.bound_pools import wave_group as bound_wave_group
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.request import BEST, Plan, PlanRequest


def to_config(
    d: Deployment,
    base: AmoeConfig | None = None,
    *,
    max_num_seqs: int | None = None,
    policy: str = DEFAULT_POLICY,
    wave_group: int = 0,
    emulation: dict | None = None,
) -> AmoeConfig:
    """One copy of `d` as the serving config, on `base` (default: the built-in config): its mode, runtimes, batch
    caps, micro-batches, expert map and EP pipeline, `max_num_seqs` requests per attention rank (None: base's),
    the scheduling `policy` and `wave_group`. `emulation`: the emulated executor's settings beyond the GPUs
    (profile, routing, decode_only, ...): given, the config runs on emulated GPUs of `d`'s types and nodes. A
    server serves one copy; `d.replicas` copies are that many servers behind one load balancer."""
    if d.redundant_experts or d.two_batch_overlap:
        raise ConfigError(
            f"{describe(d)}: EPLB's redundant experts and two-batch overlap are modelled, not served"
        )
    ep = d.mode == "ep"
    parallel = {
        "mode": d.mode,
        "attn_ranks": d.num_attn,
        "expert_map": None if d.expert_map is None else ",".join(map(str, d.expert_map)),
        "ep_pipelines": (str(d.ep_pipelines) if d.ep_pipelines else "auto") if d.pipelined else None,
        "ep_kernel": (d.ep_kernel or None) if d.pipelined else None,
    }
    if not ep:
        parallel["expert_ranks"] = d.num_expert
    if d.mode == "pingpong":
        parallel["micro_batches"] = d.micro_batches
    scheduler = {
        "attn_batch_cap": d.attn_cap,
        "expert_batch_cap": d.expert_cap,
        "policy": policy,
        "wave_group": wave_group,
    }
    sections = {"parallel": parallel, "scheduler": scheduler}
    if max_num_seqs is not None:
        sections["cache"] = {"max_num_seqs": max_num_seqs}
    if emulation is not None:
        expert_gpu = d.expert_gpu if not ep and d.expert_gpu != d.attn_gpu else ""
        gpus = {"gpu": d.attn_gpu, "expert_gpu": expert_gpu, "gpus_per_node": d.gpus_per_node}
        sections |= {"executor": {"kind": "emulated"}, "emulation": {**emulation, **gpus}}
    return (base or AmoeConfig()).replace(**sections)


def from_config(config: AmoeConfig) -> Deployment:
    """The deployment `config` serves (one copy). Its GPU types are the emulation section's: what an emulated
    server runs on (a real one runs on the GPUs it has); emulation.gpus_per_node 0 (one node) is one copy's GPUs."""
    par, sched, em = config.parallel, config.scheduler, config.emulation
    if par.mode not in ("aep", "ep", "pingpong"):
        raise ConfigError(
            f"--parallel {par.mode} is no deployment of runtimes: the planner plans aep, ep, pingpong"
        )
    ep = par.mode == "ep"
    num_expert = 0 if ep else par.expert_ranks
    pipelines = par.pipelines
    return Deployment(
        par.mode,
        em.gpu,
        par.attn_ranks,
        "" if ep else em.expert_gpu or em.gpu,
        num_expert,
        attn_cap=sched.attn_batch_cap,
        expert_cap=sched.expert_batch_cap,
        micro_batches=par.micro_batches if par.mode == "pingpong" else 1,
        expert_map=None if par.expert_map is None else tuple(int(e) for e in par.expert_map.split(",")),
        gpus_per_node=em.gpus_per_node or par.attn_ranks + num_expert,
        ep_pipelines=0 if pipelines is None else pipelines,
        ep_kernel=par.ep_kernel or "",
    )


def plan_policy(plan: Plan, req: PlanRequest) -> str:
    """The policy an AEP plan is served with: the one its figure was simulated with (refine's record; a bound-only
    plan: the one asked for). EP and ping-pong have no scheduler: the default."""
    if plan.deployment.mode != "aep":
        return DEFAULT_POLICY
    asked = DEFAULT_POLICY if req.aep_policy == BEST else req.aep_policy
    return plan.prediction.extra.get("aep_policy", asked)


def plan_config(plan: Plan, req: PlanRequest, emulated: bool = False) -> AmoeConfig:
    """The config that serves one copy of `plan`: each attention rank holds the requests of the plan's operating
    point (more only lengthens ITL, fewer leaves the experts' batches smaller than predicted); waves keeps
    ceil(max_num_seqs / attention cap) waves a rank, the W the plan was simulated with, and the expert side
    gathers the simulated plan's group of them (else the bound's). `emulated`: on emulated GPUs of the plan's
    types, with the routing, top-k and step-time variance the prediction assumed, decode only (as `amoe bench
    plan-check` runs it); the model is the checkpoint the plan read, else the profile's shapes."""
    d = plan.deployment
    policy = plan_policy(plan, req)
    extra = plan.prediction.extra
    waves = d.mode == "aep" and policy == "waves"
    group = (extra.get("wave_group") or bound_wave_group(extra, d.attn_cap)) if waves else 0
    emulation = None
    if emulated:
        emulation = {
            "profile": None if req.model_dir else req.profile,
            "top_k": req.top_k,
            "routing": req.routing,
            "step_variance": req.step_variance,
            "decode_only": True,
        }
    base = AmoeConfig().replace(model={"path": req.model_dir})
    per_rank = math.ceil(plan.prediction.concurrency / d.replicas / d.num_attn)
    return to_config(d, base, max_num_seqs=per_rank, policy=policy, wave_group=group, emulation=emulation)


# The sections a plan decides, written whole to its file so it does not depend on today's defaults.
_PLAN_SECTIONS = ("model", "parallel", "cache", "scheduler", "executor", "emulation")


def plan_file(plan: Plan, req: PlanRequest, emulated: bool = False) -> dict:
    """What `amoe plan --out FILE` writes: the plan's config (the sections it decides in full, any other change
    from the defaults) and, under `plan`, its record: the deployment, the prediction and one summary line."""
    config = plan_config(plan, req, emulated)
    d, p = plan.deployment, plan.prediction
    copies = f"; this file serves one of its {d.replicas} copies" if d.replicas > 1 else ""
    record = {
        "summary": f"{describe(d)}: {p.tokens_per_s:.0f} tokens/s at ITL {p.itl_s * 1e3:.2f} ms predicted, "
        f"{p.concurrency} requests in flight, bound by {p.bottleneck}{copies}"
        + (" (emulated GPUs: the cost model's, not real ones)" if emulated else ""),
        "emulated": emulated,
        "deployment": asdict(d),
        "prediction": p.to_dict(),
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
        "cost_per_mtok": plan.cost_per_mtok,
        "request": {
            "profile": req.profile, "workload": req.workload, "top_k": req.top_k, "routing": req.routing,
            "step_variance": req.step_variance, "itl_slo_ms": req.itl_slo_ms,
        },
    }  # fmt: skip
    whole = [s for s in _PLAN_SECTIONS if s != "emulation" or emulated]
    return {
        PLAN_KEY: record,
        **config.changes(),
        **{s: asdict(getattr(config, s)) for s in whole},
    }
