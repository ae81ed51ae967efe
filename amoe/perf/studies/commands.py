"""Every command of the modelling wing, registered from here (`add_commands`): `amoe plan`, and the studies under
`amoe bench` — compare, plan-check, plan-table, plan-scale, policies, eps, frontier and the others: the planner's
predictions, tabled and checked against the emulated runtime, the scheduling policies compared on it, published
figures reproduced. Only argparse-level code here (`amoe --help` stays light, no torch); each command imports its
module when it runs."""

from __future__ import annotations

import argparse
import datetime
import importlib
from typing import Any

from amoe.config import DEFAULT_POLICY, POLICIES
from amoe.perf.model.routing import DEFAULT_LAMBDA

# amoe.perf.studies.plan_check.PRESETS' names (listed here so that `--help` imports nothing heavy; a test keeps them equal).
PLAN_CHECK_PRESETS = ("ci", "depth", "full", "scale32", "variance")
OUT_OF_SAMPLE = "sample"  # plans drawn from --seed (amoe.perf.studies.plan_check.sample_checks)


def dated_out(topic: str) -> str:
    """A study's default --out: a new run folder experiments/<today, UTC>-<topic>, where run data lives (docs/
    holds the manual only)."""
    return f"experiments/{datetime.datetime.now(datetime.timezone.utc).date().isoformat()}-{topic}"


def add_bench_compare_command(sub: Any) -> None:
    p = sub.add_parser(
        "compare", help="AEP vs EP (and scheduler policies) on emulated GPUs: sweeps, plots, ratios"
    )
    p.add_argument("--preset", default="quick", help="ci (~1 min) | quick (< 10 min) | full (default: quick)")
    p.add_argument("--out", default="compare-results", metavar="DIR", help="results.json and PNGs go here")
    p.add_argument(
        "--time-scale", type=float, help="wall seconds per emulated second (default: the preset's)"
    )
    p.add_argument("--duration", type=float, help="emulated seconds of arrivals per load point (preset's)")
    p.add_argument("--blocks", type=int, help="keep this many blocks of the model profile (preset's)")
    p.add_argument("--attn-cap", type=int, help="attention batch cap in rows (preset's)")
    p.add_argument(
        "--loads", help="comma-separated load points as fractions of the upper bound's rate (preset's)"
    )
    p.add_argument("--seed", type=int, default=0, help="routing, arrivals and workload seed (default: 0)")
    p.add_argument(
        "--repeats", type=int, default=1,
        help="run the preset N times; each headline figure is the median, with its spread (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--groups",
        help="run only these comma-separated setup groups of the preset (main, top2, medium, 16gpu)",
    )
    p.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from amoe.perf.studies import compare

    return compare.run_bench_compare(args)


def add_bench_plan_check_command(sub: Any) -> None:
    p = sub.add_parser(
        "plan-check",
        help="run the planner's plans on the emulated runtime and compare measured with predicted",
    )
    p.add_argument("--preset", default="full", choices=(*PLAN_CHECK_PRESETS, OUT_OF_SAMPLE))
    p.add_argument(
        "--seed", type=int, default=None, help="--preset sample: the seed its 8 plans are drawn from"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per plan; the median is reported")
    p.add_argument("--out", default=None, help="write plan_check.json here")
    p.add_argument("--only", default=None, help="run only the plans of these modes, e.g. ep,pingpong")
    p.add_argument("--match", default=None, help="run only the plans whose description contains this")
    p.add_argument(
        "--fill", default="steady", choices=("steady", "poisson"),
        help="steady: the plan's requests at once, measured over ITLs (default); poisson: arrivals above its rate",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="the preset's time scale on the reference host (stretched by the host probe as usual); a larger one "
        "shrinks the host's scheduling delays against the emulated steps, which a barrier pays",
    )  # fmt: skip
    _step_variance(p)
    add_aep_policy(p)
    p.set_defaults(run=run_plan_check)


def add_bench_plan_table_command(sub: Any) -> None:
    p = sub.add_parser(
        "plan-table", help="the planner's best plan of each mode per GPU type, size, top-k, routing"
    )
    p.add_argument("--gpus", default="a100-80g,h100,h200")
    p.add_argument("--sizes", default="8,16")
    p.add_argument("--top-k", default="1,2")
    p.add_argument(
        "--routings", default=None, help="';'-separated routing specs (default: the three of the table)"
    )
    p.add_argument("--profile", default="mixtral-8x7b-mqa")
    p.add_argument("--out", default=dated_out("plan-table"), help="default: experiments/DATE-plan-table")
    p.add_argument("--jobs", type=int, default=1, help="cells planned at once, one process each")
    p.add_argument("--itl-slo-ms", type=float, default=None, help="the planner's ITL objective")
    p.add_argument(
        "--measure", action="store_true", help="also run each cell's plans on the emulated runtime (slow)"
    )
    p.add_argument(
        "--report-measured", action="store_true",
        help="with --measure: report the points measured.jsonl holds, run none (the rest stay predictions)",
    )  # fmt: skip
    p.add_argument(
        "--measure-modes", default=None, metavar="MODES",
        help="with --measure: run only these modes' plans (e.g. aep,ep), the others read from measured.jsonl",
    )  # fmt: skip
    p.add_argument(
        "--measure-rows", default=None, metavar="I,J",
        help="with --measure: run only these rows (0-based, the table's order), the others read from measured.jsonl",
    )  # fmt: skip
    p.add_argument(
        "--plans", default=None, metavar="JSON",
        help="take the rows (and their plans) of this earlier plan_table.json instead of planning them again",
    )  # fmt: skip
    p.add_argument(
        "--figure10", action="store_true", help="only the Figure 10 setup (16 experts, 8 vs 16 GPUs)"
    )
    p.add_argument(
        "--time-scale", type=float, default=40.0,
        help="with --measure: the time scale on the reference host, stretched by the host probe (default 40); a "
        "larger one shrinks the host's own delays against the emulated steps, at that many times the wall time",
    )  # fmt: skip
    _step_variance(p)
    add_aep_policy(p)
    p.set_defaults(run=run_plan_table)


def add_bench_plan_scale_command(sub: Any) -> None:
    p = sub.add_parser("plan-scale", help="predicted throughput per GPU against cluster size, AEP against EP")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--profile", default="mixtral-8x7b-16e")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument(
        "--routing", default=None, help="the skew the plans assume (default: the sourced skew-exp)"
    )
    p.add_argument("--itl-slo-ms", type=float, default=None)
    p.add_argument("--out", default=dated_out("plan-scale"), help="default: experiments/DATE-plan-scale")
    p.add_argument("--simulate", action="store_true", help="refine each best plan by the simulation")
    p.set_defaults(run=run_plan_scale)


def add_bench_frontier_command(sub: Any) -> None:
    p = sub.add_parser(
        "frontier",
        help="the model's predictions of published deployments (a JSON-lines file) with one frozen calibration",
    )
    p.add_argument(
        "--out",
        default=dated_out("frontier"),
        metavar="DIR",
        help="write frontier.json (and --table's table.jsonl) here (default: experiments/DATE-frontier)",
    )
    p.add_argument(
        "--deployments",
        default=None,
        metavar="FILE",
        help="published deployments, one JSON object a line (default: the built-in file; format: docs/deployments.md)",
    )
    p.add_argument(
        "--calibration", default=None, metavar="NAME", help="a dated calibration (default: the active one)"
    )
    p.add_argument(
        "--table", action="store_true", help="AEP, ping-pong and EP at 16-256 GPUs under 50/100 ms ITL"
    )
    p.add_argument("--profiles", default="deepseek-v3,qwen3-235b-a22b")
    p.add_argument("--gpu", default="h800")
    p.add_argument("--sizes", default="16,32,64,128,256")
    p.add_argument(
        "--modes", default="aep,pingpong,ep", help="the table's modes (default: all three; comma-separated)"
    )
    p.add_argument(
        "--workload", default=None, metavar="TRACE",
        help="--table on a request trace (azure-conv | azure-code | a CSV): each rank's steps from its own requests, "
        "AEP's policy the best of waves and defrag per plan, each barrier mode's tax against it perfectly balanced "
        "(default: every request at the published deployments' 2,000-token mean context)",
    )  # fmt: skip
    p.add_argument(
        "--report",
        default=None,
        metavar="JSONL",
        help="--table: reprint a recorded table.jsonl, plan nothing",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="the misses explained per decode layer against DeepSeek's profile and SGLang's breakdown",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="with --breakdown: a Chrome trace (e.g. profile-data's decode.json) to sum",
    )
    p.set_defaults(run=run_frontier)


def run_frontier(args: argparse.Namespace) -> int:
    from amoe.errors import ConfigError

    if getattr(args, "table", False) and not args.out:
        args.out = "frontier-table"
    try:
        if getattr(args, "breakdown", False) or getattr(args, "trace", None):
            from amoe.perf.studies import frontier_trace

            return frontier_trace.main(args)
        from amoe.perf.studies import frontier

        return frontier.main(args)
    except (ValueError, ConfigError) as exc:  # a bad deployments line or trace: one line
        raise SystemExit(f"amoe bench frontier: {exc}") from None


def add_bench_calibration_command(sub: Any) -> None:
    p = sub.add_parser(
        "calibration",
        help="a calibration's constants derived again from its sources, and the model against DeepSeek's profiles",
    )
    p.add_argument("--name", default=None, help="a dated calibration (default: the active one)")
    p.set_defaults(run=_runner("calibration_derive"))


def add_bench_policies_command(sub: Any) -> None:
    p = sub.add_parser(
        "policies", help="the scheduling policies on an emulated AEP deployment under Poisson arrivals"
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated (default: all four, {','.join(POLICIES)})",
    )
    p.add_argument("--blocks", type=int, default=8, help="blocks of the model profile kept (default: 8)")
    p.add_argument(
        "--loads", default="0.5,1.3", help="request rates as fractions of the bound's; must include 0.5"
    )
    p.add_argument(
        "--duration", type=float, default=4.0,
        help="emulated seconds of arrivals per point (default 4: the overload point fills its ranks in ~2)",
    )  # fmt: skip
    p.add_argument(
        "--half-duration", type=float, default=5.5,
        help="emulated seconds of arrivals of the half-load point, measured after its first 1.5 (default 5.5)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="requests each rank holds (default: the planner's concurrency for the deployment; 0: no cap)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=25.0, help="on the reference host; stretched by a probe"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs, each with its own seed (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="the first run's arrival and routing seed")
    p.add_argument("--out", default=dated_out("policies"), help="default: experiments/DATE-policies")
    p.add_argument(
        "--report", default=None, metavar="JSON", help="summarise a recorded policies.json again; run nothing"
    )
    _step_variance(p)
    p.set_defaults(run=run_policies)


def add_aep_policy(p: argparse.ArgumentParser) -> None:
    """`--aep-policy` (default amoe.config.DEFAULT_POLICY; checked by amoe.perf.plan.request.check_policy against
    amoe.config.POLICIES, so that `--help` imports nothing heavy)."""
    p.add_argument(
        "--aep-policy", default=DEFAULT_POLICY, metavar="POLICY",
        help="the scheduling policy AEP plans are simulated, measured and served with (`amoe serve --scheduler`): "
        f"{' | '.join(POLICIES)} | best (each plan simulated with waves and with defrag, served with the one that "
        f"gives more within --itl-slo-ms); default {DEFAULT_POLICY}",
    )  # fmt: skip


def _step_variance(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-variance", default="sourced", metavar="V",
        help="the emulated GPUs' speed spread and step jitter, in the runs and the predictions: "
        "sourced (default) | off | SPREAD[,jitter=J][,seed=N]",
    )  # fmt: skip


def run_policies(args: argparse.Namespace) -> int:
    from amoe.perf.studies import policy_bench

    return policy_bench.main(args)


def run_plan_check(args: argparse.Namespace) -> int:
    from amoe.perf.studies import plan_check

    return plan_check.main(args)


def run_plan_table(args: argparse.Namespace) -> int:
    from amoe.perf.studies import plan_table

    return plan_table.main(args)


def run_plan_scale(args: argparse.Namespace) -> int:
    from amoe.perf.studies import plan_scale

    return plan_scale.main(args)


def add_bench_eps_command(sub: Any) -> None:
    p = sub.add_parser(
        "eps", help="EPS-MoE's Tables II and III, N* and decode auto PN against the cost model"
    )
    p.add_argument("--fit", action="store_true", help="refit the h800 curves to Table II's PN 1 rows first")
    p.add_argument("--gpus", default="a100-80g,h100,h200", help="the planner's table's GPUs (decode check)")
    p.add_argument("--sizes", default="8,16", help="the planner's table's pool sizes (decode check)")
    p.add_argument("--top-k", default="1,2", help="the planner's table's top-k (decode check)")
    p.set_defaults(run=run_eps)


def run_eps(args: argparse.Namespace) -> int:
    from amoe.perf.studies import eps_bench

    return eps_bench.main(args)


def add_plan_command(sub: Any) -> None:
    p = sub.add_parser("plan", help="search deployments (AEP splits, EP, ping-pong) and print the best")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-profile", metavar="P", help="named model shapes (mixtral-8x7b-mqa, ...)")
    which.add_argument(
        "--model", metavar="DIR", help="a checkpoint: the shapes of its config.json (any family)"
    )
    p.add_argument(
        "--gpus", required=True, metavar="TYPE:N[,...]", help="GPUs at hand, e.g. a100-80g:8,h100:4"
    )
    p.add_argument(
        "--price", metavar="TYPE=$/h[,...]", help="$ per GPU-hour: rank by cost per million tokens"
    )
    p.add_argument(
        "--workload", default="short",
        help="short | medium | reasonable (the paper's), or a request trace: azure-conv | azure-code | a CSV of "
        "arrival_s,input_tokens,output_tokens (each rank's steps from its own requests; default: short)",
    )  # fmt: skip
    p.add_argument("--top-k", type=int, help="override the profile's top-k")
    p.add_argument(
        "--routing", default=f"skew-exp:{DEFAULT_LAMBDA:g}", help="skew the plan assumes (skew-exp:λ[,rho=ρ])"
    )
    p.add_argument("--itl-slo-ms", type=float, help="drop deployments whose ITL exceeds this")
    p.add_argument(
        "--step-variance", default="sourced", metavar="V",
        help="GPUs' speed spread and step jitter the plans assume: sourced | off | SPREAD[,jitter=J][,seed=N]",
    )  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default: 8)")
    add_aep_policy(p)
    p.add_argument("--modes", default="aep,ep,pingpong", help="which modes to search (default: all)")
    p.add_argument("--top", type=int, default=5, help="plans to print (default: 5)")
    p.add_argument(
        "--simulate-top", type=int, default=3,
        help="refine this many of the best plans by simulation (default: 3; 0: bounds only, no refinement at all)",
    )  # fmt: skip
    p.add_argument(
        "--simulate-per-mode", type=int, default=3,
        help="also refine, of each mode, the best plan of its best N shapes (GPUs per role, copies; default: 3)",
    )  # fmt: skip
    p.add_argument(
        "--refine-retries", type=int, default=3,
        help="of a mode whose refined plans all miss --itl-slo-ms, refine up to N of its next plans (default: 3)",
    )  # fmt: skip
    p.add_argument(
        "--eps", action="store_true",
        help="EP with EPS-MoE's expert pipeline (--ep-pipelines auto --ep-kernel auto), PN and kernel by load",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument(
        "--out", metavar="FILE",
        help="write the best plan as a config file (`amoe serve --config FILE` serves it; its `plan` block records "
        "the prediction)",
    )  # fmt: skip
    p.add_argument(
        "--emulated", action="store_true",
        help="with --out: the plan on emulated GPUs of its types, as `amoe bench plan-check` runs it",
    )  # fmt: skip
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from amoe.perf.plan.report import main as plan_main

    return plan_main(args)


def add_bench_policies_sim_command(sub: Any) -> None:
    p = sub.add_parser(
        "policies-sim", help="the scheduling policies in the simulation of three AEP plans at full depth"
    )
    p.add_argument("policies", nargs="*", metavar="POLICY", help="only these policies (default: every one)")
    p.add_argument("--stagger", action="store_true", help="each attention rank starts at its own time")
    p.add_argument(
        "--no-rank-barrier",
        action="store_true",
        help="waves' expert side without the rank barrier (comparison)",
    )
    p.set_defaults(run=_runner("policies_sim"))


def add_bench_waves_emulated_command(sub: Any) -> None:
    p = sub.add_parser(
        "waves-emulated",
        help="AEP plans at 32 blocks on the emulated runtime under a policy, against the bound",
    )
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES)
    p.add_argument("--plans", default="0,1,2", help="indices into waves_emulated.PLANS, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wave-group", type=int, default=-1,
        help="waves: the expert side's wave group (docs/scheduler.md \"Group cells\"); -1 (default): the bound's, as "
        "the plan's command sets it; 0: per rank (the straggler wait and the meeting block)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="every plan's time scale (before the tokens-per-wall-second floor), the same in every invocation "
        "(default: the recorded runs' one); 0: the preset's, stretched by the host probe read once at the start",
    )  # fmt: skip
    p.set_defaults(run=_runner("waves_emulated"))


def add_bench_waves_sim_command(sub: Any) -> None:
    p = sub.add_parser(
        "waves-sim", help="waves-emulated's plans in the simulation under waves, with a wave group"
    )
    p.add_argument("plans", help="indices into waves_emulated.PLANS, comma-separated")
    p.add_argument("mults", nargs="?", default="1", help="multiples of the bound's requests (default: 1)")
    p.add_argument(
        "group", nargs="?", default="bound", help="the wave group: bound (default) or N (0: per rank)"
    )
    p.set_defaults(run=_runner("waves_sim"))


def add_bench_aep_unmerged_command(sub: Any) -> None:
    p = sub.add_parser(
        "aep-unmerged", help="AEP's bound when no two ranks share an expert step, beside the merged bound"
    )
    p.add_argument(
        "--itl-slo-ms", type=float, default=None, help="the 100 ms table's plans (default: waves32's)"
    )
    p.set_defaults(run=_runner("aep_unmerged"))


def add_bench_repredict_command(sub: Any) -> None:
    p = sub.add_parser(
        "repredict", help="recorded AEP measurements against the simulation's prediction by the code at hand"
    )
    p.add_argument(
        "parts", nargs="*", metavar="PART", help="sample | table_100ms | waves_32 (default: all three)"
    )
    p.add_argument(
        "--sample", default="experiments/2026-11-27-plan-check-sample/seed-20261127/plan_check.json",
        help="the out-of-sample plan check's plan_check.json",
    )  # fmt: skip
    p.add_argument(
        "--table-100ms",
        default="experiments/2026-11-27-itl-100ms-waves/100_measured,experiments/2026-11-27-itl-100ms-waves/100_measured_repeat",
        help="the two measured 100 ms tables' folders (each with its plan_table.json), comma-separated",
    )  # fmt: skip
    p.add_argument(
        "--waves-32",
        default="experiments/2026-11-27-waves-three-runs/rounds.jsonl,experiments/2026-11-27-waves-three-runs/plan6.jsonl",
        help="waves-emulated's recorded runs (JSON lines), comma-separated",
    )  # fmt: skip
    p.set_defaults(run=_runner("repredict"))


def add_bench_variance_same_plans_command(sub: Any) -> None:
    p = sub.add_parser(
        "variance-same-plans",
        help="each frontier-table cell's plan simulated without and with step-time variance",
    )
    p.add_argument("table", metavar="TABLE", help="`amoe bench frontier --table` JSON lines")
    p.set_defaults(run=_runner("variance_same_plans"))


def add_bench_offload_replay_command(sub: Any) -> None:
    p = sub.add_parser(
        "offload-replay", help="expert offloading by trace replay (MoE-Infinity) and on emulated A5000 tiers"
    )
    p.add_argument("--quick", action="store_true", help="fewer sequences (a smoke run)")
    p.add_argument(
        "--parts", default=None,
        help="comma-separated, of statistics, hit, recall, blocks, latency, mixtral (default: all)",
    )  # fmt: skip
    p.add_argument("--routing", help="replay a routing file the server recorded instead of the model")
    p.add_argument("--capacity", type=int, help="with --routing: experts the cache holds")
    p.add_argument("--expert-bytes", type=float, default=33554432, help="with --routing: bytes per expert")
    p.add_argument(
        "--enc-dec", action="store_true",
        help="the shapes as encoder-decoder: encoder blocks routed once, at prefill (docs/offload-policy.md)",
    )  # fmt: skip
    p.set_defaults(run=_runner("offload_replay"))


def add_bench_offload_locality_command(sub: Any) -> None:
    p = sub.add_parser(
        "offload-locality",
        help="the routing model's access locality set from the paper's ORACLE (Bélády only)",
    )
    p.add_argument("--models", default=None, help="comma-separated shapes (default: both)")
    p.add_argument(
        "--bound", action="store_true", help="the per-batch floor under Bélády instead of the search"
    )
    p.add_argument("--lengths", action="store_true", help="Bélády with generated lengths 1-20 (exploratory)")
    p.add_argument(
        "--enc-dec", action="store_true", help="the sourced constants on the encoder-decoder shapes"
    )
    p.set_defaults(run=_runner("offload_locality"))


def add_bench_barrier_tax_command(sub: Any) -> None:
    p = sub.add_parser(
        "barrier-tax",
        help="EP's barrier tax on a request trace: the simulation against the emulated runtime at 8 and 16 GPUs",
    )
    p.add_argument(
        "--sizes", default="8,16", help="EP sizes (emulated GPUs), comma-separated (default: 8,16)"
    )
    p.add_argument(
        "--trace", default="azure-conv", help="azure-conv | azure-code | a CSV of arrival_s,input,output"
    )
    p.add_argument("--seed", type=int, default=0, help="the trace's steady state, routing and starting point")
    p.add_argument(
        "--simulate-only", action="store_true", help="the simulation's figures only; start no server"
    )
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="the time scale on the reference host, stretched by the host probe (default: 400, RULES.md's)",
    )  # fmt: skip
    p.add_argument("--out", default=None, metavar="DIR", help="write barrier_tax.jsonl here")
    p.set_defaults(run=_runner("barrier_tax"))


def add_bench_trace_derive_command(sub: Any) -> None:
    p = sub.add_parser(
        "trace-derive", help="a published request trace (Azure LLM inference CSV) as amoe's trace file"
    )
    p.add_argument("source", help="data/AzureLLMInferenceTrace_*.csv of github.com/Azure/AzurePublicDataset")
    p.add_argument("out", help="the derived file (arrival_s, input_tokens, output_tokens; gzip)")
    p.set_defaults(run=_runner("trace_derive"))


def add_bench_drift_command(sub: Any) -> None:
    p = sub.add_parser(
        "drift",
        help="the hot experts move mid-run: static placement, live rebalancing and stop-the-world side by side",
    )
    p.add_argument(
        "--out", default=dated_out("drift"), help="drift.json and drift.png (default: experiments/DATE-drift)"
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated, of static, live, reference, stop-the-world, ep-reference (default: all)",
    )
    p.add_argument("--seed", type=int, default=None, help="routing seed (default 0)")
    p.add_argument(
        "--time-scale", type=float, default=None, help="wall seconds per emulated second (default 4)"
    )
    p.add_argument("--streams", type=int, default=None, help="requests in flight (default 128)")
    p.add_argument("--profile", default=None, help="model profile, NAME:BLOCKS (default mixtral-8x7b-mqa:2)")
    p.add_argument("--gpu", default=None, help="emulated GPU (default a100-80g)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="mean prompt tokens, spread ±50 %% by request id (default 256)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="mean output tokens, spread ±50 %% by request id (default 8)",
    )
    p.add_argument("--batch-rows", type=int, default=None, help="rows per attention batch (default 1024)")
    p.add_argument(
        "--step-interval", type=int, default=None, help="steps between periodic rebalances (default 64)"
    )
    p.add_argument(
        "--window-size", type=int, default=None, help="steps of load a rebalance reads (default 32)"
    )
    p.add_argument(
        "--warmup-s", type=float, default=None, help="emulated seconds before measuring (default 3)"
    )
    p.add_argument(
        "--before-s", type=float, default=None, help="measured emulated seconds before the drift (3)"
    )
    p.add_argument("--after-s", type=float, default=None, help="emulated seconds after the drift (default 6)")
    p.set_defaults(run=_runner("drift"))


def _runner(study: str):
    """The `run` of a study command: amoe.perf.studies.<study>.main, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(f"amoe.perf.studies.{study}")
        return module.main(args)

    return run


BENCH_STUDIES = (
    add_bench_compare_command,
    add_bench_plan_check_command,
    add_bench_plan_table_command,
    add_bench_plan_scale_command,
    add_bench_policies_command,
    add_bench_eps_command,
    add_bench_frontier_command,
    add_bench_calibration_command,
    add_bench_policies_sim_command,
    add_bench_waves_emulated_command,
    add_bench_waves_sim_command,
    add_bench_aep_unmerged_command,
    add_bench_repredict_command,
    add_bench_variance_same_plans_command,
    add_bench_offload_replay_command,
    add_bench_offload_locality_command,
    add_bench_trace_derive_command,
    add_bench_barrier_tax_command,
    add_bench_drift_command,
)


def add_commands(top: Any, bench: Any) -> None:
    """`amoe plan` on the top-level subcommands `top`, every study on `amoe bench`'s subcommands `bench` (amoe.cli
    calls this once, after `amoe bench serve`, the load generator's own command)."""
    for add in BENCH_STUDIES:
        add(bench)
    add_plan_command(top)
